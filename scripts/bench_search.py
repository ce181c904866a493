"""Strategy-search speed: issue 21's 10^5 configurations, timed in CPU seconds.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_search.py [--json FILE]

Megatron's 22B at 16 sizes from 64 to 12,288 A100-80GB devices, global batch 3072 (what
``python -m simdist.plan --model megatron-22b --devices 64,...,12288 --global-batch 3072``
searches). Prints the configurations considered and fully evaluated, the CPU and wall
seconds, against the target of 10 CPU seconds, and the CPU it ran on. CPU time, so a loaded
machine does not decide it; still a benchmark, not a test: it depends on the CPU.
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per process before numpy loads)

# isort: split
import argparse
import json
import time

from simdist.hostcpu import cpu_info
from simdist.sim.search import SearchSpace, search

SIZES = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288)
TARGET_CPU_S = 10.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    considered = evaluated = 0
    for d in SIZES:
        r = search("megatron-22b", d, "a100-80gb", SearchSpace(global_batch=3072), progress=False)
        considered, evaluated = considered + r.considered, evaluated + r.evaluated
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    out = {
        "cpu": cpu_info(),
        "considered": considered,
        "evaluated": evaluated,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "target_cpu_s": TARGET_CPU_S,
        "cpu_over_target": round(cpu / TARGET_CPU_S, 3),
    }
    cpu_ = out["cpu"]
    print(
        f"CPU: {cpu_['model']} ({cpu_['vendor']}, family/model/stepping "
        f"{cpu_['family_model_stepping']}; {' '.join(cpu_['isa'])})"
    )
    print(
        f"{considered:,} configurations ({evaluated:,} fully evaluated) in {cpu:.2f} s of CPU "
        f"({wall:.2f} s wall): {cpu / TARGET_CPU_S:.2f}x the {TARGET_CPU_S:.0f} s target"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
