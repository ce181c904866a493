"""Mixed-precision speed: simdist fp32 / bf16 / fp16 against PyTorch fp32 and bf16 autocast.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_precision.py \
        [--models fc_mnist,gpt2-mini] [--repeats 3] [--json FILE] [--no-torch] [--words]
    (also: python scripts/bench_train.py --precision bf16, which runs this)

Every measurement is a fresh single-rank process, one thread: ``mpiexec -n 1 python -m
simdist.train --runconfig.precision=P`` and a PyTorch eager loop on the same model and
batch, in float32 and under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (PyTorch's CPU
mixed precision: bf16 matrix products through oneDNN, which uses AVX512_BF16 / AMX where
the CPU has them). Both are timed as ``bench_train.py`` times them: samples/s of the
median step (simdist: performance.json's ``measured_step_time_median_s``; PyTorch: after
its warm-up). The runs are interleaved and repeated; the table shows the median of the
repeats and each precision's step time relative to the same implementation's fp32 (the
paired ratio: the median of the per-repeat ratios). Issue #17's target: simdist bf16 no
slower than 1.3x its fp32 (simdist emulates bf16 around float32 BLAS: products of half
values, float32 accumulation; the rounding passes are the cost).

``--words`` adds simdist bf16 with its weights as float32 words on the host
(``SIMDIST_PACK_WEIGHTS=0``; the default keeps them as 16-bit words where that saves memory,
``simdist.packed_params``), and every simdist row shows performance.json's host bytes of
the weights and the process's peak resident memory.
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per process before numpy loads)

# isort: split
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_train import (
    MODELS,
    machine_info,
    mlp_sizes,
    simdist_args,
    steady_rate,
    torch_threads_and_subnormals,
)

REPO = Path(__file__).resolve().parents[1]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
STEPS = {"fc_mnist": 300, "gpt2-mini": 30}


FLOAT32_WORDS = "bf16/f32w"  # bf16 with the weights as float32 words on the host
HOST: dict[tuple[str, str], list[tuple[int, int]]] = {}  # (model, precision) -> memory


def run_simdist(model: str, steps: int, label: str) -> float:
    env, precision = dict(os.environ), label
    if label == FLOAT32_WORDS:
        precision, env["SIMDIST_PACK_WEIGHTS"] = "bf16", "0"
    with tempfile.TemporaryDirectory() as d:
        cmd = [MPIEXEC, "-n", "1", sys.executable, "-m", "mpi4py", "-m", "simdist.train"]
        cmd += [*simdist_args(model, steps, f"{d}/run"), f"--runconfig.precision={precision}"]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
        if out.returncode:
            raise RuntimeError(f"simdist failed:\n{out.stdout}\n{out.stderr}")
        perf = json.loads(Path(d, "run", "performance.json").read_text())
        HOST.setdefault((model, label), []).append(
            (perf["host_parameter_bytes"], perf["peak_rss_bytes"])
        )
        return steady_rate(perf)


def run_torch(model: str, steps: int, precision: str) -> float:
    cmd = [sys.executable, __file__, "--worker", model, "--steps", str(steps)]
    cmd += ["--precision", precision]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"torch worker failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])["samples_per_sec"]


def torch_worker(model: str, steps: int, precision: str) -> None:
    """PyTorch eager, one thread, fused AdamW, subnormals flushed (as bench_train's);
    bf16 under CPU autocast. Prints samples/s of the median step after the warm-up."""
    import torch

    from simdist.testing.torch_reference import TorchGPT2, TorchMLP

    torch_threads_and_subnormals(torch)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    batch = MODELS[model][1]
    if model == "fc_mnist":
        from simdist.data.mnist import load_mnist

        m = load_mnist()
        x_all, y_all = torch.from_numpy(m.x_train), torch.from_numpy(m.y_train).long()
        net = TorchMLP(mlp_sizes())

        def batch_at(i):
            idx = torch.from_numpy(rng.integers(0, len(x_all), batch))
            return x_all[idx], y_all[idx]
    else:
        from simdist.data.text import load_text_tokens
        from simdist.models.gpt2 import PRESETS

        cfg = PRESETS[model]
        tokens = torch.from_numpy(load_text_tokens(None)[0].astype(np.int64))
        net, T = TorchGPT2(cfg), cfg.block_size

        def batch_at(i):
            starts = rng.integers(0, len(tokens) - T - 1, batch)
            x = torch.stack([tokens[s : s + T] for s in starts])
            y = torch.stack([tokens[s + 1 : s + T + 1] for s in starts])
            return x, y

    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    half = precision == "bf16"
    warm = max(3, steps // 10)
    walls = []
    for i in range(warm + steps):
        t0 = time.perf_counter()
        x, y = batch_at(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            loss = net(x, y)
        loss.backward()
        opt.step()
        walls.append(time.perf_counter() - t0)
    print(json.dumps({"samples_per_sec": batch / statistics.median(walls[warm:])}))


IMPLS = [
    ("simdist", "fp32"), ("simdist", "bf16"), ("simdist", "fp16"),
    ("pytorch", "fp32"), ("pytorch", "bf16"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="fc_mnist,gpt2-mini")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="override the per-model step count")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--words", action="store_true", help="also bf16 with float32 words")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        torch_worker(args.worker, args.steps, args.precision)
        return 0
    info = machine_info()
    print(f"CPU: {info['cpu']['model']} ({', '.join(info['cpu']['isa'])}); load {info['loadavg']}")
    impls = [i for i in IMPLS if not (args.no_torch and i[0] == "pytorch")]
    if args.words:
        impls.insert(2, ("simdist", FLOAT32_WORDS))
    rows = []
    for model in args.models.split(","):
        steps = args.steps or STEPS[model]
        rates: dict[tuple[str, str], list[float]] = {i: [] for i in impls}
        for _ in range(args.repeats):
            for impl, prec in impls:
                run = run_simdist if impl == "simdist" else run_torch
                rates[(impl, prec)].append(run(model, steps, prec))
        for impl, prec in impls:
            base = rates[(impl, "fp32")]
            r = rates[(impl, prec)]
            # step time relative to fp32: fp32 rate / this rate, paired within a repeat
            rel = statistics.median(b / x for b, x in zip(base, r, strict=True))
            host = HOST.get((model, prec), [(0, 0)])
            rows.append({
                "model": model, "impl": impl, "precision": prec, "steps": steps,
                "samples_per_sec": statistics.median(r), "runs": r,
                "step_time_vs_fp32": rel,
                "host_parameter_bytes": host[0][0],
                "peak_rss_bytes": statistics.median(h[1] for h in host),
            })  # fmt: skip
    print(
        f"\n{'model':<10}{'impl':<9}{'prec':<10}{'samples/s':>11}{'step vs fp32':>14}"
        f"{'weights MiB':>13}{'peak RSS MiB':>14}"
    )
    for row in rows:
        mem = (
            f"{row['host_parameter_bytes'] / 2**20:>13.1f}{row['peak_rss_bytes'] / 2**20:>14.1f}"
            if row["impl"] == "simdist"
            else ""
        )
        print(
            f"{row['model']:<10}{row['impl']:<9}{row['precision']:<10}"
            f"{row['samples_per_sec']:>11.1f}{row['step_time_vs_fp32']:>13.3f}x{mem}"
        )
    by = {(r["model"], r["impl"], r["precision"]): r for r in rows}
    for model in args.models.split(","):
        s, t = by.get((model, "simdist", "bf16")), by.get((model, "pytorch", "bf16"))
        if s and t:
            ratio = s["samples_per_sec"] / t["samples_per_sec"]
            print(f"{model}: simdist bf16 / PyTorch bf16 autocast samples/s = {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
