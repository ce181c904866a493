"""``python -m simdist.plan``: the command-line entry of plan mode.

The planner lives in ``simdist.sim.plan`` (formulas and rules in its docstring), next to the
step-time model it shares with a run (``simdist.sim.step``); this module keeps the command
(a single plan, ``--search`` over layouts, a scaling table over a list of ``--devices``; see
``simdist.sim.search``) and the import path ``simdist.plan`` that scripts and tests use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from simdist.device.profile import ProfileError, load_profile
from simdist.hostcpu import other_cpu_note
from simdist.sim.plan import (
    PlanConfig,
    Planner,
    PlanResult,
    format_plan,
    plan,
)
from simdist.sim.plan_analytic import DDP_BUCKET_BYTES, Op, transformer_layer_ops
from simdist.sim.plan_shapes import (
    MODELS,
    SHAPE_KEYS,
    CountSpec,
    MLPSpec,
    TransformerSpec,
    layer_activation_bytes,
    model_state_bytes,
)
from simdist.sim.search import (
    SearchSpace,
    format_scaling,
    format_search,
    no_layout_reason,
    scaling,
    scaling_dict,
)

__all__ = [
    "DDP_BUCKET_BYTES",
    "MODELS",
    "CountSpec",
    "MLPSpec",
    "Op",
    "PlanConfig",
    "PlanResult",
    "Planner",
    "TransformerSpec",
    "build_parser",
    "format_plan",
    "layer_activation_bytes",
    "main",
    "model_state_bytes",
    "plan",
    "transformer_layer_ops",
]


class _Parser(argparse.ArgumentParser):
    """Bad flags in one line (what, which flag, where to look), exit 2, nothing written."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _at_least(low: int) -> Callable[[str], int]:
    """An integer flag's type: a count below ``low`` is refused by name, not replaced by a
    default (``--tp 0`` is not --tp 1)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return n

    return parse


def _positive_number(text: str) -> float:
    """A size (``--bucket-mb``): a number > 0."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not x > 0 or math.isinf(x):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return x


def _param_count(text: str) -> int:
    """``--params-count``: a whole number of parameters >= 1 (1.5e9 allowed)."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (1 <= x < math.inf) or x != int(x):
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(x)


POSITIVE = _at_least(1)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m simdist.plan",
        description="Analytic plan mode: memory per device and predicted step time, without "
        "running anything; or the fastest layout that fits (--search).",
        epilog="--model.KEY=VALUE overrides one key of the model's shape (keys: "
        f"{', '.join(SHAPE_KEYS)}). "
        "--search explores dp/tp/pp, ZeRO, micro-batch, recompute, interleaving, sequence "
        "parallelism and precision; --tp, --pp, --zero, --micro-batch, --recompute, "
        "--interleave, --precision and --sequence-parallel then fix that choice.",
    )
    p.add_argument(
        "--model", default=None,
        help=f"a preset ({', '.join(MODELS)}; default gpt2) or a shape YAML file; a name "
        "with a / or a .yaml / .yml suffix is a file (./NAME for a file named like a preset), "
        "any other a preset",
    )  # fmt: skip
    p.add_argument(
        "--params-count", type=_param_count, default=None,
        help="plan model states only, of this many parameters (instead of --model)",
    )  # fmt: skip
    p.add_argument(
        "--devices", default="1", help="devices; a list (8,64,512) gives a scaling table"
    )
    p.add_argument("--profile", default="a100-80gb", help="profile name or YAML path")
    p.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3), help="default 0")
    p.add_argument(
        "--batch", type=POSITIVE, default=8,
        help="samples per data-parallel replica (--search: per device, unless --global-batch)",
    )  # fmt: skip
    p.add_argument("--micro-batch", type=POSITIVE, default=None)
    p.add_argument("--seq", type=POSITIVE, default=None, help="sequence length (default: context)")
    p.add_argument(
        "--precision", default=None, choices=("mixed", "fp32", "bf16", "fp16"),
        help="default mixed; bf16 / fp16: mixed with that half format, planned as simdist.train "
        "runs it (runconfig.precision) where it can",
    )  # fmt: skip
    p.add_argument("--half", default=None, choices=("fp16", "bf16"))
    p.add_argument("--devices-per-node", type=POSITIVE, default=None)
    p.add_argument(
        "--execution",
        choices=("pipelined", "weight_streaming"),
        default=None,
        help="execution mode (default: the profile's; weight_streaming as simdist.train runs it)",
    )
    p.add_argument(
        "--prefetch-depth", type=_at_least(0), default=1, help="weight streaming (default 1)"
    )
    p.add_argument("--tp", type=POSITIVE, default=None, help="tensor-parallel degree (default 1)")
    p.add_argument(
        "--tp-mode", default="weight", choices=("weight", "batch"),
        help="runconfig.tensor_parallel_mode: weight (default; Megatron's split, planned as "
        "simdist.train runs it where it can: fp32 GPT-2 layout, ZeRO 0-2) or batch (the "
        "group's devices divide its batch: data parallelism over every device)",
    )  # fmt: skip
    p.add_argument("--pp", type=POSITIVE, default=None, help="pipeline stages (default 1)")
    p.add_argument(
        "--pipeline-schedule", default="1f1b", choices=("1f1b", "gpipe"),
        help="--pp > 1 on a configuration simdist.train runs: its schedule (default 1f1b)",
    )  # fmt: skip
    p.add_argument("--interleave", type=POSITIVE, default=None, help="virtual stages per device")
    p.add_argument("--recompute", default=None, choices=("none", "selective", "full"))
    p.add_argument("--sequence-parallel", action="store_true", default=None)
    p.add_argument(
        "--no-sequence-parallel", dest="sequence_parallel", action="store_false", default=None,
        help="--search: only layouts without sequence parallelism",
    )  # fmt: skip
    p.add_argument("--no-overlap", action="store_true", help="expose all DP communication")
    p.add_argument("--algorithm", default="ring", choices=("ring", "rhd", "hierarchical", "auto"))
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    p.add_argument("--bucket-mb", type=_positive_number, default=DDP_BUCKET_BYTES / 2**20)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    s = p.add_argument_group("search (--search, or a list of --devices)")
    s.add_argument("--search", action="store_true", help="find the fastest layout that fits")
    s.add_argument("--global-batch", type=POSITIVE, default=None, help="fix it (strong scaling)")
    s.add_argument("--max-tp", type=POSITIVE, default=None, help="default: devices per node")
    s.add_argument("--max-pp", type=POSITIVE, default=None)
    s.add_argument("--max-micro-batch", type=POSITIVE, default=64)
    s.add_argument("--max-interleave", type=POSITIVE, default=None)
    s.add_argument("--top", type=POSITIVE, default=10, help="configurations to print")
    return p


def _model_overrides(rest: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``--model.KEY=VALUE`` (or ``--model.KEY VALUE``) arguments; the others are returned."""
    import yaml

    out: dict[str, Any] = {}
    left: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith("--model."):
            key, eq, value = arg[len("--model.") :].partition("=")
            if not eq:
                if i + 1 >= len(rest):
                    raise ValueError(f"{arg}: expected a value (--model.KEY=VALUE)")
                value, i = rest[i + 1], i + 1
            try:
                out[key] = yaml.safe_load(value)
            except yaml.YAMLError:
                out[key] = value
        else:
            left.append(arg)
        i += 1
    return out, left


def _devices(text: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--devices: expected a number or a list like 8,64,512, got {text!r}"
        ) from None
    if not out or min(out) < 1:
        raise ValueError(f"--devices: expected positive counts, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        overrides, rest = _model_overrides(rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.params_count is not None and (args.model is not None or overrides):
            parser.error("argument --params-count: not with --model or --model.KEY (the count "
                         "replaces the model's shapes): give one of them")  # fmt: skip
        devices = _devices(args.devices)
        base = PlanConfig(
            model=args.model or "gpt2",
            params_count=args.params_count,
            devices=devices[0],
            profile=args.profile,
            zero=0 if args.zero is None else args.zero,
            batch=args.batch,
            micro_batch=args.micro_batch,
            seq=args.seq,
            precision="mixed" if args.precision in (None, "bf16", "fp16") else args.precision,
            half=args.precision if args.precision in ("bf16", "fp16") else args.half,
            devices_per_node=args.devices_per_node,
            execution=args.execution,
            prefetch_depth=args.prefetch_depth,
            pipeline_schedule=args.pipeline_schedule,
            tp=1 if args.tp is None else args.tp,
            tp_mode=args.tp_mode,
            pp=1 if args.pp is None else args.pp,
            interleave=1 if args.interleave is None else args.interleave,
            recompute=args.recompute or "none",
            sequence_parallel=bool(args.sequence_parallel),
            overlap=not args.no_overlap,
            algorithm=args.algorithm,
            optimizer=args.optimizer,
            bucket_bytes=int(args.bucket_mb * 2**20),
            model_overrides=overrides,
        )
        profile = load_profile(args.profile)
        note = other_cpu_note(profile.name, profile.sources.get("cpu"))
        if note:  # on stderr: stdout may be --json's
            print(note, file=sys.stderr)
        if args.search or len(devices) > 1:
            text = _search_main(args, base, devices)
        else:
            result = Planner(base).run()
            text = json.dumps(result.as_dict(), indent=2) if args.json else format_plan(result)
    except (ValueError, ProfileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return _write(text)


def _write(text: str) -> int:
    """Print the result; a reader that closed the pipe (``| head``) ends it quietly, with
    exit status 1 as the Python docs advise for EPIPE, not with a traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # stdout's buffer would fail again at interpreter exit: point it at /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def _search_main(args: argparse.Namespace, base: PlanConfig, devices: list[int]) -> str:
    """The search's (or scaling table's) report; a ValueError where no layout is left."""
    space = SearchSpace(
        global_batch=args.global_batch,
        batch_per_device=args.batch,
        max_tp=args.max_tp,
        max_pp=args.max_pp,
        max_micro_batch=args.max_micro_batch,
        max_interleave=args.max_interleave,
        tp=args.tp,
        pp=args.pp,
        zero=args.zero,
        micro_batch=args.micro_batch,
        recompute=args.recompute,
        interleave=args.interleave,
        sequence_parallel=args.sequence_parallel,
        precision="mixed" if args.precision in ("bf16", "fp16") else args.precision,
    )
    results = scaling(base.model, devices, base.profile, space, base)
    if all(r.considered == 0 for r in results):  # the flags leave no layout to rank
        raise ValueError(
            no_layout_reason(results[0]) + ": relax the flags that fix a choice (--tp, --pp, "
            "--zero, --micro-batch, --interleave, --sequence-parallel, --max-*)"
        )
    if len(results) == 1:
        r = results[0]
        return json.dumps(r.as_dict(), indent=1) if args.json else format_search(r, args.top)
    return json.dumps(scaling_dict(results), indent=1) if args.json else format_scaling(results)


if __name__ == "__main__":
    sys.exit(main())
