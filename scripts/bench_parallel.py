"""Data x tensor x pipeline parallelism of gpt2-mini at np 2 and 4: one table, one row per
layout.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_parallel.py
        [--json FILE] [--steps 4] [--micro 2] [--global-batch 32] [--nps 2,4]

Each row is a fresh ``mpiexec -n NP python -m simdist.train --params gpt2_mini`` with the
same global batch and micro-batch (so the same samples per optimizer step): data
parallelism (ZeRO 0 and 1; micro-batches per replica = global / (micro x replicas)),
pipeline parallelism over all ranks (1F1B and GPipe; micro-batches m = global / micro),
tensor parallelism in weight mode over 2 ranks (Megatron's split, ``--tensor-parallel 2
--tensor-parallel-mode weight``) and, at np 4, DP 2 x PP 2, DP 2 x TP 2 and TP 2 x PP 2.
Columns from the run's performance.json: tokens per second, the largest
simdist-accounted bytes of a rank (parameters, gradients, optimizer state, activations),
the peak resident set of the busiest rank (the whole process: Python, numba, MPI),
bytes a rank sent per step (the busiest rank; pipelines: activations, their gradients,
the tied embedding's gradient and value, the DP gradient sync; weight mode: the group's
activation collectives too), the measured pipeline bubble (the share of the
forward/backward span a stage rank is not computing, averaged over ranks; the JSON has it
per stage too), the predicted (P-1)/(m+P-1) of equal stages, and the simulated step's
(``est_bubble_fraction``: the schedule played with each stage's own simulated times).
With np > cores the times measure oversubscription: compare rows of one np on an idle
machine.
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
BLOCK = 128  # gpt2-mini's sequence length: tokens per sample


def layouts(np_: int) -> list[tuple[str, int, int, int, int, str]]:
    """(strategy, dp, tp, pp, zero, schedule) of the rows at ``np_`` ranks."""
    rows = [("dp", np_, 1, 1, 0, ""), ("dp", np_, 1, 1, 1, "")]
    rows += [("pp", 1, 1, np_, 0, "1f1b"), ("pp", 1, 1, np_, 0, "gpipe")]
    if np_ == 2:
        rows.append(("tp", 1, 2, 1, 0, ""))
    if np_ >= 4 and np_ % 4 == 0:
        rows.append(("dp x pp", np_ // 2, 1, 2, 0, "1f1b"))
        rows.append(("dp x tp", np_ // 2, 2, 1, 0, ""))
        rows.append(("tp x pp", np_ // 4, 2, 2, 0, "1f1b"))
    return rows


def run(np_: int, dp: int, tp: int, pp: int, zero: int, schedule: str, args) -> dict:
    accum = args.global_batch // (args.micro * dp)
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            MPIEXEC, "-n", str(np_), sys.executable, "-m", "mpi4py", "-m", "simdist.train",
            "--params=gpt2_mini",
            f"--train_input.batch_size={args.micro}",
            f"--optimizer.grad_accum_steps={accum}",
            f"--zero_opt_level={zero}",
            f"--runconfig.max_steps={args.steps}",
            "--runconfig.mode=train",
            "--runconfig.save_checkpoints_steps=0",
            f"--runconfig.save_summary_steps={args.steps}",
            "--runconfig.progress_bar=false",
            f"--runconfig.model_dir={d}/run",
        ]  # fmt: skip
        if pp > 1:
            cmd += [f"--pipeline-parallel={pp}", f"--pipeline-schedule={schedule}"]
        if tp > 1:  # weight mode: the layers split, the group's batch not divided
            cmd += [f"--tensor-parallel={tp}", "--tensor-parallel-mode=weight"]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(f"run failed:\n{out.stdout}\n{out.stderr}")
        perf = json.loads(Path(d, "run", "performance.json").read_text())
    if pp > 1:
        peak = perf["peak_memory_bytes_per_rank"]
        bubble, predicted = perf["bubble_fraction"], perf["predicted_bubble_fraction"]
        simulated = perf.get("est_bubble_fraction")
    else:
        peak, bubble, predicted = sum(perf["memory_bytes"].values()), None, None
        simulated = None
    return {
        "strategy": "",
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "zero": zero,
        "np": np_,
        "micro_batches": accum,
        "tokens_per_sec": perf["samples_per_sec"] * BLOCK,
        "step_time_s": perf["step_time_s"],
        "peak_bytes_per_rank": peak,
        "peak_rss_bytes": perf["peak_rss_bytes"],  # the busiest process, Python and MPI too
        "comm_bytes_per_step": perf["comm_bytes_sent_per_step"],
        "bubble_fraction": bubble,
        "bubble_fraction_predicted": predicted,
        # the simulated step's, from its stages' own times (the formula assumes equal ones)
        "bubble_fraction_simulated": simulated,
        "bubble_fraction_per_stage": perf.get("bubble_fraction_per_stage"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--nps", default="2,4")
    args = ap.parse_args()
    rows = []
    head = (
        f"{'strategy':<14}{'dp':>3}{'tp':>3}{'pp':>3}{'zero':>5}{'np':>3}{'m':>4}"
        f"{'tokens/s':>10}{'peak MiB':>10}{'RSS MiB':>9}{'sent MiB/step':>14}{'bubble':>8}"
        f"{'pred.':>7}{'sim.':>7}"
    )
    print(head)
    for np_ in (int(v) for v in args.nps.split(",")):
        for strategy, dp, tp, pp, zero, schedule in layouts(np_):
            row = run(np_, dp, tp, pp, zero, schedule, args)
            row["strategy"] = strategy + (f" {schedule}" if schedule else "")
            rows.append(row)
            b, pr = row["bubble_fraction"], row["bubble_fraction_predicted"]
            sim = row["bubble_fraction_simulated"]
            print(
                f"{row['strategy']:<14}{dp:>3}{tp:>3}{pp:>3}{zero:>5}{np_:>3}"
                f"{row['micro_batches']:>4}{row['tokens_per_sec']:>10.0f}"
                f"{row['peak_bytes_per_rank'] / 2**20:>10.1f}"
                f"{row['peak_rss_bytes'] / 2**20:>9.0f}"
                f"{row['comm_bytes_per_step'] / 2**20:>14.2f}"
                f"{'' if b is None else f'{b:.3f}':>8}{'' if pr is None else f'{pr:.3f}':>7}"
                f"{'' if sim is None else f'{sim:.3f}':>7}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
