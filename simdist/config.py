"""Run configuration: Cerebras-style params.yaml plus command-line overrides.

A params file has the sections ``model``, ``train_input``, ``eval_input``, ``optimizer`` and
``runconfig``. Every section is a frozen dataclass; unknown keys and wrong types are errors
that name the key (``ConfigError``), so a typo never silently trains the wrong thing. Any key
can be overridden as ``--section.key=value`` (the value is parsed as YAML: ``50``, ``null``,
``[256, 256]``). The familiar flags of other systems are aliases (table ``FLAG_ALIASES``).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from simdist.model_config import (
    BERT_SIZES,
    GPT2_SIZES,
    MODEL_CONFIGS,
    T5_SIZES,
    TRANSFORMER_SIZES,
    GPT2ModelConfig,
)
from simdist.typed_yaml import ConfigError, build_dataclass, read_yaml


@dataclass(frozen=True)
class TrainInputConfig:
    data_dir: str | None = None
    batch_size: int | None = 32  # per replica
    global_batch_size: int | None = None
    shuffle: bool = True


@dataclass(frozen=True)
class EvalInputConfig:
    data_dir: str | None = None  # default: the train_input data's held-out split
    batch_size: int = 250  # per replica


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer_type: str = "adamw"
    # a number, or a list of schedulers run in sequence (simdist.lr_schedule)
    learning_rate: float | list[Any] = 1e-3
    warmup_steps: int = 0  # a linear ramp from 0 in front of the learning rate
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.9
    weight_decay: float = 0.0
    max_gradient_norm: float | None = None
    grad_accum_steps: int = 1


@dataclass(frozen=True)
class RunConfig:
    mode: str = "train_and_eval"
    max_steps: int = 500
    # stop this invocation after this many steps (SambaFlow's --steps_this_run): max_steps
    # still sets the schedule's length, and a later run resumes from the checkpoint here
    steps_this_run: int | None = None
    # score this many eval batches per replica (Cerebras' eval_steps); null: the whole
    # held-out set
    eval_steps: int | None = None
    save_summary_steps: int = 50
    save_checkpoints_steps: int = 250
    keep_checkpoint_max: int = 3
    model_dir: str = "model_dir"
    seed: int = 1
    autoload: bool = True
    checkpoint_path: str | None = None
    enable_data_parallel: bool = True
    zero_opt_level: int = 0
    collective_algorithm: str = "auto"
    # Ranks per node: null = as MPI places them (shared-memory split); k = treat every k
    # consecutive ranks as one node (virtual nodes, to study hierarchical collectives and
    # inter-node links on one machine).
    ranks_per_node: int | None = None
    check_collectives: bool = False
    min_world_size: int = 1
    progress_bar: str | bool = "auto"
    stall_timeout_s: float = 300.0  # a step phase lasting longer aborts the job; 0 = off
    device_profile: str = "host"  # simulated accelerator: a name of list_profiles() or a YAML
    reduce_on_device: bool = True  # false: gradients are staged through a host buffer
    trace_steps: int = 3  # steps recorded in model_dir/timeline.json (0: no timeline)
    execution_mode: str = "pipelined"  # or weight_streaming (Cerebras; simdist.streaming)
    weight_servers: int = 1  # weight streaming: ranks holding weights + optimizer state
    prefetch_depth: int = 1  # weight streaming: stages streamed ahead of the computing one
    input_workers_per_replica: int = 0  # CPU ranks per replica preparing its batches
    # SambaFlow's tensor-parallel mode: N devices of one node act as one model instance;
    # "batch" divides its batch among them (batch_size is per group of N)
    tensor_parallel: int = 1
    tensor_parallel_mode: str = "batch"
    # weight mode: LayerNorms and the residual stream on a 1/N share of the tokens
    # (Megatron's --sequence-parallel; simdist.models.gpt2_tp)
    sequence_parallel: bool = False
    # pipeline parallelism: the model's stages split over P consecutive ranks of a replica,
    # micro-batches = grad_accum_steps (simdist.schedules.pipeline)
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    # mixed precision (simdist.precision): fp32 master and optimizer state, half weights,
    # activations and gradients; Lightning's spellings accepted (bf16-mixed, 16-mixed)
    precision: str = "fp32"
    fp32_allreduce: bool = False  # gradients reduced in float32 instead of the half format
    # loss scaling (simdist.loss_scale): null = dynamic for fp16, none otherwise; "dynamic";
    # or a number (static). The rest as torch.amp.GradScaler / DeepSpeed name them.
    loss_scale: float | str | None = None
    initial_loss_scale: float = 65536.0
    loss_scale_growth_interval: int = 2000
    loss_scale_growth_factor: float = 2.0
    loss_scale_backoff_factor: float = 0.5
    loss_scale_hysteresis: int = 1
    min_loss_scale: float = 0.0


@dataclass(frozen=True)
class Params:
    model: Any
    train_input: TrainInputConfig
    eval_input: EvalInputConfig
    optimizer: OptimizerConfig
    runconfig: RunConfig
    source: str = "<defaults>"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


SECTIONS: dict[str, type] = {
    "train_input": TrainInputConfig,
    "eval_input": EvalInputConfig,
    "optimizer": OptimizerConfig,
    "runconfig": RunConfig,
}

# Flags users bring from Cerebras (run.py), SambaFlow and RAF, mapped to params keys.
# Value None means a switch that sets the key to true.
FLAG_ALIASES: dict[str, tuple[str, str | None]] = {
    "--zero_opt_level": ("runconfig.zero_opt_level", "value"),
    "--zero-opt-level": ("runconfig.zero_opt_level", "value"),
    "--multireplica": ("runconfig.enable_data_parallel", None),
    "--data-parallel": ("runconfig.enable_data_parallel", None),
    "--enable_data_parallel": ("runconfig.enable_data_parallel", None),
    "--mode": ("runconfig.mode", "value"),
    "--model_dir": ("runconfig.model_dir", "value"),
    "--checkpoint_path": ("runconfig.checkpoint_path", "value"),
    "--max_steps": ("runconfig.max_steps", "value"),
    "--seed": ("runconfig.seed", "value"),
    "--min-world-size": ("runconfig.min_world_size", "value"),
    "-ws": ("runconfig.min_world_size", "value"),
    "--algorithm": ("runconfig.collective_algorithm", "value"),
    "--device_profile": ("runconfig.device_profile", "value"),
    "--device-profile": ("runconfig.device_profile", "value"),
    "--profile": ("runconfig.device_profile", "value"),
    "--reduce-on-device": ("runconfig.reduce_on_device", None),
    "--reduce_on_device": ("runconfig.reduce_on_device", None),
    "--reduce-on-rdu": ("runconfig.reduce_on_device", None),  # SambaFlow
    "--execution_mode": ("runconfig.execution_mode", "value"),  # Cerebras
    "--weight_servers": ("runconfig.weight_servers", "value"),
    "--prefetch_depth": ("runconfig.prefetch_depth", "value"),
    "--input_workers_per_replica": ("runconfig.input_workers_per_replica", "value"),
    # SambaFlow's data-parallel BERT example (transformers_hook.py run --task_name mlm_ns)
    "-b": ("train_input.batch_size", "value"),
    "--max_seq_length": ("model.max_seq_length", "value"),
    "--max_predictions_per_seq": ("model.max_predictions_per_seq", "value"),
    "--warmup_steps": ("optimizer.warmup_steps", "value"),
    "--logging_steps": ("runconfig.save_summary_steps", "value"),
    "--steps_this_run": ("runconfig.steps_this_run", "value"),
    "--tensor-parallel": ("runconfig.tensor_parallel", "value"),
    "--tensor_parallel": ("runconfig.tensor_parallel", "value"),
    "--tensor-parallel-mode": ("runconfig.tensor_parallel_mode", "value"),
    "--sequence-parallel": ("runconfig.sequence_parallel", None),  # Megatron-LM
    "--sequence_parallel": ("runconfig.sequence_parallel", None),
    "--pipeline-parallel": ("runconfig.pipeline_parallel", "value"),
    "--pipeline_parallel": ("runconfig.pipeline_parallel", "value"),
    "--pipeline-schedule": ("runconfig.pipeline_schedule", "value"),
    "--weight_decay": ("optimizer.weight_decay", "value"),
    "--learning_rate": ("optimizer.learning_rate", "value"),
    "--adam_beta2": ("optimizer.beta2", "value"),
    "--max_grad_norm_clip": ("optimizer.max_gradient_norm", "value"),
}

CHOICES: dict[str, tuple] = {
    "runconfig.mode": ("train", "eval", "train_and_eval"),
    "runconfig.collective_algorithm": ("auto", "ring", "rhd", "hierarchical", "shm", "native"),
    "runconfig.execution_mode": ("pipelined", "weight_streaming"),
    "runconfig.tensor_parallel_mode": ("batch", "weight"),
    "runconfig.pipeline_schedule": ("1f1b", "gpipe"),
    "runconfig.precision": ("fp32", "bf16", "fp16", "32-true", "bf16-mixed", "16-mixed"),
    "runconfig.progress_bar": ("auto", True, False),
    "optimizer.optimizer_type": ("adamw", "sgd"),
    "model.feed_forward_proj": ("relu", "gated-gelu", None),
}


def preset_names() -> list[str]:
    files = resources.files("simdist") / "params"
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def _read_yaml(params: str) -> tuple[dict[str, Any], str, dict[str, int]]:
    """(data, source, line of each key) of a params file or preset."""
    path = Path(params)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"params file {params!r} does not exist")
        text, source = path.read_text(), str(path)
    else:
        preset = resources.files("simdist") / "params" / f"{params}.yaml"
        if not preset.is_file():
            raise ConfigError(
                f"--params {params!r} is neither a file nor a preset; "
                f"presets: {', '.join(preset_names())}"
            )
        text, source = preset.read_text(), f"preset {params}"
    data, lines = read_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    return data, source, lines


def _build(cls: type, values: dict[str, Any], section: str) -> Any:
    return build_dataclass(cls, values, section, CHOICES)


def parse_overrides(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """Split argv into --params and a {"section.key": value} override map."""
    params_arg, overrides, _ = _parse_argv(argv)
    return params_arg, overrides


def _parse_argv(argv: list[str]) -> tuple[str | None, dict[str, Any], dict[str, str]]:
    """parse_overrides, plus each override's flag as typed (for error messages)."""
    params_arg: str | None = None
    overrides: dict[str, Any] = {}
    typed: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in ("--params", "-p"):
            if eq:
                params_arg = inline
            elif i + 1 < len(argv):
                params_arg, i = argv[i + 1], i + 1
            else:
                raise ConfigError("--params needs a file or preset name")
        elif name in FLAG_ALIASES:
            key, kind = FLAG_ALIASES[name]
            if kind is None:
                overrides[key] = _parse_value(inline) if eq else True
            elif eq:
                overrides[key] = _parse_value(inline)
            elif i + 1 < len(argv):
                overrides[key], i = _parse_value(argv[i + 1]), i + 1
                arg = f"{name} {argv[i]}"
            else:
                raise ConfigError(f"{name} needs a value")
            typed[key] = arg
        elif name.startswith("--") and "." in name:
            if not eq:
                if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    inline, i = argv[i + 1], i + 1
                    arg = f"{name} {inline}"
                else:
                    raise ConfigError(f"{name} needs a value: {name}=VALUE")
            overrides[name[2:]] = _parse_value(inline)
            typed[name[2:]] = arg
        else:
            raise ConfigError(
                f"unrecognised argument {arg!r}; use --params FILE_OR_PRESET, "
                f"--section.key=value, or one of {', '.join(sorted(FLAG_ALIASES))}"
            )
        i += 1
    return params_arg, overrides, typed


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def load_params(argv: list[str] | None = None, default: str = "fc_mnist") -> Params:
    """Resolve params from --params (file or preset, default ``fc_mnist``) and overrides.

    A ``ConfigError`` about one key says where its value came from: ``FILE:LINE: ...`` for
    a params file, ``... (from --section.key=VALUE)`` for a command-line override.
    """
    params_arg, overrides, typed = _parse_argv(list(argv or []))
    data, source, lines = _read_yaml(params_arg or default)
    try:
        return _resolve(data, source, overrides)
    except ConfigError as e:
        raise ConfigError(_where(e, source, lines, typed), e.key) from None


_KEY_AT_START = re.compile(r"[A-Za-z_]\w*(?:\.\w+|\[\d+\])+")


def _where(e: ConfigError, source: str, lines: dict[str, int], typed: dict[str, str]) -> str:
    """The message of ``e`` with the origin of the key it is about (if known) added."""
    msg = str(e)
    match = _KEY_AT_START.match(msg)
    key = e.key or (match.group(0) if match else msg.partition(":")[0])
    section_key = ".".join(re.split(r"[.\[]", key)[:2])
    if section_key in typed:  # an override replaces the file's whole value
        return f"{msg} (from {typed[section_key]})"
    if "." not in key:  # about a whole section: name the overrides that went into it
        flags = [flag for k, flag in typed.items() if k.startswith(key + ".")]
        if flags:
            return f"{msg} (from {', '.join(flags)})"
    while key and key not in lines:  # optimizer.learning_rate[0].x -> ...[0] -> ...
        key = re.sub(r"(\.\w+|\[\d+\])$", "", key) if re.search(r"[.\[]", key) else ""
    if key and not msg.startswith(source):
        return f"{source}:{lines[key]}: {msg}"
    return msg


def _resolve(data: dict[str, Any], source: str, overrides: dict[str, Any]) -> Params:
    unknown = sorted(set(data) - set(SECTIONS) - {"model"})
    if unknown:
        raise ConfigError(
            f"unknown section {unknown[0]!r}; sections: model, {', '.join(SECTIONS)}",
            key=unknown[0],
        )
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section not in SECTIONS and section != "model" or not name or "." in name:
            raise ConfigError(
                f"--{key}: expected --section.key=value with section one of "
                f"model, {', '.join(SECTIONS)}"
            )
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(f"section {section!r} must be a mapping", key=section)
        data[section][name] = value
    model_values = data.get("model") or {}
    if isinstance(model_values, dict) and "mixed_precision" in model_values:
        _mixed_precision_alias(data, model_values)
    model_name = model_values.get("name", "fc_mnist") if isinstance(model_values, dict) else None
    if model_name not in MODEL_CONFIGS:
        raise ConfigError(
            f"model.name: unknown model {model_name!r}; available: {', '.join(MODEL_CONFIGS)}"
        )
    model = _build(MODEL_CONFIGS[model_name], model_values, "model")
    sections = {name: _build(cls, data.get(name) or {}, name) for name, cls in SECTIONS.items()}
    params = Params(model=model, source=source, **sections)
    validate(params)
    return params


def _mixed_precision_alias(data: dict[str, Any], model_values: dict[str, Any]) -> None:
    """Cerebras' ``model.mixed_precision: true`` is fp16 mixed precision (false: fp32)."""
    mixed = model_values.pop("mixed_precision")
    if not isinstance(mixed, bool):
        raise ConfigError(
            f"model.mixed_precision must be true or false, got {mixed!r}", "model.mixed_precision"
        )
    run = data.setdefault("runconfig", {})
    if not isinstance(run, dict):
        return  # the section's own error follows
    wanted = "fp16" if mixed else "fp32"
    given = run.get("precision")
    from simdist.precision import canonical

    if given is not None and canonical(given) != wanted:
        raise ConfigError(
            f"model.mixed_precision={str(mixed).lower()} means runconfig.precision {wanted}, "
            f"but runconfig.precision is {given}: give one of the two",
            "model.mixed_precision",
        )
    run["precision"] = wanted


def _at_least(n: int | float) -> Callable[[Any], bool]:
    return lambda v: v >= n


def _unit(v: float) -> bool:
    return 0.0 <= v < 1.0


# key -> (check, rule as the error message and the README state it). A check sees the typed,
# finite value and is skipped for null; choices are in CHOICES, types in the dataclasses.
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.hidden_sizes": (lambda v: bool(v) and min(v) >= 1, "a non-empty list of sizes >= 1"),
    "model.input_size": (_at_least(1), ">= 1"),
    "model.num_classes": (_at_least(2), ">= 2"),
    **{f"model.{k}": (_at_least(1), ">= 1") for k in GPT2_SIZES},
    **{f"model.{k}": (_at_least(1), ">= 1") for k in BERT_SIZES},
    **{f"model.{k}": (_at_least(1), ">= 1") for k in T5_SIZES},
    **{f"model.{k}": (_at_least(1), ">= 1") for k in TRANSFORMER_SIZES},
    "model.dropout": (_unit, "in [0, 1)"),
    "model.label_smoothing": (_unit, "in [0, 1)"),
    "model.greedy_eval_samples": (_at_least(0), ">= 0"),
    "model.dropout_rate": (_unit, "in [0, 1)"),
    "model.hidden_dropout_prob": (_unit, "in [0, 1)"),
    "model.attention_probs_dropout_prob": (_unit, "in [0, 1)"),
    "model.layer_norm_eps": (lambda v: 0.0 < v < 1.0, "in (0, 1)"),
    "train_input.data_dir": (bool, "a non-empty path"),
    "train_input.batch_size": (_at_least(1), ">= 1"),
    "train_input.global_batch_size": (_at_least(1), ">= 1"),
    "eval_input.data_dir": (bool, "a non-empty path"),
    "eval_input.batch_size": (_at_least(1), ">= 1"),
    "optimizer.warmup_steps": (_at_least(0), ">= 0"),
    "optimizer.beta1": (_unit, "in [0, 1)"),
    "optimizer.beta2": (_unit, "in [0, 1)"),
    "optimizer.eps": (lambda v: v > 0, "> 0"),
    "optimizer.momentum": (_unit, "in [0, 1)"),
    "optimizer.weight_decay": (_at_least(0), ">= 0"),
    "optimizer.max_gradient_norm": (lambda v: v > 0, "> 0"),
    "optimizer.grad_accum_steps": (_at_least(1), ">= 1"),
    "runconfig.max_steps": (_at_least(0), ">= 0"),
    "runconfig.steps_this_run": (_at_least(1), ">= 1"),
    "runconfig.eval_steps": (_at_least(1), ">= 1"),
    "runconfig.save_summary_steps": (_at_least(1), ">= 1"),
    "runconfig.save_checkpoints_steps": (_at_least(0), ">= 0"),
    "runconfig.keep_checkpoint_max": (_at_least(0), ">= 0"),
    "runconfig.model_dir": (bool, "a non-empty path"),
    "runconfig.seed": (_at_least(0), ">= 0"),  # numpy's generators refuse negative seeds
    "runconfig.checkpoint_path": (bool, "a non-empty path"),
    "runconfig.zero_opt_level": (lambda v: v in (0, 1, 2, 3), "0, 1, 2 or 3"),
    "runconfig.ranks_per_node": (_at_least(1), ">= 1"),
    "runconfig.min_world_size": (_at_least(1), ">= 1"),
    "runconfig.stall_timeout_s": (_at_least(0), ">= 0"),
    "runconfig.device_profile": (bool, "a profile name or a YAML file"),
    "runconfig.trace_steps": (_at_least(0), ">= 0"),
    "runconfig.weight_servers": (_at_least(1), ">= 1"),
    "runconfig.prefetch_depth": (_at_least(0), ">= 0"),
    "runconfig.input_workers_per_replica": (_at_least(0), ">= 0"),
    "runconfig.tensor_parallel": (_at_least(1), ">= 1"),
    "runconfig.pipeline_parallel": (_at_least(1), ">= 1"),
    "runconfig.loss_scale": (
        lambda v: v == "dynamic" if isinstance(v, str) else v > 0,
        '"dynamic" or a number > 0',
    ),
    "runconfig.initial_loss_scale": (lambda v: v > 0, "> 0"),
    "runconfig.loss_scale_growth_interval": (_at_least(1), ">= 1"),
    "runconfig.loss_scale_growth_factor": (lambda v: v > 1, "> 1"),
    "runconfig.loss_scale_backoff_factor": (lambda v: 0 < v < 1, "in (0, 1)"),
    "runconfig.loss_scale_hysteresis": (_at_least(1), ">= 1"),
    "runconfig.min_loss_scale": (_at_least(0), ">= 0, at most initial_loss_scale"),
}
# What a value means where the rule alone does not say (README, and some messages).
NOTES: dict[str, str] = {
    "optimizer.learning_rate": "finite, > 0; or a list of schedulers (simdist.lr_schedule)",
    "optimizer.max_gradient_norm": "null: no clipping",
    "train_input.batch_size": "per replica; give exactly one of the two batch sizes",
    "train_input.global_batch_size": "divisible by replicas x grad_accum_steps",
    "runconfig.save_checkpoints_steps": "0: none (but on a stop signal or steps_this_run)",
    "runconfig.steps_this_run": "null: to max_steps; stops early, checkpointed, schedule kept",
    "runconfig.eval_steps": "eval batches per replica; null: the whole held-out set",
    "runconfig.keep_checkpoint_max": "0: keep all",
    "runconfig.zero_opt_level": (
        "> 0 needs enable_data_parallel, pipelined only; 3: all but transformer"
    ),
    "runconfig.ranks_per_node": "null: as MPI places ranks; pipelined only",
    "runconfig.stall_timeout_s": "0 turns the watchdog off",
    "runconfig.check_collectives": "false: op/length/dtype hash; true: full signature",
    "runconfig.min_world_size": "at most the number of ranks started",
    "runconfig.weight_servers": "weight_streaming only; fewer than the ranks",
    "runconfig.prefetch_depth": "weight_streaming only",
    "runconfig.tensor_parallel": "ranks per group, on one node; divides the ranks",
    "runconfig.tensor_parallel_mode": (
        "batch: batch_size per group, split over it; weight: gpt2's layers split "
        "(Megatron), ZeRO 0-2 (0-3 with a pipeline), on each stage of a pipeline"
    ),
    "runconfig.sequence_parallel": (
        "tensor_parallel > 1, weight mode; model.block_size divisible by tensor_parallel"
    ),
    "runconfig.pipeline_parallel": (
        "stages per replica; ranks: TP innermost, then PP, then DP; ZeRO 0-3"
    ),
    "runconfig.pipeline_schedule": "micro-batches: optimizer.grad_accum_steps",
    "runconfig.precision": (
        "half: pipelined, data/tensor(batch)-parallel; model.mixed_precision: fp16"
    ),
    "runconfig.loss_scale": "null: dynamic in fp16, none otherwise; a number: static",
    "model.n_head": "divides n_embd",
}
# model.preset's names per model, checked here so an unknown one is reported with where it
# was written (the models' PRESETS hold the sizes; a test keeps the names equal)
PRESET_NAMES: dict[str, tuple[str, ...]] = {
    "gpt2": ("gpt2-mini", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"),
    "bert": ("bert-mini", "bert-base", "bert-large"),
    "t5": ("t5-mini", "t5-small", "t5-base"),
    "transformer": ("transformer-mini", "transformer-base", "transformer-big"),
}


def _rule_error(key: str, rule: str, value: Any) -> ConfigError:
    hint = {
        "runconfig.stall_timeout_s": " (0 turns the watchdog off)",
    }.get(key, "")
    return ConfigError(f"{key} must be {rule}, got {value!r}{hint}", key)


def validate(p: Params) -> None:
    """Each key's range (``RULES``), then the rules across keys that a type check cannot see."""
    for section in ("model", *SECTIONS):
        for f in dataclasses.fields(getattr(p, section)):
            key, value = f"{section}.{f.name}", getattr(getattr(p, section), f.name)
            if key in RULES and value is not None and not RULES[key][0](value):
                raise _rule_error(key, RULES[key][1], value)
    t, o, r, m = p.train_input, p.optimizer, p.runconfig, p.model
    preset = getattr(m, "preset", None)
    if preset is not None and preset not in PRESET_NAMES[m.name]:
        raise ConfigError(
            f"model.preset: unknown {preset!r} for model {m.name}; choose from "
            f"{', '.join(PRESET_NAMES[m.name])}, or null and give every size",
            "model.preset",
        )
    if (t.batch_size is None) == (t.global_batch_size is None):
        raise ConfigError(
            "train_input: give exactly one of batch_size (per replica) and global_batch_size "
            "(set the other to null)"
        )
    if isinstance(m, GPT2ModelConfig) and m.n_embd and m.n_head and m.n_embd % m.n_head:
        raise ConfigError(
            f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head}): "
            "each head gets n_embd / n_head columns",
            "model.n_embd",
        )
    from simdist.lr_schedule import ScheduleError, parse_schedule

    try:
        parse_schedule(o.learning_rate, o.warmup_steps, r.max_steps)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    if r.zero_opt_level > 0 and not r.enable_data_parallel:
        raise ConfigError(
            "runconfig.zero_opt_level > 0 needs runconfig.enable_data_parallel: true",
            "runconfig.zero_opt_level",
        )
    if r.execution_mode == "weight_streaming" and r.zero_opt_level:
        raise ConfigError(
            "runconfig.zero_opt_level applies to pipelined execution: weight streaming keeps "
            "the optimizer state on the weight servers (set it to 0)",
            "runconfig.zero_opt_level",
        )
    if r.ranks_per_node is not None and r.execution_mode != "pipelined":
        raise ConfigError(
            "runconfig.ranks_per_node (virtual nodes) applies to pipelined execution only; "
            "weight streaming uses the placement MPI reports (set it to null)",
            "runconfig.ranks_per_node",
        )
    if r.sequence_parallel and (r.tensor_parallel < 2 or r.tensor_parallel_mode != "weight"):
        raise ConfigError(
            "runconfig.sequence_parallel splits the tokens between a weight-mode tensor-"
            "parallel group's layers: it needs runconfig.tensor_parallel > 1 (this run: "
            f"{r.tensor_parallel}) and runconfig.tensor_parallel_mode weight (this run: "
            f"{r.tensor_parallel_mode})",
            "runconfig.sequence_parallel",
        )
    if r.tensor_parallel > 1:
        _check_tensor_parallel(p)
    if r.pipeline_parallel > 1:
        _check_pipeline_parallel(r)
    _check_precision(p)
    if r.execution_mode != "weight_streaming":
        defaults = RunConfig()
        for name in ("weight_servers", "prefetch_depth"):
            if getattr(r, name) != getattr(defaults, name):
                raise ConfigError(
                    f"runconfig.{name} applies to execution_mode weight_streaming only "
                    f"(execution_mode is {r.execution_mode})",
                    f"runconfig.{name}",
                )
    from simdist.device.profile import ProfileError, load_profile  # yaml only, no MPI

    try:
        load_profile(r.device_profile)
    except ProfileError as e:
        raise ConfigError(f"runconfig.device_profile: {e}") from None


def _check_precision(p: Params) -> None:
    from simdist.precision import canonical

    r = p.runconfig
    if r.min_loss_scale > r.initial_loss_scale:
        raise ConfigError(
            f"runconfig.min_loss_scale={r.min_loss_scale} must be at most "
            f"runconfig.initial_loss_scale={r.initial_loss_scale}",
            "runconfig.min_loss_scale",
        )
    if canonical(r.precision) == "fp32":
        return
    where = f"runconfig.precision={r.precision}"
    if p.model.name not in ("fc_mnist", "gpt2", "bert", "t5", "transformer"):
        raise ConfigError(
            f"{where}: mixed precision runs fc_mnist, gpt2, bert, t5 and transformer; model "
            f"{p.model.name} trains in fp32 (runconfig.precision: fp32)",
            "runconfig.precision",
        )


def _check_tensor_parallel(p: Params) -> None:
    r, t = p.runconfig, p.train_input
    if r.execution_mode != "pipelined" or r.input_workers_per_replica:
        raise ConfigError(
            "runconfig.tensor_parallel applies to pipelined execution without input workers",
            "runconfig.tensor_parallel",
        )
    if r.tensor_parallel_mode == "weight":
        _check_weight_mode(p)
        return
    if t.batch_size is not None and t.batch_size % r.tensor_parallel:
        raise ConfigError(
            f"train_input.batch_size={t.batch_size} is the batch of one tensor-parallel group "
            f"and is divided among its {r.tensor_parallel} devices: give a multiple of "
            f"{r.tensor_parallel}",
            "train_input.batch_size",
        )


def _check_weight_mode(p: Params) -> None:
    """What tensor parallelism in weight mode (``simdist.schedules.tensor_parallel``)
    supports (every precision); the split itself is checked on the resolved model (heads,
    vocabulary)."""
    r = p.runconfig
    where = "runconfig.tensor_parallel_mode=weight"
    why, key = None, "runconfig.tensor_parallel_mode"
    if p.model.name != "gpt2":
        why = (
            f"(layers split Megatron-style) runs model.name gpt2 only, not {p.model.name}; "
            "use tensor_parallel_mode batch for it"
        )
    elif r.zero_opt_level > 2 and r.pipeline_parallel == 1:
        why = (
            f"runs ZeRO 0-2 on the data-parallel axis, not zero_opt_level={r.zero_opt_level} "
            "(ZeRO-3 runs with runconfig.pipeline_parallel > 1)"
        )
        key = "runconfig.zero_opt_level"
    if why:
        raise ConfigError(f"{where} {why}", key)
    # heads, MLP width and vocabulary divisible by the degree: GPT2TP checks at start-up,
    # before anything is written (config must not import the models: they import it)


def _check_pipeline_parallel(r: RunConfig) -> None:
    """What pipeline parallelism composes with (the world-size and model checks come at
    launch, ``simdist.schedules.pipeline``)."""
    why = None
    if r.execution_mode != "pipelined":
        why = (
            f"applies to pipelined execution, not execution_mode={r.execution_mode}; set "
            "runconfig.pipeline_parallel to 1 or runconfig.execution_mode to pipelined"
        )
    elif r.input_workers_per_replica:
        why = (
            "applies to pipelined execution without input workers (every stage reads its "
            f"micro-batches itself), not runconfig.input_workers_per_replica="
            f"{r.input_workers_per_replica}; set it to 0"
        )
    if why:
        raise ConfigError(
            f"runconfig.pipeline_parallel={r.pipeline_parallel} {why}",
            "runconfig.pipeline_parallel",
        )


def _short_type(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return f"list[{_short_type(args[0])}]" if args[0] is not Any else "list"
    if args:
        names = " \\| ".join(_short_type(a) for a in args)
        return names + (" \\| null" if type(None) in typing.get_args(annotation) else "")
    return getattr(annotation, "__name__", str(annotation))


def usage() -> str:
    """``python -m simdist.train --help``: how to call it, the presets, the flags and every
    key (the README's key table, as plain columns)."""
    aliases: dict[str, list[str]] = {}
    for flag, (key, _) in FLAG_ALIASES.items():
        aliases.setdefault(key, []).append(flag)
    rows = [line.strip("|").split(" | ") for line in key_table().splitlines()[2:]]
    rows = [[c.strip().replace("`", "").replace("\\|", "|") for c in r] for r in rows]
    width = max(len(r[0]) for r in rows)
    return "\n".join(
        [
            "usage: mpiexec -n N python -m simdist.train [--params FILE_OR_PRESET] "
            "[--section.key=VALUE ...]",
            "",
            "Trains (runconfig.mode: train, eval, train_and_eval) with every rank a simulated",
            "device; model_dir receives checkpoints, events, eval.json and performance.json.",
            f"presets (--params): {', '.join(preset_names())} (default fc_mnist)",
            "",
            "flags (each sets a key):",
            *(f"  {', '.join(flags):<{width}}  {key}" for key, flags in aliases.items()),
            "",
            "keys (--section.key=VALUE; type, default, rule):",
            *(
                f"  {r[0]:<{width}}  {r[1]}, default {r[2]}" + (f"; {r[3]}" if r[3] else "")
                for r in rows
            ),  # fmt: skip
        ]
    )


def key_table() -> str:
    """The README's table of every key: type, default and rule (a test keeps the two equal).

    Every number must also be finite; a key a model does not have is an unknown-key error.
    """
    rows = ["| key | type | default | rule |", "| --- | --- | --- | --- |"]
    rows.append("| `model.name` | str | `fc_mnist` | one of " + ", ".join(MODEL_CONFIGS) + " |")
    models = [(f"model.*` ({n})", c) for n, c in MODEL_CONFIGS.items()]
    for label, cls in [*models, *((f"{n}.*`", c) for n, c in SECTIONS.items())]:
        section = label.split(".")[0]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            if key == "model.name":
                continue
            choices = CHOICES.get(key)
            rule = ("one of " + ", ".join(str(c).lower() for c in choices)) if choices else ""
            rule = rule or RULES.get(key, (None, ""))[1]
            note = NOTES.get(key, "")
            if key == "model.preset":
                names = PRESET_NAMES[label.split("(")[-1].rstrip(")")]
                note = f"{', '.join(names)}; null: give all sizes"
            rule = f"{rule}; {note}" if rule and note else rule or note
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            default = "null" if default is None else str(default).lower()
            shown = f"`{key}`" + (label[len(section) + 3 :] if section == "model" else "")
            rows.append(f"| {shown} | {_short_type(hints[f.name])} | `{default}` | {rule} |")
    return "\n".join(rows)


def batch_sizes(p: Params, world: int) -> tuple[int, int]:
    """(per-replica micro-batch, global batch per optimizer step) for this world size."""
    t, accum = p.train_input, p.optimizer.grad_accum_steps
    replicas = world
    tp = p.runconfig.tensor_parallel  # batch mode: batch_size is per group of tp ranks
    if t.global_batch_size is None and tp > 1 and p.runconfig.tensor_parallel_mode == "batch":
        return t.batch_size // tp, t.batch_size // tp * replicas * accum
    if t.global_batch_size is not None:
        if t.global_batch_size % (replicas * accum):
            raise ConfigError(
                f"train_input.global_batch_size={t.global_batch_size} is not divisible by "
                f"replicas x grad_accum_steps = {replicas} x {accum}; choose a multiple of "
                f"{replicas * accum} or give train_input.batch_size per replica instead"
            )
        return t.global_batch_size // (replicas * accum), t.global_batch_size
    return t.batch_size, t.batch_size * replicas * accum


def dump_yaml(p: Params) -> str:
    return yaml.safe_dump(p.to_dict(), sort_keys=False)
