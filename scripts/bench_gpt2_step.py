"""Time one GPT-2 training step (forward + backward + AdamW) in a single process.

    python scripts/bench_gpt2_step.py [--preset gpt2-mini] [--batch 8] [--seq 128]
        [--steps 10] [--profile] [--torch]

Prints tokens/s, the achieved GFLOP/s (``GPT2.flops_per_sample``: matrix products only,
nanoGPT's 6N + 12LCT convention) and, measured in the same run, the single-core float32
GEMM rate of NumPy and of the kernels' ``blas.gemm`` (oneMKL on Intel where installed,
oneDNN's sgemm on AMD's AVX-512 kind where installed, else SciPy's OpenBLAS) on a 256x768
@ 768x3072 product, and the CPU model and ISA flags (``--json FILE`` writes them with the
figures). ``--profile`` adds time per kernel, next to what the simulated device of
``--device-profile`` (default ``host``) predicts for it (``GPT2.kernel_costs`` on the cost
model: which kernels the host model gets wrong);
``--torch`` times the PyTorch eager twin of tests/test_gpt2_parity.py on the same shapes,
its steps interleaved with simdist's.
OpenBLAS picks its kernel from OPENBLAS_CORETYPE: compare runs with the same environment.
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per process before numpy loads)

# isort: split
import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections import defaultdict

import numpy as np
from simdist.kernels.registry import warm_all

from simdist.arena import Layout
from simdist.config import OptimizerConfig
from simdist.models import gpt2 as gpt2_module
from simdist.models.base import GradientViews
from simdist.models.gpt2 import GPT2, flops_per_sample, resolve_config
from simdist.optim import Optimizer


def gemm_rates(reps: int = 10, rounds: int = 3) -> tuple[float, float]:
    """GFLOP/s of numpy and the kernels' float32 GEMM, 256x768 @ 768x3072, one thread.

    Best of ``rounds`` rounds of ``reps`` products: on a shared machine the best round is
    the closest to what the core can do.
    """
    from simdist.kernels.blas import gemm

    one, zero = np.float32(1.0), np.float32(0.0)

    def dot_out(a, b, out):
        gemm(a, b, out, one, zero)

    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 768), dtype=np.float32)
    b = rng.standard_normal((768, 3072), dtype=np.float32)
    out = np.empty((256, 3072), np.float32)
    flops = 2 * 256 * 768 * 3072
    rates = []
    for fn in (lambda: np.dot(a, b, out), lambda: dot_out(a, b, out)):
        fn()
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, time.perf_counter() - t)
        rates.append(flops * reps / best / 1e9)
    return rates[0], rates[1]


def instrument(names: list[str]) -> dict[str, list[float]]:
    """Wrap the kernels gpt2.py calls with timers (adds ~1 us per call)."""
    times: dict[str, list[float]] = defaultdict(list)
    for name in names:
        fn = getattr(gpt2_module, name)

        def timed(*args, _fn=fn, _name=name):
            t = time.perf_counter()
            _fn(*args)
            times[_name].append(time.perf_counter() - t)

        setattr(gpt2_module, name, timed)
    return times


def kernel_of(name: str, phase: str) -> str:
    """The kernels/ function that runs a ``gpt2_costs`` entry (its name and phase)."""
    fwd = phase == "forward"
    side = "forward" if fwd else "backward"
    if name == "h.0.ln_1":  # the only layernorm without a residual add in front
        return "layernorm_forward"
    if ".ln_" in name or name.startswith("ln_f"):
        if fwd:
            return "residual_layernorm_forward"
        return "layernorm_backward" if name == "ln_f.bwd" else "layernorm_backward_accumulate"
    if not fwd and (".mlp.c_proj" in name or ".mlp.gelu" in name):
        return "linear_gelu_backward"  # float32: the GELU's gradient fused into c_proj's
    if fwd and (".mlp.c_fc" in name or ".mlp.gelu" in name):
        return "linear_gelu_forward"  # float32: the GELU fused into c_fc's bias pass
    if any(p in name for p in ("c_attn", "c_proj", "c_fc")):
        return f"linear_{side}"
    if ".attn." in name:
        return f"attention_{side}"
    for stem, kernel in (
        ("gelu", "gelu"),
        ("lm_head", "lm_head"),
        ("softmax_ce", "softmax_cross_entropy"),
    ):
        if name.startswith(stem) or f".{stem}" in name:
            return f"{kernel}_{side}"
    if name == "embedding":
        return "embedding_forward"
    if name == "embedding.bwd":
        return "embedding_backward_accumulate"
    return f"({name})"  # not a kernel call: batch copy, zeroing


def predicted_per_kernel(model, cfg, B: int, T: int, profile: str) -> dict[str, float]:
    """Seconds per step of each kernel function on ``profile``, from ``model.kernel_costs``;
    the working set is the step's resident bytes (parameters, gradients, AdamW's two
    moments, activations), as the training run's simulation keys it."""
    from simdist.device import CostModel, load_profile

    n = model.num_parameters()
    cost = CostModel(load_profile(profile), working_set=16.0 * n + model.activation_bytes(B))
    out: dict[str, float] = defaultdict(float)
    for k in model.kernel_costs(B, T):
        t = cost.compute_time(k.flops, k.bytes, k.kind, "fp32", k.shape, k.serial_flops)
        out[kernel_of(k.name, k.phase)] += k.count * t
    return out


def profile_note(profile: str) -> str | None:
    """Why predictions on ``profile`` may not describe this CPU (None: they do, as far as
    the profile says). A calibrated profile names its CPU; the packaged ``host`` profile
    was written before profiles did, on whichever machine ran calibrate last."""
    from simdist.device import load_profile
    from simdist.hostcpu import other_cpu_note

    p = load_profile(profile)
    if "calibrate" in p.sources and "cpu" not in p.sources:
        return (
            f"note: device profile '{p.name}' names no CPU, so it may describe another "
            "machine: `mpiexec -n 2 python -m simdist.calibrate --out F` measures this one "
            "(then --device-profile F)"
        )
    return other_cpu_note(p.name, p.sources.get("cpu"))


def torch_step_fn(cfg, B: int, T: int):
    """One PyTorch eager training step (the parity test's model, AdamW), as a closure."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_gpt2_parity import TorchGPT2

    model = TorchGPT2(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))

    def step() -> None:
        loss = model(tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2-mini")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--device-profile", default="host", help="profile of --profile's predictions")
    ap.add_argument("--json", help="write the figures, CPU model and ISA flags to this file")
    args = ap.parse_args()

    cfg = resolve_config(args.preset)
    B, T = args.batch, args.seq
    model = GPT2(cfg)
    layout = Layout(model.parameter_specs(), world=1)
    pflat = np.zeros(layout.padded, np.float32)
    gflat = np.zeros(layout.padded, np.float32)
    params, grads = layout.views(pflat), GradientViews(layout.views(gflat))
    model.init_parameters(params, np.random.default_rng(0))
    model.allocate(B)
    ocfg = OptimizerConfig(learning_rate=1e-4, weight_decay=0.1)
    opt = Optimizer(ocfg, layout, 0, layout.padded, lambda kind, name, n: np.zeros(n, np.float32))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    warm_all()

    kernels = [n for n in vars(gpt2_module) if n.endswith(("_forward", "_backward", "_accumulate"))]
    times = instrument(kernels) if args.profile else {}
    torch_step = torch_step_fn(cfg, B, T) if args.torch else None
    step_times, torch_times = [], []
    # two untimed steps (first touch of the arena); with --torch the two frameworks take
    # turns step by step, so both see the same load on a shared machine
    for step in range(args.steps + 2):
        t = time.perf_counter()
        model.forward(params, tokens, targets)
        model.backward(params, grads, 1.0 / B)
        t_opt = time.perf_counter()
        opt.step(pflat, gflat, step + 1, ocfg.learning_rate)
        t_end = time.perf_counter()
        step_times.append((t_end - t, t_end - t_opt))
        if step == 1:
            for v in times.values():
                v.clear()
        if torch_step is not None:
            t = time.perf_counter()
            torch_step()
            torch_times.append(time.perf_counter() - t)
    measured = step_times[2:]
    step_s = float(np.median([s for s, _ in measured]))
    best_s = min(s for s, _ in measured)
    opt_s = float(np.median([o for _, o in measured]))
    # FLOPs of sequences of T tokens (attention's share grows as T**2)
    flops = flops_per_sample(dataclasses.replace(cfg, block_size=T)) * B
    np_rate, nb_rate = gemm_rates()

    from simdist.kernels.blas import library

    from simdist.hostcpu import cpu_info

    cpu = cpu_info()
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(
        f"# cpu: {cpu['model']} ({cpu['vendor']}, family/model/stepping "
        f"{cpu['family_model_stepping']}); ISA: {' '.join(cpu['isa']) or '-'}; "
        f"kernels' BLAS: {library()}; load {os.getloadavg()[0]:.2f}"
    )
    env = {k: os.environ.get(k, "(unset)") for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    print(f"# {env}")
    print(
        f"{args.preset} B={B} T={T}: step {step_s * 1e3:.1f} ms median, {best_s * 1e3:.1f} ms "
        f"best (AdamW {opt_s * 1e3:.1f} ms)"
    )
    print(f"  tokens/s        {B * T / step_s:10.0f}   (best step {B * T / best_s:.0f})")
    print(f"  GFLOP/s (step)  {flops / step_s / 1e9:10.1f}   ({flops / 1e9:.2f} GFLOP per step)")
    print(f"  GEMM GFLOP/s    {np_rate:10.1f} numpy, {nb_rate:.1f} kernels' gemm ({library()})")
    print(
        f"  step / GEMM     {flops / step_s / 1e9 / max(np_rate, nb_rate):10.3f}   (of the faster)"
    )
    result = {
        "cpu": cpu,
        "kernels_blas": library(),
        "loadavg": os.getloadavg(),
        "preset": args.preset,
        "batch": B,
        "seq": T,
        "step_ms": step_s * 1e3,
        "tokens_per_sec": B * T / step_s,
        "gflops": flops / step_s / 1e9,
        "gemm_gflops_numpy": np_rate,
        "gemm_gflops_kernels": nb_rate,
    }
    if torch_step is not None:
        torch_s = float(np.median(torch_times[2:]))
        print(
            f"  torch eager     {B * T / torch_s:10.0f}   tokens/s ({torch_s * 1e3:.1f} ms/step, "
            f"interleaved); simdist / torch = {torch_s / step_s:.2f}"
        )
    if args.profile:
        n_steps = len(measured)
        total = sum(sum(v) for v in times.values()) / n_steps
        pred = predicted_per_kernel(model, cfg, B, T, args.device_profile)
        print(
            f"  per step, by kernel (sum {total * 1e3:.1f} ms, + AdamW {opt_s * 1e3:.1f} ms), "
            f"and predicted on {args.device_profile} (sum {sum(pred.values()) * 1e3:.1f} ms):"
        )
        for name, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
            ms = sum(v) / n_steps * 1e3
            p = pred.pop(name, 0.0) * 1e3
            err = f"{100 * (p - ms) / ms:+5.0f} %" if ms else ""
            calls = len(v) // n_steps
            print(f"    {name:34s} {ms:7.2f} ms  {calls:3d} calls   predicted {p:7.2f} ms {err}")
        for name, t in pred.items():  # costed work outside the timed kernel calls
            print(f"    {name:34s}       -              predicted {t * 1e3:7.2f} ms")
        note = profile_note(args.device_profile)
        if note:
            print(f"  {note}")
        result["kernels_ms"] = {n: sum(v) / n_steps * 1e3 for n, v in times.items()}
    if torch_step is not None:
        result["torch_tokens_per_sec"] = B * T / float(np.median(torch_times[2:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
