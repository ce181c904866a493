"""Copies between nodes in pipelined pieces (p2p.place), placement checks and CPU records.

The MPI part (tests/mpi/check_segments.py) checks the pieces and that ring, rhd and
hierarchical keep their bits whatever the node table; the serial part checks what the
benchmarks use to leave out algorithms a placement cannot run, and the CPU record.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from mpi_launch import run_mpi

from simdist.comm import ALGORITHMS
from simdist.comm.topology import Placement
from simdist.hostcpu import ISA_OF_NOTE

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_segments_under_mpi(np_: int) -> None:
    proc = run_mpi(np_, ["tests/mpi/check_segments.py"], timeout=300)
    assert proc.returncode == 0, f"mpiexec -n {np_} failed:\n{proc.stdout}"
    assert f"check_segments np={np_}:" in proc.stdout and " 0 failures" in proc.stdout


def test_placement_errors() -> None:
    one = Placement(0, (0, 0, 0, 0))
    two = Placement(0, (0, 0, 1, 1))
    lopsided = Placement(0, (0, 0, 0, 1))
    for name, cls in ALGORITHMS.items():
        assert cls.placement_error(one) is None, name
    assert "one node" in (ALGORITHMS["shm"].placement_error(two) or "")
    assert ALGORITHMS["hierarchical"].placement_error(two) is None
    assert "same number of ranks" in (ALGORITHMS["hierarchical"].placement_error(lopsided) or "")
    for name in ("ring", "rhd", "native"):
        assert ALGORITHMS[name].placement_error(two) is None
        assert ALGORITHMS[name].placement_error(lopsided) is None


def _bench_link():
    spec = importlib.util.spec_from_file_location("bench_link", REPO / "scripts/bench_link.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_info() -> None:
    mod = _bench_link()
    cpu = mod.cpu_info()
    assert cpu["model"] and isinstance(cpu["flags"], list)
    assert set(cpu["isa"]) <= set(cpu["flags"]) and set(cpu["isa"]) <= set(ISA_OF_NOTE)
    if sys.platform.startswith("linux") and Path("/proc/cpuinfo").exists():
        text = Path("/proc/cpuinfo").read_text()
        assert cpu["model"] in text and cpu["flags"]
        if "avx2" in cpu["flags"]:
            assert "avx2" in cpu["isa"]
    line = mod.cpu_line(cpu)
    assert line.startswith("CPU: ") and "ISA: " in line
