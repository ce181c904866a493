"""Collectives: serial tests of partition and the auto rule, and the MPI check at np 1..4."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_launch import run_mpi

from simdist.comm import choose_algorithm, partition
from simdist.comm.cost import predicted_time, two_level_time
from simdist.comm.partition import bounds_list
from simdist.comm.topology import Placement


@pytest.mark.parametrize("np_", [1, 2, 3, 4, 6])  # 6: hierarchical on 3 x 2 and 2 x 3 grids
def test_collectives_under_mpi(np_: int) -> None:
    # A hang guard, not a speed check: the default check adds one synchronisation per call,
    # which costs a scheduling round when 6 ranks share 2 busy cores.
    proc = run_mpi(np_, ["tests/mpi/check_collectives.py"], timeout=240)
    assert proc.returncode == 0, f"mpiexec -n {np_} failed:\n{proc.stdout}"
    assert f"np={np_}:" in proc.stdout and "0 failures" in proc.stdout, proc.stdout


@pytest.mark.parametrize("np_", [2, 3])
def test_length_mismatch_ends_the_job_instead_of_hanging(np_: int) -> None:
    """Collectives() with the default check: ranks passing different lengths raise (on every
    rank, see check_default_mismatches), so the job exits non-zero long before the timeout."""
    proc = run_mpi(np_, ["tests/mpi/check_collectives.py", "--uncaught-mismatch"], timeout=90)
    assert proc.returncode not in (0, 124), proc.stdout  # 124: hung until the timeout
    assert "CollectiveMismatchError" in proc.stdout, proc.stdout
    assert "collective arguments differ across ranks in allreduce" in proc.stdout, proc.stdout
    assert "a mismatched allreduce returned" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 1000, 2**20 + 3])
def test_partition_blocks(n: int, world: int) -> None:
    off = partition(n, world)
    assert off.dtype == np.int64 and off.shape == (world + 1,)
    assert off[0] == 0 and off[-1] == n
    sizes = np.diff(off)
    extra = n % world
    assert (sizes[:extra] == n // world + 1).all()
    assert (sizes[extra:] == n // world).all()


def test_partition_examples() -> None:
    assert partition(10, 4).tolist() == [0, 3, 6, 8, 10]
    assert partition(2, 4).tolist() == [0, 1, 2, 2, 2]
    assert partition(0, 3).tolist() == [0, 0, 0, 0]
    assert partition(5, 1).tolist() == [0, 5]


@pytest.mark.parametrize("n, world", [(5, 0), (-1, 2)])
def test_partition_rejects(n: int, world: int) -> None:
    with pytest.raises(ValueError):
        partition(n, world)


def test_bounds_list_accepts_custom_partitions() -> None:
    assert bounds_list(np.array([0, 0, 4, 4, 9]), 9, 4) == [0, 0, 4, 4, 9]
    assert bounds_list([0, 9], 9, 1) == [0, 9]
    assert all(type(v) is int for v in bounds_list(np.array([0, 3, 9], np.int32), 9, 2))


@pytest.mark.parametrize(
    "bounds, world, error",
    [
        ([0, 9], 2, ValueError),  # too short for world 2
        ([1, 4, 9], 2, ValueError),  # does not start at 0
        ([0, 4, 8], 2, ValueError),  # does not end at n
        ([0, 5, 4, 9], 3, ValueError),  # decreasing
        (np.array([0.0, 4.0, 9.0]), 2, TypeError),  # not integers
        (np.zeros((3, 3), np.int64), 2, TypeError),  # not 1-D
        (9, 2, TypeError),  # not a sequence
    ],
)
def test_bounds_list_rejects(bounds, world: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        bounds_list(bounds, 9, world)


def test_auto_rule() -> None:
    # Powers of two: rhd has fewer steps and the same volume, so it always wins.
    for p in (2, 4, 8):
        for nbytes in (4, 4 << 10, 64 << 20):
            assert choose_algorithm("allreduce", nbytes, p) == "rhd"
    # p = 3: the fold costs rhd a whole extra buffer and saves no step.
    assert choose_algorithm("allreduce", 64 << 20, 3) == "ring"
    # p = 6: rhd saves latency on small messages, ring saves volume on large ones.
    assert choose_algorithm("allreduce", 1 << 10, 6) == "rhd"
    assert choose_algorithm("allreduce", 64 << 20, 6) == "ring"
    # One rule for the three reductions: DP and ZeRO run the same algorithm on a buffer.
    for p in (3, 5, 6, 7):
        for nbytes in (4 << 10, 256 << 10, 16 << 20):
            ops = ("allreduce", "reduce_scatter", "allgather")
            assert len({choose_algorithm(op, nbytes, p) for op in ops}) == 1
    # Across nodes: hierarchical for large buffers on an N x L grid, never with one node,
    # one rank per node or uneven nodes (there the single-node rule above stands).
    grid = Placement.blocks(0, 4, 2)
    assert choose_algorithm("allreduce", 64 << 20, 4, grid) == "hierarchical"
    assert choose_algorithm("allreduce", 1 << 10, 4, grid) == "rhd"  # latency: no staging
    assert {choose_algorithm(op, 1 << 20, 4, grid) for op in ops} == {"hierarchical"}
    assert choose_algorithm("broadcast", 64 << 20, 4, grid) == choose_algorithm(
        "broadcast", 64 << 20, 4
    )  # broadcast keeps the single-node rule
    for flat in (Placement.blocks(0, 4, 4), Placement.blocks(0, 4, 1), Placement(0, (0, 0, 1))):
        for nbytes in (1 << 10, 64 << 20):
            p = flat.world
            assert choose_algorithm("allreduce", nbytes, p, flat) == choose_algorithm(
                "allreduce", nbytes, p
            )
    # The reason: at 2 nodes x 2 the node link carries n instead of rhd's 2 n (staging and
    # the in-node steps cost back part of the saving).
    big = 64 << 20
    assert two_level_time("hierarchical", big, 2, 2) < 0.75 * two_level_time("rhd", big, 2, 2)
    assert predicted_time("allreduce", "ring", 0, 4) == 0.0
    assert predicted_time("allreduce", "ring", 1 << 20, 1) == 0.0


def test_shared_windows_are_only_made_where_they_fit(monkeypatch):
    """A window larger than the free shared memory is refused with the numbers and the fix
    (instead of a SIGBUS when its pages are touched); unknown filesystem: no check."""
    from simdist.comm import shm

    monkeypatch.setattr(shm, "shared_memory_free", lambda: 64 << 20)
    msg = shm.window_room_error(100 << 20)
    assert msg is not None and "100.0 MiB" in msg and "64.0 MiB free" in msg
    assert "--shm-size" in msg
    assert shm.window_room_error(8 << 20) is None
    assert shm.window_room_error((64 << 20) - shm.SHM_MARGIN + 1) is not None
    monkeypatch.setattr(shm, "shared_memory_free", lambda: None)
    assert shm.window_room_error(1 << 40) is None


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_half_precision_wire_under_mpi(np_: int) -> None:
    """bf16 / fp16 messages: every algorithm, summation orders with rounded partial sums,
    half the bytes (tests/mpi/check_half_wire.py)."""
    proc = run_mpi(np_, ["tests/mpi/check_half_wire.py"], timeout=240)
    assert proc.returncode == 0, f"mpiexec -n {np_} failed:\n{proc.stdout}"
    assert f"half wire np={np_}:" in proc.stdout and " 0 failures" in proc.stdout, proc.stdout
