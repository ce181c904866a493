"""ZeRO memory and communication: levels 0/1/2/3 at np 1, 2, 4 in one table, one run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_zero.py [--json FILE]
        [--hidden 4096,4096] [--steps 30] [--nps 1,2,4] [--precision fp32|bf16|fp16]

Each (np, level) is a fresh ``mpiexec -n NP python -m simdist.train`` of an FC-MNIST MLP
deep and wide enough (default 784-2048x4-10, 14.2M parameters) that the model state dominates
what the process holds. Columns per rank, from simdist's own accounting of what it actually
allocated (performance.json): param/grad/optimizer/bucket bytes against the fp32 AdamW
formula (Psi_p = padded parameter count, N = ranks):
    DP 16 Psi_p;  ZeRO-1 8 Psi_p + 8 Psi_p/N;  ZeRO-2 4 Psi_p + 12 Psi_p/N + bucket;
    ZeRO-3 16 Psi_p/N + 2 windows (each the largest layer, 4 bytes an element) + bucket,
the peak RSS of the busiest rank (the process, Python and MPI included), bytes sent per
step (expected 2(N-1)/N * 4 Psi_p for levels 0-2; ZeRO-3 (N-1)/N * 4 (Psi_p + G), G the
elements its stages all-gather in a step, ``simdist.param_gather``: the mean over ranks,
where rank 0, whose figure the column shows, sends more or less when a gathered group's
slice boundaries split it unevenly) and the step time.
With np > cores the step times measure oversubscription, not the algorithm: compare
levels at equal np.

``--precision bf16|fp16`` (mixed precision, ``simdist.precision``; levels 0-2): weights and
gradients at 2 bytes, fp32 master + Adam moments at 12 (the ZeRO paper's K = 12):
    DP 16 Psi_p;  ZeRO-1 4 Psi_p + 12 Psi_p/N;  ZeRO-2 2 Psi_p + 14 Psi_p/N + bucket,
and the collectives move 2-byte words (expected 2(N-1)/N * 2 Psi_p). It then also prints the
ZeRO paper's example (Psi = 7.5B, N = 64, Figure 1) from the run's own accounting
(``simdist.memplan.rank_entries``, what a run reserves on its device before it allocates).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def run(np_: int, level: int, hidden: str, steps: int, precision: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            MPIEXEC,
            "-n",
            str(np_),
            sys.executable,
            "-m",
            "mpi4py",
            "-m",
            "simdist.train",
            f"--model.hidden_sizes=[{hidden}]",
            f"--zero_opt_level={level}",
            "--train_input.batch_size=32",
            f"--runconfig.max_steps={steps}",
            "--runconfig.mode=train",
            "--runconfig.save_checkpoints_steps=0",
            f"--runconfig.save_summary_steps={steps}",
            "--runconfig.progress_bar=false",
            f"--runconfig.model_dir={d}/run",
            f"--runconfig.precision={precision}",
        ]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(f"run failed:\n{out.stdout}\n{out.stderr}")
        perf = json.loads(Path(d, "run", "performance.json").read_text())
    return perf, perf["parameters_padded"]


def zero3_shapes(hidden: str, n: int) -> tuple[int, int]:
    """(elements of one gather window, elements all-gathered per step) of the MLP."""
    from simdist.arena import Layout
    from simdist.model_config import FCMNISTConfig
    from simdist.models.fc_mnist import FCMNIST
    from simdist.param_gather import BACKWARD, FORWARD, GatherPlan, WindowCache, stage_gathers

    model = FCMNIST(FCMNISTConfig("fc_mnist", [int(h) for h in hidden.split(",")], 784, 10))
    layout = Layout(model.parameter_specs(), n)
    plan = GatherPlan(layout, model.stages(), model.gradient_groups())
    cache, k = WindowCache(plan), len(plan.stages)
    gathered = 0
    for phase, order in ((FORWARD, range(k)), (BACKWARD, range(k - 1, -1, -1))):
        for j in order:
            gathered += sum(g.b - g.a for g in stage_gathers(plan, cache, j, phase, True)[1])
    return plan.window, gathered


def formula(level: int, psi: int, n: int, bucket: int, window: int = 0, half: bool = False) -> int:
    if half:  # 2 (weights) + 2 (gradients) + 12 (fp32 master, m, v) bytes per element
        return (16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n + bucket)[level]
    if level == 0:
        return 16 * psi
    if level == 1:
        return 8 * psi + 8 * psi // n
    if level == 2:
        return 4 * psi + 12 * psi // n + bucket
    return 16 * psi // n + 2 * 4 * window + bucket


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--hidden", default="2048,2048,2048,2048")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nps", default="1,2,4")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = ap.parse_args()
    half = args.precision != "fp32"
    elem = 2 if half else 4
    levels = (0, 1, 2) if half else (0, 1, 2, 3)  # mixed precision runs ZeRO 0-2
    rows = []
    hdr = (
        f"{'np':>3}{'level':>6}{'param_MB':>10}{'grad_MB':>9}{'optim_MB':>10}"
        f"{'bucket_MB':>10}{'total_MB':>10}{'formula_MB':>11}{'peak_rss_MB':>12}"
        f"{'comm_MB/step':>13}{'expect_MB':>10}{'step_s':>9}"
    )
    print(hdr)
    for n in map(int, args.nps.split(",")):
        window, gathered = zero3_shapes(args.hidden, n)
        for level in levels:
            perf, psi = run(n, level, args.hidden, args.steps, args.precision)
            mem = perf["memory_bytes"]
            p, g = mem.get("parameters", 0), mem.get("gradients", 0)
            o, b = mem.get("optimizer_state", 0), mem.get("buckets", 0)
            row = {
                "np": n,
                "level": level,
                "param_bytes": p,
                "grad_bytes": g,
                "optimizer_bytes": o,
                "bucket_bytes": b,
                "precision": args.precision,
                "formula_bytes": formula(level, psi, n, b, window, half),
                "peak_rss_bytes": perf["peak_rss_bytes"],
                "comm_bytes_per_step": perf["comm_bytes_sent_per_step"],
                "expected_comm_bytes_per_step": (n - 1)
                / n
                * elem
                * (2 * psi if level < 3 else psi + gathered),
                "step_time_s": perf["step_time_s"],
            }
            rows.append(row)
            mb = 1e6
            print(
                f"{n:>3}{level:>6}{p / mb:>10.1f}{g / mb:>9.1f}{o / mb:>10.1f}{b / mb:>10.1f}"
                f"{(p + g + o + b) / mb:>10.1f}{row['formula_bytes'] / mb:>11.1f}"
                f"{row['peak_rss_bytes'] / mb:>12.1f}{row['comm_bytes_per_step'] / mb:>13.2f}"
                f"{row['expected_comm_bytes_per_step'] / mb:>10.2f}{row['step_time_s']:>9.4f}"
            )
    by = {(r["np"], r["level"]): r for r in rows}
    if (2, 0) in by and (2, 2) in by:
        ratio = by[(2, 2)]["step_time_s"] / by[(2, 0)]["step_time_s"]
        print(f"\nZeRO-2 / DP step time at np 2: {ratio:.3f} (target <= 1.05)")
    for n in sorted({r["np"] for r in rows}):
        if (n, 3) in by and (n, 2) in by:
            z3, z2 = by[(n, 3)], by[(n, 2)]
            state = lambda r: sum(r[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))  # noqa: E731
            print(
                f"ZeRO-3 at np {n}: model state {state(z3) / state(z2):.3f} x ZeRO-2's, "
                f"peak RSS {z3['peak_rss_bytes'] / z2['peak_rss_bytes']:.3f} x"
            )
    if half:
        print()
        rows += zero_paper_example()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def zero_paper_example(psi: int = 7_500_000_000, n: int = 64) -> list[dict]:
    """The ZeRO paper's Figure 1 (7.5B parameters, 64 devices, mixed-precision Adam) from
    the run's own device accounting: 120, 31.4, 16.6 GB for DP, ZeRO-1, ZeRO-2 (+ bucket:
    the model here is 100 equal gradient groups, as a run's layers)."""
    from simdist.memplan import RankSetup, rank_entries

    layers = 100
    setup = RankSetup(
        numel_specs=tuple((f"w{i}", psi // layers) for i in range(layers)),
        groups=tuple(((f"w{i}",), False) for i in range(layers)),
        world=n, rank=0, zero_level=0, accum=1, optimizer_type="adamw", micro_batch=1,
        algorithm="ring", activation_bytes=lambda b: 0, input_bytes_per_sample=0,
        weight_bytes=2,
    )  # fmt: skip
    out = []
    for level, paper_gb in ((0, 120.0), (1, 31.4), (2, 16.6)):
        cats: dict[str, int] = {}
        for e in rank_entries(setup, zero_level=level):
            cats[e.category] = cats.get(e.category, 0) + e.nbytes
        state = sum(cats.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
        bucket = cats.get("buckets", 0)
        print(
            f"ZeRO paper, 7.5B on {n} devices, level {level}: model state "
            f"{state / 1e9:.1f} GB (paper {paper_gb} GB), bucket {bucket / 1e9:.2f} GB"
        )
        out.append({"zero_paper": True, "level": level, "state_bytes": state,
                    "paper_gb": paper_gb, "bucket_bytes": cats.get("buckets", 0)})  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
