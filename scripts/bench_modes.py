"""Pipelined vs weight-streaming execution of one GPT-2 (issue #8), side by side.

    python scripts/bench_modes.py [--steps 10] [--json FILE]

Runs ``simdist.train`` under mpiexec on the ``gpt2_streaming`` params (a 54.5 MiB model)
five ways: pipelined data parallelism on 2 ranks of a large-memory profile (the
reference), the same pipelined on the made-up 13 MiB ``tiny-ws`` device (a simulated
out-of-memory error), and weight streaming on ``tiny-ws`` with 1 server + 2 devices
(prefetch depth 1, then 0) and 2 servers + 2 devices. For each: per-device peak of the
accounted device memory, measured and simulated step time, exposed streaming time,
streamed bytes per device and step against the analysis (weights in twice per step, the
tied embedding once more and the position embedding once less; gradients out once), the
loss per step and whether the final parameters equal the reference's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]
BASE = ["--params", "gpt2_streaming", "--runconfig.progress_bar=false"]
LARGE = "a100-80gb"


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if not found:
        raise SystemExit("mpiexec not found")
    return found


def launch(np_: int, args: list[str], model_dir: Path, timeout: float) -> tuple[int, str]:
    cmd = [mpiexec(), "-n", str(np_), sys.executable, "-m", "mpi4py", "-m", "simdist.train"]
    cmd += [*BASE, *args, f"--runconfig.model_dir={model_dir}"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def losses(log: str) -> list[float]:
    return [float(m) for m in re.findall(r"^global_step = \d+, loss = ([0-9.]+)", log, re.M)]


def final_params(model_dir: Path) -> dict[str, np.ndarray]:
    from simdist.checkpoint import latest_checkpoint

    with h5py.File(latest_checkpoint(model_dir)) as f:
        return {k: f["model"][k][...] for k in f["model"]}


def analysis_bytes() -> dict[str, int]:
    from simdist.config import load_params
    from simdist.models import build_model
    from simdist.sim.streaming_step import device_footprint

    model = build_model(load_params(BASE).model)
    cfg = model.config
    P = 4 * model.num_parameters()
    wte, wpe = 4 * cfg.vocab_size * cfg.n_embd, 4 * cfg.block_size * cfg.n_embd
    return {
        "parameter_bytes": P,
        # forward: every weight, plus wte again for the tied LM head; backward: every weight
        # but wpe (the embedding's backward reads no weights)
        "weights_in": 2 * P + wte - wpe,
        "gradients_out": P,
        "predicted_device_bytes_depth1": sum(device_footprint(model, 2, 1, 1).values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    steps = [f"--runconfig.max_steps={args.steps}", "--runconfig.save_summary_steps=1"]
    steps += [f"--runconfig.save_checkpoints_steps={args.steps}", "--runconfig.mode=train"]
    runs = [
        ("pipelined DP, 2 ranks", LARGE, 2, ["--execution_mode=pipelined"]),
        ("pipelined DP, 2 ranks", "tiny-ws", 2, ["--execution_mode=pipelined"]),
        ("streaming 1 server + 2 devices, depth 1", "tiny-ws", 3, ["--weight_servers=1"]),
        ("streaming 1 server + 2 devices, depth 0", "tiny-ws", 3, ["--prefetch_depth=0"]),
        ("streaming 2 servers + 2 devices, depth 1", "tiny-ws", 4, ["--weight_servers=2"]),
    ]
    analysis = analysis_bytes()
    results, ref = [], None
    with tempfile.TemporaryDirectory(prefix="bench_modes-") as tmp:
        for i, (name, profile, np_, extra) in enumerate(runs):
            d = Path(tmp) / f"run{i}"
            rc, log = launch(np_, [*steps, f"--device_profile={profile}", *extra], d, args.timeout)
            row: dict = {"run": name, "profile": profile, "ranks": np_, "returncode": rc}
            if rc != 0:
                err = [ln for ln in log.splitlines() if "simdist: error" in ln or "hint:" in ln]
                row["error"] = "\n".join(err) or log[-2000:]
                results.append(row)
                print(f"{name} on {profile}: exit {rc}\n  " + "\n  ".join(err), flush=True)
                continue
            perf = json.loads((d / "performance.json").read_text())
            row["losses"] = losses(log)
            params = final_params(d)
            if ref is None:
                ref = params
            row["bitwise_equal_to_reference"] = all(np.array_equal(params[k], ref[k]) for k in ref)
            row["measured_step_time_s"] = perf["step_time_s"]
            if perf.get("execution_mode") == "weight_streaming":
                row["device_peak_bytes"] = perf["device_peak_bytes"]
                row["device_capacity_bytes"] = perf["device_capacity_bytes"]
                row["simulated_step_time_s"] = perf["simulated_step_time_s"]
                row["simulated_compute_s"] = perf["simulated_compute_s_per_step"]
                row["exposed_streaming_time_s"] = perf["exposed_streaming_time_s"]
                row["streamed_bytes_per_step"] = perf["streamed_bytes_per_step"]
            else:
                row["device_peak_bytes"] = perf["device_memory_peak_bytes"]["total"]
                row["device_capacity_bytes"] = perf["device_memory_capacity_bytes"]
                row["simulated_step_time_s"] = perf["est_step_time_s"]
                row["simulated_compute_s"] = perf["est_step_time_breakdown_s"]["compute"]
            results.append(row)
            print(f"{name} on {profile}: done", flush=True)
    print_table(results, analysis)
    if args.json:
        args.json.write_text(json.dumps({"analysis": analysis, "runs": results}, indent=1))
    ok = [r for r in results if r["returncode"] == 0]
    return 0 if ok and all(r["bitwise_equal_to_reference"] for r in ok) else 1


def print_table(results: list[dict], analysis: dict) -> None:
    mib = 2**20
    P = analysis["parameter_bytes"]
    print(
        f"\nmodel: {P / mib:.1f} MiB of fp32 parameters; analysis per device and step: "
        f"weights in {analysis['weights_in'] / mib:.1f} MiB (2 x params + wte - wpe), "
        f"gradients out {analysis['gradients_out'] / mib:.1f} MiB\n"
    )
    head = (
        "| run | profile | device peak / capacity (MiB) | step measured (s) | step simulated "
        "(ms) | compute sim. (ms) | exposed streaming (ms) | weights in (MiB) | gradients out "
        "(MiB) | bitwise = ref |"
    )
    print(head)
    print("|" + "---|" * 10)
    for r in results:
        if r["returncode"] != 0:
            reason = r["error"].splitlines()[0][:90] if r.get("error") else "failed"
            print(f"| {r['run']} | {r['profile']} | {reason} | | | | | | | |")
            continue
        s = r.get("streamed_bytes_per_step")
        win = f"{s['weights_in'] / mib:.2f}" if s else "-"
        gout = f"{s['gradients_out'] / mib:.2f}" if s else "-"
        exp = r.get("exposed_streaming_time_s")
        print(
            f"| {r['run']} | {r['profile']} | {r['device_peak_bytes'] / mib:.2f} / "
            f"{r['device_capacity_bytes'] / mib:.0f} | {r['measured_step_time_s']:.3f} | "
            f"{1e3 * r['simulated_step_time_s']:.2f} | {1e3 * r['simulated_compute_s']:.2f} | "
            f"{'-' if exp is None else f'{1e3 * exp:.2f}'} | {win} | {gout} | "
            f"{r['bitwise_equal_to_reference']} |"
        )
    ok = [r for r in results if r["returncode"] == 0]
    if ok:
        print("\nloss per step:")
        for r in ok:
            print(f"  {r['run']:<42} {' '.join(f'{x:.4f}' for x in r['losses'])}")


if __name__ == "__main__":
    sys.exit(main())
