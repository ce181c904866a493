"""The simulated device inside real training runs (issue #5): memory, clock, reports, trace.

MPI runs use a toy profile with round numbers (1 GFLOP/s matrix, 0.5 GFLOP/s vector,
2 GB/s memory, no efficiency tables, no launch cost) so that every kernel's time can be
checked by hand: max(FLOPs / peak, bytes / bandwidth). Nothing measured is asserted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from mpi_launch import run_mpi

from simdist.comm.topology import Placement
from simdist.device import Link, collective_time, validate_chrome_trace
from simdist.device.schedule import hierarchical_time, schedule, schedule_time
from simdist.memplan import RankSetup, rank_entries, suggestions, total_bytes

TOY = """\
name: toy
description: round numbers for hand checks
confidence: test
sources:
  test: "tests/test_simulate.py"
compute:
  matrix_tflops: {{fp32: 0.001, tf32: null, bf16: null, fp16: null}}
  vector_tflops: {{fp32: 0.0005, tf32: null, bf16: null, fp16: null}}
  kernel_launch_us: 0
  launch_mode: hidden
  combine: roofline
  matrix_efficiency: null
  vector_efficiency: null
memory:
  capacity_gb: {capacity_gb}
  bandwidth_gbs: 2
  efficiency: null
links:
  devices_per_node: 8
  intra: {{bandwidth_gbs: 1, latency_us: 10, efficiency: 1.0}}
  inter: null
  host: {{bandwidth_gbs: 4, latency_us: 1, efficiency: 1.0}}
streaming: null
"""
MATRIX, VECTOR, MEMBW = 1e9, 0.5e9, 2e9

SMALL = [
    "--model.hidden_sizes=[8]",
    "--train_input.batch_size=2",
    "--runconfig.mode=train",
    "--runconfig.max_steps=3",
    "--runconfig.save_summary_steps=3",
    "--runconfig.save_checkpoints_steps=0",
    "--runconfig.progress_bar=false",
]


def toy_profile(tmp_path: Path, capacity_gb: float = 1.0) -> Path:
    path = tmp_path / f"toy-{capacity_gb}.yaml"
    path.write_text(TOY.format(capacity_gb=capacity_gb))
    return path


def train(np_: int, model_dir: Path, *args: str, check: bool = True):
    cmd = ["-m", "simdist.train", *SMALL, f"--runconfig.model_dir={model_dir}", *args]
    out = run_mpi(np_, cmd, timeout=180)
    if check:
        assert out.returncode == 0, out.stdout
    return out


def perf(model_dir: Path) -> dict:
    return json.loads((model_dir / "performance.json").read_text())


def trace(model_dir: Path) -> dict:
    t = json.loads((model_dir / "timeline.json").read_text())
    validate_chrome_trace(t)
    return t


def step_events(t: dict, pid: int, track: int, step: int = 0) -> list[dict]:
    """Complete events of one rank's track within simulated step ``step``."""
    mine = [e for e in t["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
    # steps run back to back on the critical path, each opening with its input fetch
    starts = sorted(e["ts"] for e in mine if e["name"] == "input (measured)")
    evs = sorted((e for e in mine if e["tid"] == track), key=lambda e: e["ts"])
    lo = starts[step]
    hi = starts[step + 1] if step + 1 < len(starts) else float("inf")
    return [e for e in evs if lo <= e["ts"] < hi]


# -- pure functions ------------------------------------------------------------------------


def test_schedule_matches_the_closed_forms_and_charges_unequal_blocks():
    link = Link("x", 1e9, 5e-6, 1.0, 1 / 4e9)
    n = 2**20
    for p in (2, 4, 8):
        even = [n // p] * p
        for op in ("allreduce", "reduce_scatter", "allgather"):
            for alg in ("ring", "rhd"):
                got = schedule_time(op, alg, even, link)
                assert got == pytest.approx(collective_time(op, alg, n, p, link), rel=1e-12)
    # ZeRO-2's group reduce-scatter with the whole group in rank 0's slice: the ring moves
    # the full group at each of its p - 1 steps, p times the equal-block time
    lop = [n, 0, 0, 0]
    t = schedule_time("reduce_scatter", "ring", lop, link)
    assert t == pytest.approx(3 * (link.latency + n * (link.beta + link.gamma)))
    assert t > 3.5 * collective_time("reduce_scatter", "ring", n, 4, link)
    # p = 3 (fold): rhd all-reduce = fold in + halving + doubling + fold out, by hand
    a, b, g = link.latency, link.beta, link.gamma
    blocks = [n / 3] * 3  # ranks 0,1 fold; participants own 2n/3 and n/3
    by_hand = (a + n * (b + g)) + (a + 2 * n / 3 * (b + g)) + (a + 2 * n / 3 * b) + (a + n * b)
    assert schedule_time("allreduce", "rhd", blocks, link) == pytest.approx(by_hand)


def test_reduce_step_is_costed_at_the_message_size():
    """A reduce step costs its Sendrecv plus what the reduce exchange adds, both read at the
    message's size (calibrate times p2p's pipelined reduce itself, segments and overlap
    included); a copy step is its Sendrecv alone."""
    big = 4.0 * 2**20
    link = Link(
        "x", 1e9, 5e-6, 1.0, 1 / 4e9,
        size_efficiency=((big, 1.0), (0.0, 0.5)),
        reduce_efficiency=((big, 0.25), (0.0, 1.0)),
    )  # fmt: skip
    a, b, g = link.latency, link.beta, link.gamma
    for block, beta, gamma in ((big, b, 4 * g), (big / 4, 2 * b, g)):
        want = a + block * beta + block * gamma
        got = schedule_time("reduce_scatter", "ring", [block, block], link)
        assert got == pytest.approx(want)
        copy = schedule_time("allgather", "ring", [block, block], link)
        assert copy == pytest.approx(a + block * beta)


def test_a_measured_reducing_rate_replaces_copy_plus_gamma():
    """Where the link has the reducing step's own measured rate (calibrate times p2p's
    pipelined reduce exchange as a whole), a reduce step costs α plus the bytes at that
    rate, which may beat the copy; copy steps keep the copy's rate."""
    link = Link(
        "x", 1e9, 5e-6, 1.0, 1 / 4e9,
        size_efficiency=((0.0, 0.5),),
        reducing_efficiency=((2.0**20, 0.8), (0.0, 0.4)),
    )  # fmt: skip
    a, b = link.latency, link.beta
    for block, frac in ((2.0**21, 0.8), (2.0**18, 0.4)):
        rs = schedule_time("reduce_scatter", "ring", [block, block], link)
        assert rs == pytest.approx(a + block * b / frac)
        ag = schedule_time("allgather", "ring", [block, block], link)
        assert ag == pytest.approx(a + block * b / 0.5)


def test_an_all_reduces_second_half_runs_at_the_rate_measured_after_a_reduce():
    """Where the link has ``gather_efficiency`` (calibrate's Sendrecv right after a reduce
    exchange), an all-reduce's all-gather steps cost their bytes at it and its
    reduce-scatter steps keep theirs; an all-gather called alone keeps the plain table.
    At 2 and 4 ranks (ring) and 3 (rhd: its fold and unfold steps too)."""
    plain = Link(
        "x", 1e9, 5e-6, 1.0, 1 / 4e9,
        size_efficiency=((0.0, 0.5),),
        reducing_efficiency=((0.0, 0.4),),
    )  # fmt: skip
    after = dataclasses.replace(plain, gather_efficiency=((2.0**20, 0.25), (0.0, 1.0)))
    assert after.after_reduce.size_efficiency == after.gather_efficiency
    assert plain.after_reduce is plain
    a, b = plain.latency, plain.beta
    block = 2.0**21
    for alg, p in (("ring", 2), ("ring", 4), ("rhd", 3)):
        blocks = [block] * p
        rs = schedule_time("reduce_scatter", alg, blocks, plain)
        ag = schedule_time("allgather", alg, blocks, plain)
        assert schedule_time("allgather", alg, blocks, after) == pytest.approx(ag)
        ar_plain = schedule_time("allreduce", alg, blocks, plain)
        ar_after = schedule_time("allreduce", alg, blocks, after)
        # the copy steps' bytes at 0.25 instead of 0.5: exactly twice their byte time
        copy_bytes = sum(
            max(max(r[1], r[2]) for r in step)
            for step in schedule("allreduce", alg, blocks)
            if not any(r[3] for r in step)
        )
        assert copy_bytes > 0
        assert ar_after - ar_plain == pytest.approx(copy_bytes * b / 0.5, rel=1e-9), (alg, p)
        if alg == "ring" and p == 2:  # one reduce step, one copy step
            assert ar_plain == pytest.approx(2 * a + block * b / 0.4 + block * b / 0.5)
            assert rs == pytest.approx(a + block * b / 0.4)
    small = [2.0**18] * 2  # below the table's 1 MiB row: the gather rate is 1.0
    assert schedule_time("allreduce", "ring", small, after) < schedule_time(
        "allreduce", "ring", small, plain
    )


def test_shm_reduce_scatter_counts_its_addition():
    """The shm reduce-scatter loads the peers' blocks and adds them: the direct link's rate
    for the loads plus γ for the addition (no reducing rate measured); the all-gather only
    loads."""
    direct = Link("d", 2e9, 4e-6, 1.0, 1 / 8e9, reduce_efficiency=((0.0, 0.5),))
    link = Link("x", 1e9, 5e-6, 1.0, 1 / 4e9, direct=direct)
    block = 2.0**20
    load = block / 2e9
    add = block / (0.5 * 8e9)
    rs = schedule_time("reduce_scatter", "shm", [block, block], link)
    assert rs == pytest.approx(2 * 4e-6 + load + add)
    ag = schedule_time("allgather", "shm", [block, block], link)
    assert ag == pytest.approx(2 * 4e-6 + load)
    ar = schedule_time("allreduce", "shm", [block, block], link)
    assert ar == pytest.approx(2 * 4e-6 + 2 * load + add)


def test_hierarchical_schedule_matches_the_closed_form():
    intra = Link("nvlink", 100e9, 3e-6, 1.0, 1 / 400e9)
    rail = Link("rail", 12e9, 8e-6, 1.0, 1 / 400e9)
    n = 24 * 2**15  # divisible by every p below; messages within one p2p segment
    for nodes, per_node in ((2, 2), (2, 4), (4, 2), (3, 2)):
        p = nodes * per_node
        grid = [tuple(range(m * per_node, (m + 1) * per_node)) for m in range(nodes)]
        even = [n // p] * p
        for op in ("allreduce", "reduce_scatter", "allgather"):
            got = hierarchical_time(op, even, grid, intra, rail)
            want = collective_time(op, "hierarchical", n, p, intra, inter=rail,
                                   devices_per_node=per_node)  # fmt: skip
            assert got == pytest.approx(want, rel=1e-12), (op, nodes, per_node)
    # Unequal blocks (a ZeRO-2 group inside rank 0's slice): the cross ring of local rank 0
    # carries it all and sets the time.
    lop = [n, 0, 0, 0]
    t = hierarchical_time("reduce_scatter", lop, [(0, 1), (2, 3)], intra, rail)
    by_hand = (intra.latency + n * (intra.beta + intra.gamma)) + (
        rail.latency + n * (rail.beta + rail.gamma)
    )
    assert t == pytest.approx(by_hand)
    with pytest.raises(ValueError, match="same number of ranks"):
        hierarchical_time("allreduce", [1, 1, 1], [(0, 1), (2,)], intra, rail)


def test_placement_link_class():
    assert Placement(0, (0, 0, 0)).link_class() == "intra"
    two = Placement(3, (0, 0, 1, 1))
    assert two.link_class() == "inter" and two.node == 1 and two.ranks_per_node == (2, 2)


def test_memory_hints_are_computed_with_the_same_formula():
    setup = RankSetup(
        numel_specs=(("a", 1000), ("b", 1000)),
        groups=((("b",), False), (("a",), False)),
        world=2,
        rank=0,
        zero_level=0,
        accum=1,
        optimizer_type="adamw",
        micro_batch=64,
        algorithm="ring",
        activation_bytes=lambda b: 10_000 * b,
        input_bytes_per_sample=100,
    )
    need = total_bytes(rank_entries(setup))
    cap = need - 200_000  # short by 20 samples' activations
    tips = suggestions(setup, cap)
    fit = int(tips.split("train_input.batch_size=")[1].split()[0])
    assert total_bytes(rank_entries(setup, micro_batch=fit)) <= cap
    assert total_bytes(rank_entries(setup, micro_batch=fit + 1)) > cap
    # the scratch (2 MiB) dwarfs this model: no ZeRO level fits, the batch hint does
    assert "zero_opt_level" not in tips
    # ZeRO-2 (slice + one bucket) is a little smaller than ZeRO-1 (whole gradient) here
    z1 = total_bytes(rank_entries(setup, zero_level=1))
    z2 = total_bytes(rank_entries(setup, zero_level=2))
    assert z2 < z1 < need
    assert "runconfig.zero_opt_level=2 would fit" in suggestions(setup, z2)
    assert "runconfig.zero_opt_level=1 would fit" in suggestions(setup, z1)


def test_kernel_costs_count_the_model_flops():
    from simdist.model_config import FCMNISTConfig
    from simdist.models.fc_mnist import FCMNIST
    from simdist.models.gpt2 import GPT2, resolve_config

    fc = FCMNIST(FCMNISTConfig(hidden_sizes=[8]))
    ks = {k.name: k for k in fc.kernel_costs(2)}
    assert ks["fc1.matmul"].flops == 2 * 2 * 784 * 8
    assert ks["fc1.matmul"].bytes == 4 * (2 * 784 + 784 * 8 + 2 * 8)
    matmul = sum(k.flops * k.count for k in fc.kernel_costs(2) if k.kind == "matmul")
    assert matmul == 2 * fc.flops_per_sample()
    g = GPT2(resolve_config("gpt2-mini"))
    matmul = sum(k.flops * k.count for k in g.kernel_costs(3) if k.kind == "matmul")
    # flops_per_sample counts attention's products dense (12 T^2 hs per head and layer);
    # the kernels skip the causal blocks above the diagonal: at T = 128 in 64-row blocks,
    # a quarter of them (4 layers x 4 heads of 64, 3 samples)
    skipped = 3 * 4 * 4 * 12 * 128 * 128 * 64 // 4
    assert matmul == 3 * g.flops_per_sample() - skipped
    done = [k.done for k in g.kernel_costs(3) if k.done]
    assert done == [grp.names for grp in g.gradient_groups()]


def test_attention_costs_mirror_the_kernels_products():
    """``attention_costs``: a causal head of 200 positions multiplies in 64-row blocks
    (three full, one of 8 rows), each product block at its own shape; bidirectional and
    short causal heads are dense; no gather or scatter pass (the kernels multiply the
    heads' columns in place); the losses' exp vectorises (only max and sum are serial)."""
    from simdist.models import attention_costs
    from simdist.models.gpt2 import GPT2, resolve_config

    assert attention_costs.row_blocks(200, True) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert attention_costs.row_blocks(127, True) == [(0, 127)]
    assert attention_costs.row_blocks(200, False) == [(0, 200)]
    fwd = attention_costs.attention("a", 2, 3, 200, 200, 64, "forward", causal=True)
    shapes = {k.name: (k.shape, k.count) for k in fwd if k.kind == "matmul"}
    assert shapes["a.qk[0:64]"] == ((64, 64, 64, "nt"), 6)
    assert shapes["a.qk[192:200]"] == ((8, 64, 200, "nt"), 6)
    assert shapes["a.pv[64:128]"] == ((64, 128, 64, "nn"), 6)
    bwd = attention_costs.attention("a", 2, 3, 200, 200, 64, "backward", causal=True)
    shapes = {k.name: k.shape for k in bwd if k.kind == "matmul"}
    assert shapes["a.dk[128:192]"] == (64, 72, 64, "tn")  # key block j: query rows j..T
    assert shapes["a.dv[192:200]"] == (8, 8, 64, "tn")
    # every block's products cover the lower triangle of 64-row blocks: 1 + 2 + 3 blocks
    # of 64 x 64 and 8 x 200, against 200 x 200 dense, in each of the six products
    covered = 64 * 64 * (1 + 2 + 3) + 8 * 200
    flops = sum(k.flops for k in fwd + bwd if k.kind == "matmul")
    assert flops == 6 * 2 * covered * 64
    dense = attention_costs.attention("a", 2, 3, 200, 150, 64, "backward", causal=False, p=0.1)
    assert [k.name for k in dense] == [
        "a.dropout", "a.dv", "a.dp", "a.dropout", "a.softmax.bwd", "a.dq", "a.dk",
    ]  # fmt: skip
    assert sum(k.flops for k in dense if k.kind == "matmul") == 4 * 2 * 200 * 150 * 64
    assert not any("gather" in k.name or "scatter" in k.name for k in fwd + bwd + dense)
    with pytest.raises(ValueError, match="as many queries as keys"):
        attention_costs.attention("a", 1, 1, 64, 32, 8, "forward", causal=True)
    cfg = resolve_config("gpt2-mini")
    ce = next(k for k in GPT2(cfg).kernel_costs(2) if k.name == "softmax_ce")
    assert ce.serial_flops == 2 * 2 * cfg.block_size * cfg.vocab_size


# -- MPI runs ------------------------------------------------------------------------------


def test_oom_before_allocation_exits_2_with_breakdown_and_hint(tmp_path):
    """FC-MNIST 784-512-512-10 at np 2: DP needs ~13.1 MB per rank, ZeRO-1 ~10.4 MB."""
    d = tmp_path / "existing"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    prof = toy_profile(tmp_path, capacity_gb=0.012)
    cmd = [
        "-m",
        "simdist.train",
        f"--profile={prof}",
        f"--runconfig.model_dir={d}",
        "--runconfig.max_steps=2",
    ]
    out = run_mpi(2, cmd, timeout=120)
    assert out.returncode == 2, out.stdout
    assert out.stdout.count("simulated out of memory on toy") == 1, out.stdout
    assert "in use: parameters" in out.stdout and "gradients" in out.stdout
    assert "runconfig.zero_opt_level=1 would fit" in out.stdout
    assert sorted(p.name for p in d.iterdir()) == ["keep.txt"]
    assert "kernels ready" not in out.stdout  # failed before compiling or allocating


def test_unknown_profile_is_a_config_error(tmp_path):
    out = run_mpi(1, ["-m", "simdist.train", "--profile=nope", "--model_dir", str(tmp_path)], 60)
    assert out.returncode == 2
    assert "device profile 'nope' does not exist" in out.stdout and "a100-80gb" in out.stdout


def test_compute_estimate_is_the_sum_of_roofline_kernel_times(tmp_path):
    d = tmp_path / "np1"
    train(1, d, f"--profile={toy_profile(tmp_path)}", "--runconfig.trace_steps=1")
    p = perf(d)
    assert p["device_profile"] == "toy" and len(p["device_profile_sha256"]) == 64
    t = trace(d)
    kernels = [e for e in step_events(t, 0, 2) if e["cat"] in ("matmul", "vector")]
    for e in kernels:  # every kernel, by hand: max(compute, memory) in microseconds
        peak = MATRIX if e["cat"] == "matmul" else VECTOR
        want = max(e["args"]["flops"] / peak, e["args"]["bytes"] / MEMBW) * 1e6
        assert e["dur"] == pytest.approx(want, rel=1e-9), e
    fc1 = next(e for e in kernels if e["name"] == "fwd fc1.matmul")
    assert fc1["dur"] == pytest.approx(2 * 2 * 784 * 8 / MATRIX * 1e6)  # compute-bound
    total = sum(e["dur"] for e in kernels) * 1e-6
    assert p["est_step_time_breakdown_s"]["compute"] == pytest.approx(total, rel=1e-9)
    assert {"fwd fc1.matmul", "bwd fc1.dweight", "optimizer.adamw"} <= {e["name"] for e in kernels}
    # the per-step check's gradient sum of squares, taken inside the DP sync, is device work
    norm = [e for e in kernels if e["name"] == "grad.sum_of_squares"]
    assert len(norm) == 1 and norm[0]["args"]["flops"] == 2 * p["parameters_padded"]
    assert p["est_step_time_breakdown_s"]["exposed_comm"] == 0.0  # one rank: no traffic


def test_two_ranks_reports_trace_and_host_staging(tmp_path):
    prof = toy_profile(tmp_path)
    direct, staged = tmp_path / "direct", tmp_path / "staged"
    train(2, direct, f"--profile={prof}")
    train(2, staged, f"--profile={prof}", "--reduce-on-rdu=false")
    a, b = perf(direct), perf(staged)
    for p in (a, b):
        assert p["est_samples_per_sec"] > 0 and p["est_step_time_s"] > 0
        parts = p["est_step_time_breakdown_s"]
        assert sum(parts.values()) == pytest.approx(p["est_step_time_s"], rel=1e-9)
        assert p["samples_per_sec"] > 0 and isinstance(p["suspected_input_bottleneck"], bool)
        sim = p["simulation"]
        assert sim["link_class"] == "intra" and sim["nodes"] == 1
        assert sim["memory_plan_matches"]
        assert p["device_memory_peak_bytes"]["parameters"] == 4 * p["parameters_padded"]
    assert a["simulation"]["reduce_on_device"] and not b["simulation"]["reduce_on_device"]
    # host staging: the same collective plus two copies over the host link ...
    assert (
        b["est_step_time_breakdown_s"]["exposed_comm"]
        > a["est_step_time_breakdown_s"]["exposed_comm"]
    )
    ta, tb = trace(direct), trace(staged)

    def sync(t: dict) -> dict:
        return next(e for e in step_events(t, 0, 3) if e["name"] == "grad.allreduce")

    sa, sb = sync(ta), sync(tb)
    assert sa["args"]["link"] == "intra" and sb["args"]["link"] == "host+intra"
    n = sa["args"]["nbytes"]
    copies = 2 * (1e-6 + n / 4e9) * 1e6  # in and out over the 4 GB/s host link
    assert sb["dur"] == pytest.approx(sa["dur"] + copies, rel=1e-9)
    # ... and the host buffer is not device memory
    assert a["device_memory_peak_bytes"] == b["device_memory_peak_bytes"]
    assert a["memory_bytes"] == b["memory_bytes"]
    # one process (track group) per rank, each with the measured and simulated tracks
    for t in (ta, tb):
        names = {
            (e["pid"], e["args"]["name"])
            for e in t["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"
        }
        assert {pid for pid, _ in names} == {0, 1}
        tids = {(e["pid"], e["tid"]) for e in t["traceEvents"] if e["ph"] == "X"}
        assert tids >= {(r, k) for r in (0, 1) for k in (1, 2, 3)}
        measured = {e["name"] for e in t["traceEvents"] if e["ph"] == "X" and e["tid"] == 1}
        assert {"forward", "backward", "sync", "optimizer"} <= measured
        assert t["otherData"]["steps_traced"] == 3


def test_call_overhead_is_paid_once_per_collective():
    """A host link's call_overhead (simdist's Python per call) is added once per ring / rhd
    / native / hierarchical collective; shm's fence latency already includes it."""
    import dataclasses

    base = Link("x", 1e9, 5e-6, 1.0, 1 / 4e9)
    slow = dataclasses.replace(base, call_overhead=4e-6)
    blocks = [2**20] * 4
    for alg in ("ring", "rhd", "native"):
        for op in ("allreduce", "reduce_scatter", "allgather"):
            got = schedule_time(op, alg, blocks, slow) - schedule_time(op, alg, blocks, base)
            assert got == pytest.approx(4e-6), (alg, op)
    assert schedule_time("allreduce", "shm", blocks, slow) == schedule_time(
        "allreduce", "shm", blocks, base
    )
    grid = [(0, 1), (2, 3)]
    extra = hierarchical_time("allreduce", blocks, grid, slow, base) - hierarchical_time(
        "allreduce", blocks, grid, base, base
    )
    assert extra == pytest.approx(4e-6)


# -- plan mode and the run share one step-time model ---------------------------------------

PLAN_VS_RUN = [
    # (plan model, run params preset and overrides, zero level, grad_accum_steps)
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=32"], 0, 1),
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=32"], 1, 1),
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=32"], 2, 1),
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=16"], 0, 2),
    ("gpt2-mini", ["--params=gpt2_mini", "--train_input.batch_size=2"], 0, 1),
    ("gpt2-mini", ["--params=gpt2_mini", "--train_input.batch_size=2"], 2, 1),
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=32"], 3, 1),
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=16"], 3, 2),
    ("gpt2-mini", ["--params=gpt2_mini", "--train_input.batch_size=2"], 3, 1),
]
# mixed precision: half kernels' rates and traffic, 2-byte collectives and memory
PLAN_VS_RUN_HALF = [
    ("gpt2-mini", ["--params=gpt2_mini", "--train_input.batch_size=2"], 0, 1, "bf16"),
    ("gpt2-mini", ["--params=gpt2_mini", "--train_input.batch_size=2"], 2, 1, "bf16"),
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=32"], 1, 1, "fp16"),
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=16"], 0, 2, "bf16"),
    ("fc-mnist", ["--params=fc_mnist", "--train_input.batch_size=32"], 3, 1, "bf16"),
]


@pytest.mark.parametrize(
    ("model", "args", "zero", "accum", "precision"),
    [(*row, "fp32") for row in PLAN_VS_RUN] + PLAN_VS_RUN_HALF,
)
def test_plan_predicts_the_runs_simulated_step_time(tmp_path, model, args, zero, accum, precision):
    """``python -m simdist.plan`` on the shapes and a 2-rank run of the same configuration
    on a GPU profile give the same device time per step: both play their step's events
    (the run: what it recorded; plan: ``dp_step_events`` from the shapes) through the same
    ``StepModel``. The run's ``other`` time (input fetch and the loop's host work, measured)
    is the one part a plan cannot know, so it is left out; the rest agrees to float
    round-off (traced steps add kernel by kernel, the others in runs of kernels, and the
    report averages over steps): rel 1e-9."""
    from simdist.plan import plan

    d = tmp_path / "run"
    cmd = [
        "-m",
        "simdist.train",
        *args,
        "--profile=a100-80gb",
        f"--zero_opt_level={zero}",
        f"--optimizer.grad_accum_steps={accum}",
        f"--runconfig.precision={precision}",
        "--optimizer.max_gradient_norm=null",  # clipping's scaling pass is data-dependent
        "--runconfig.collective_algorithm=ring",
        "--runconfig.mode=train",
        "--runconfig.max_steps=3",
        "--runconfig.save_summary_steps=3",
        "--runconfig.save_checkpoints_steps=0",
        "--runconfig.progress_bar=false",
        "--runconfig.trace_steps=1",
        f"--runconfig.model_dir={d}",
    ]
    out = run_mpi(2, cmd, timeout=300)
    assert out.returncode == 0, out.stdout
    p = perf(d)
    batch = int(args[1].split("=")[1])
    r = plan(
        model=model,
        devices=2,
        profile="a100-80gb",
        zero=zero,
        batch=batch * accum,
        micro_batch=batch,
        precision="fp32" if precision == "fp32" else "mixed",
        half=None if precision == "fp32" else precision,
        optimizer="adam",
        algorithm="ring",
    )
    parts = p["est_step_time_breakdown_s"]
    assert any("simdist's own DP/ZeRO" in n for n in r.notes), r.notes
    assert r.step_s == pytest.approx(parts["compute"] + parts["exposed_comm"], rel=1e-9)
    assert r.breakdown_s["dp_comm_exposed"] == pytest.approx(parts["exposed_comm"], rel=1e-9)
    assert parts["exposed_comm"] > 0  # the collectives are really in both
    assert p["simulation"]["dtype"] == ("fp32" if precision == "fp32" else precision)
    assert p["simulation"]["memory_plan_matches"]
    peak = p["device_memory_peak_bytes"]  # memory: the run's own plan (memplan) in both
    for cat in ("parameters", "gradients", "optimizer_state", "workspace", "buckets"):
        assert r.memory_bytes[cat] == peak[cat], cat
    # the run also holds the dataset's input batch buffers (a plan has no dataset)
    assert 0 <= peak["activations"] - r.memory_bytes["activations"] <= batch * 4096
    if zero >= 2:  # ZeRO-2/3's reduce-scatters overlap the backward in both
        assert p["est_overlapped_comm_s"] > 0
        assert r.breakdown_s["dp_comm_total"] - r.breakdown_s["dp_comm_exposed"] == (
            pytest.approx(p["est_overlapped_comm_s"], rel=1e-6)
        )


# pipelines: (plan model, run args, ranks, pipeline schedule, zero level, micro-batches,
# precision)
GPT2_PP = ["--params=gpt2_mini", "--train_input.batch_size=1"]
FC_PP = ["--params=fc_mnist", "--train_input.batch_size=8"]
# TP 2 in weight mode on each stage (world 4: P 2 x T 2); the second with sequence parallelism
TP_PP = [*GPT2_PP, "--tensor-parallel=2", "--tensor-parallel-mode=weight"]
TP_PP_SP = [*TP_PP, "--runconfig.sequence_parallel=true"]
PLAN_VS_RUN_PP = [
    ("gpt2-mini", GPT2_PP, 2, "1f1b", 0, 4, "fp32"),
    ("gpt2-mini", GPT2_PP, 2, "gpipe", 0, 2, "fp32"),
    ("fc-mnist", FC_PP, 4, "1f1b", 2, 4, "fp32"),
    ("fc-mnist", FC_PP, 4, "gpipe", 1, 4, "fp32"),
    ("gpt2-mini", GPT2_PP, 4, "1f1b", 3, 4, "fp32"),
    ("gpt2-mini", GPT2_PP, 4, "1f1b", 3, 4, "bf16"),
    ("fc-mnist", FC_PP, 4, "1f1b", 0, 4, "fp16"),
    ("gpt2-mini", TP_PP, 4, "1f1b", 1, 4, "fp32"),
    ("gpt2-mini", TP_PP_SP, 4, "gpipe", 3, 2, "bf16"),
]


@pytest.mark.parametrize(
    ("model", "args", "n", "kind", "zero", "accum", "precision"), PLAN_VS_RUN_PP
)
def test_plan_predicts_the_pipeline_runs_step_and_memory(
    tmp_path, model, args, n, kind, zero, accum, precision
):
    """``python -m simdist.plan --pp 2`` and a pipeline run (P 2, with DP 2 at 4 ranks) of
    the same configuration: the run's simulated step (``est_device_step_time_s``:
    ``est_step_time_s`` less the measured host time a plan cannot know) and its phases
    equal the plan's (both call ``simdist.sim.pp_schedule.pipeline_step`` with the run's
    stage split, the run on its live model, the plan on one built from the shapes: rel
    1e-9), and the plan's memory is the run's largest rank's accounting, byte for byte.
    In bf16 / fp16 both time the kernels at the profile's half rates and move 2-byte
    activations, weights and gradients; the memory is 2 bytes an element plus the master.
    Tensor parallelism in weight mode on each stage: the shard's kernels, stage split and
    memory, and each model stage's group collectives (``gpt2_tp.stage_collectives``) in
    both."""
    from simdist.plan import plan

    d = tmp_path / "run"
    cmd = [
        "-m", "simdist.train", *args, "--profile=a100-80gb", "--pipeline-parallel=2",
        f"--pipeline-schedule={kind}", f"--zero_opt_level={zero}",
        f"--optimizer.grad_accum_steps={accum}", "--runconfig.collective_algorithm=ring",
        "--runconfig.mode=train", "--runconfig.max_steps=2",
        "--runconfig.save_checkpoints_steps=0", "--runconfig.progress_bar=false",
        f"--runconfig.precision={precision}", f"--runconfig.model_dir={d}",
    ]  # fmt: skip
    out = run_mpi(n, cmd, timeout=300)
    assert out.returncode == 0, out.stdout
    p = perf(d)
    batch = int(args[1].split("=")[1])
    half = None if precision == "fp32" else precision
    tp = 2 if "--tensor-parallel=2" in args else 1
    sp = "--runconfig.sequence_parallel=true" in args
    r = plan(
        model=model, devices=n, profile="a100-80gb", zero=zero, pp=2, pipeline_schedule=kind,
        batch=batch * accum, micro_batch=batch, precision="mixed" if half else "fp32",
        half=half, optimizer="adam", algorithm="ring", tp=tp, tp_mode="weight",
        sequence_parallel=sp,
    )  # fmt: skip
    if tp > 1:  # every stage's F and B hold the group's collectives
        assert p["tensor_parallel_mode"] == "weight" and p["replicas"] == 1
        assert min(p["est_group_collectives_s"]) > 0
        assert p["parameters_per_rank"] < p["parameters"]
    assert any("simdist's own pipeline step" in x for x in r.notes), r.notes
    parts = dict(p["est_step_phases_s"])  # "other": the run's measured host time
    assert p["est_step_time_s"] == p["est_device_step_time_s"] + parts.pop("other")
    assert p["est_device_step_time_s"] > p["est_forward_backward_s"] > 0
    assert r.step_s == pytest.approx(p["est_device_step_time_s"], rel=1e-9)
    for key, value in parts.items():
        assert r.breakdown_s[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key
    if p["replicas"] > 1:  # the stage groups' gradient collectives are in both
        assert p["est_step_phases_s"]["gradient_sync_exposed"] > 0
    largest = max(p["memory_bytes_per_rank"], key=lambda x: sum(x.values()))
    assert {k: v for k, v in r.memory_bytes.items() if v} == largest
    if half:  # the same layout in fp32: slower kernels and sends, twice the bytes
        f = plan(
            model=model, devices=n, profile="a100-80gb", zero=zero, pp=2,
            pipeline_schedule=kind, batch=batch * accum, micro_batch=batch,
            precision="fp32", optimizer="adam", algorithm="ring", tp=tp, tp_mode="weight",
            sequence_parallel=sp,
        )  # fmt: skip
        assert r.breakdown_s["forward_backward"] < f.breakdown_s["forward_backward"]
        assert 2 * r.memory_bytes["parameters"] == f.memory_bytes["parameters"]
        assert 2 * r.memory_bytes["activations"] == f.memory_bytes["activations"]


# tensor parallelism, weight mode, TP 2: (ranks, micro-batch, zero level, grad_accum_steps,
# precision, sequence parallelism)
PLAN_VS_RUN_TP = [
    (2, 2, 0, 1, "fp32", False),
    (2, 1, 2, 2, "fp32", False),
    (4, 2, 1, 1, "fp32", False),
    (2, 2, 0, 1, "bf16", False),
    (4, 1, 2, 2, "bf16", False),
    (2, 2, 0, 1, "fp32", True),
    (4, 1, 2, 2, "bf16", True),
]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_pipeline_op_segments_keep_the_whole_backward(zero):
    """A weight-mode group whose collectives are all empty times every op as its segments;
    the step must then be the one without a group: the ZeRO-0/1 accumulation pass and the
    ZeRO-3 gathers are parts of the B ops either way."""
    from simdist.arena import Layout
    from simdist.device.profile import load_profile
    from simdist.models.gpt2 import GPT2, resolve_config
    from simdist.param_gather import BACKWARD, FORWARD
    from simdist.sim.pp_schedule import StagePlan, pipeline_step

    model = GPT2(resolve_config("gpt2-mini"))
    plan = StagePlan(model, Layout(model.parameter_specs(), 2), 2)
    empty = {phase: [[] for _ in model.stages()] for phase in (FORWARD, BACKWARD)}
    kw = dict(kind="1f1b", micro=4, micro_batch=2, replicas=2, zero=zero,
              optimizer_type="adamw", algorithm="ring", link_class="intra")  # fmt: skip
    prof = load_profile("a100-40gb")
    bare, grouped = (pipeline_step(model, prof, plan, group=g, **kw) for g in (None, empty))
    # equal up to the order of the float additions (an op: its segments one by one)
    same = pytest.approx([x for o in bare.ops for x in (o.start, o.end)], rel=1e-12)
    assert [x for o in grouped.ops for x in (o.start, o.end)] == same
    assert grouped.step_s == pytest.approx(bare.step_s, rel=1e-12)
    assert grouped.bubble_fraction == pytest.approx(bare.bubble_fraction, rel=1e-9)
    b_ops = [o for o in grouped.ops if o.op == "B"]
    assert all(o.end - o.start > 0 for o in b_ops)


def test_pipeline_prices_kernels_at_the_nodes_resident_bytes(tmp_path):
    """The host profile keys its memory efficiency by the bytes the ranks of a node keep
    resident (the caches they share), and a pipeline's step prices its kernels there as
    data parallelism's does: a PP 2 run's simulated step is ``pipeline_step``'s at the sum
    of both ranks' accounted memory, plan mode's is the same, and the step priced at an
    empty working set (kernels in cache: what both once did, 12-20 % short of measured
    gpt2-mini steps) is shorter."""
    from simdist.arena import Layout
    from simdist.config import load_params
    from simdist.device.profile import load_profile
    from simdist.models import build_model
    from simdist.plan import plan
    from simdist.sim.pp_schedule import StagePlan, pipeline_step

    d = tmp_path / "run"
    cmd = [
        "-m", "simdist.train", *FC_PP, "--profile=host", "--pipeline-parallel=2",
        "--optimizer.grad_accum_steps=4", "--runconfig.collective_algorithm=ring",
        "--runconfig.mode=train", "--runconfig.max_steps=2",
        "--runconfig.save_checkpoints_steps=0", "--runconfig.progress_bar=false",
        f"--runconfig.model_dir={d}",
    ]  # fmt: skip
    out = run_mpi(2, cmd, timeout=300)
    assert out.returncode == 0, out.stdout
    p = perf(d)
    resident = sum(sum(m.values()) for m in p["memory_bytes_per_rank"])
    model = build_model(load_params(["--params", "fc_mnist"]).model)
    split = StagePlan(model, Layout(model.parameter_specs(), 1), 2)
    kw = dict(kind="1f1b", micro=4, micro_batch=8, replicas=1, zero=0,
              optimizer_type="adamw", algorithm="ring", link_class="intra")  # fmt: skip
    prof = load_profile("host")
    est = pipeline_step(model, prof, split, working_set=resident, **kw)
    assert p["est_device_step_time_s"] == pytest.approx(est.step_s, rel=1e-9)
    r = plan(
        model="fc-mnist", devices=2, profile="host", zero=0, pp=2, pipeline_schedule="1f1b",
        batch=32, micro_batch=8, precision="fp32", optimizer="adam", algorithm="ring",
    )  # fmt: skip
    assert r.step_s == pytest.approx(est.step_s, rel=1e-9)
    in_cache = pipeline_step(model, prof, split, **kw)
    assert in_cache.step_s < est.step_s


@pytest.mark.parametrize(("n", "batch", "zero", "accum", "precision", "sp"), PLAN_VS_RUN_TP)
def test_plan_predicts_the_weight_mode_runs_step_and_memory(
    tmp_path, n, batch, zero, accum, precision, sp
):
    """``python -m simdist.plan --tp 2 --tp-mode weight`` and a weight-mode run of gpt2-mini
    at np 2 (and DP 2 x TP 2 at np 4, the ranks of one node: ``--devices-per-node 4``, as the
    run sets it) on the default (host) profile: both play the step's events (the run: what it
    recorded; plan: ``tp_step_events`` on a shard built from the shapes, the group's
    collectives from ``gpt2_tp.group_collectives``) through the same ``StepModel``. The
    run's measured ``other`` time is left out; the rest agrees to 1e-5: the host profile's
    memory efficiency is keyed by the bytes the ranks keep resident, and the run also holds
    the dataset's input batch (a few KiB of 40 MB) that a plan has no dataset for. Memory:
    the run's own plan of the shard (memplan), byte for byte but that input batch; the
    group's bytes sent per step exactly. In bf16 the same, with the half format's compute
    rates, 2-byte weights and gradients, and the group's activation collectives in 16-bit
    words (the cross-entropy's sums float32). With sequence parallelism the group's
    reduce-scatters and all-gathers (``group_collectives``) and the row-share gradients'
    all-reduce after the sync, and the shard's activations on N / T rows."""
    from simdist.plan import main, plan

    d = tmp_path / "run"
    cmd = [
        "-m", "simdist.train", "--params=gpt2_mini", f"--train_input.batch_size={batch}",
        "--tensor-parallel=2", "--tensor-parallel-mode=weight", f"--zero_opt_level={zero}",
        f"--optimizer.grad_accum_steps={accum}", "--optimizer.max_gradient_norm=null",
        "--runconfig.collective_algorithm=ring", "--runconfig.mode=train",
        "--runconfig.max_steps=2", "--runconfig.save_checkpoints_steps=0",
        "--runconfig.progress_bar=false", f"--runconfig.model_dir={d}",
        f"--runconfig.precision={precision}", f"--runconfig.sequence_parallel={sp}",
    ]  # fmt: skip
    out = run_mpi(n, cmd, timeout=300)
    assert out.returncode == 0, out.stdout
    p = perf(d)
    assert p["device_profile"] == "host" and p["tensor_parallel_mode"] == "weight"
    assert p["precision"] == precision
    assert p["replicas"] == n // 2
    r = plan(
        model="gpt2-mini", devices=n, profile="host", tp=2, tp_mode="weight", zero=zero,
        batch=batch * accum, micro_batch=batch,
        precision="fp32" if precision == "fp32" else "mixed",
        half=None if precision == "fp32" else precision, optimizer="adam",
        algorithm="ring", devices_per_node=n, sequence_parallel=sp,
    )  # fmt: skip
    assert any("tensor-parallel weight-mode step" in n for n in r.notes), r.notes
    # the slowest rank's device step (with SP under ZeRO the replicas' row-share all-reduces
    # differ in size; which rank the run's critical path takes also depends on host noise)
    parts = max(p["est_device_breakdown_s_by_rank"], key=lambda b: b["compute"] + b["exposed_comm"])
    device_s = parts["compute"] + parts["exposed_comm"]
    assert r.step_s == pytest.approx(device_s, rel=1e-5)
    b = r.breakdown_s
    assert b["tp_comm"] > 0 and parts["exposed_comm"] > 0
    if n > 2:  # the shard's gradient sync over the replicas (beyond the 3 us agreement)
        assert b["dp_comm_exposed"] > 1e-4
    assert b["tp_comm"] + b["dp_comm_exposed"] == pytest.approx(parts["exposed_comm"], rel=1e-5)
    assert r.params_per_device == p["parameters_per_rank"]
    # the group's traffic: what simdist's collectives counted, byte for byte
    assert r.tp_bytes_sent_per_step == p["tensor_parallel_bytes_sent_per_step"]
    for mem in (p["device_memory_peak_bytes"], *p["memory_bytes_per_rank"]):
        for cat in ("parameters", "gradients", "optimizer_state", "workspace", "buckets"):
            assert r.memory_bytes[cat] == mem.get(cat, 0), cat
        assert 0 <= mem["activations"] - r.memory_bytes["activations"] <= batch * 4096
    # the command line says the same (runconfig.tensor_parallel_mode's values)
    args = ["--model", "gpt2-mini", "--devices", str(n), "--profile", "host", "--tp", "2",
            "--tp-mode", "weight", "--zero", str(zero), "--batch", str(batch * accum),
            "--micro-batch", str(batch), "--precision", precision, "--devices-per-node", str(n),
            "--sequence-parallel" if sp else "--no-sequence-parallel", "--json"]  # fmt: skip
    assert main(args) == 0


# -- the simulator takes what it needs from a run as arguments ------------------------------

SIMULATOR = ("simdist.sim", "simdist.simulate", "simdist.memplan", "simdist.plan",
             "simdist.calibrate", "simdist.calibration", "simdist.device")  # fmt: skip
RUN_SIDE = ("simdist.run", "simdist.streaming", "simdist.faults", "simdist.input_workers",
            "simdist.schedules")  # fmt: skip


def _simdist_imports() -> dict[str, set[str]]:
    """Module -> the simdist modules it imports anywhere in its code (functions too)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    out: dict[str, set[str]] = {}
    for path in sorted((root / "simdist").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        package = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + [node.module or ""]) if node.level else node.module or ""
                mod = mod.rstrip(".")
                deps |= {f"{mod}.{a.name}" for a in node.names} | {mod}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        out[name] = {d for d in deps if d.startswith("simdist")} - {name}
    return out


def test_simulator_never_imports_the_run_and_has_no_cycle():
    graph = _simdist_imports()
    sim = {m for m in graph if m.startswith(SIMULATOR)}
    assert {"simdist.sim.step", "simdist.sim.plan", "simdist.memplan"} <= sim
    for m in sorted(sim):
        bad = {d for d in graph[m] if d.startswith(RUN_SIDE)}
        assert not bad, f"{m} imports {sorted(bad)}: take what it needs as arguments"
    # no cycle among the simulator's modules (depth-first search for a back edge)
    edges = {m: {d for d in graph[m] if d in sim} for m in sim}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges[m]):
            assert state.get(d) != 1, f"import cycle: {' -> '.join([*path, m, d])}"
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(sim):
        if m not in state:
            visit(m, [])
