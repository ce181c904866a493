"""simdist.device (profiles, memory, cost model, timeline), plan mode and calibrate."""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from simdist.device import (
    CostModel,
    DeviceMemory,
    Link,
    ProfileError,
    SimulatedOutOfMemoryError,
    VirtualClock,
    chrome_trace,
    collective_time,
    list_profiles,
    load_profile,
    validate_chrome_trace,
    write_chrome_trace,
)
from simdist.device import memory as memory_mod
from simdist.device.profile import PROFILE_DIR
from simdist.hostcpu import cpu_identity
from simdist.plan import (
    MODELS,
    PlanConfig,
    Planner,
    layer_activation_bytes,
    main,
    model_state_bytes,
    plan,
)

REQUIRED = {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "mi300x", "tpu-v4", "cs2", "sn30-rdu"}
SOURCE_TAG = re.compile(r"\[([a-z0-9]+)\]")
NUMBER_LINE = re.compile(r"^\s*[\w-]+:\s*-?[\d.]+([eE][-+]?\d+)?\s*$")  # key: 12.5


# -- profiles ------------------------------------------------------------------------------


def test_required_profiles_ship_and_load():
    names = set(list_profiles())
    assert REQUIRED <= names
    assert "host" in names
    for name in names:
        prof = load_profile(name)
        assert prof.name == name
        assert prof.memory_bytes > 0
        assert prof.sources, f"{name} cites no sources"
        blob = (PROFILE_DIR / f"{name}.yaml").read_bytes()
        assert prof.sha256 == hashlib.sha256(blob).hexdigest()


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_every_number_in_a_profile_carries_a_cited_comment(name):
    prof = load_profile(name)
    allowed = set(prof.sources) | {"assumption", "derived"}
    for lineno, line in enumerate((PROFILE_DIR / f"{name}.yaml").read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        numeric = re.match(NUMBER_LINE, code) or code.strip().startswith("- [")
        if not numeric:
            continue
        assert "#" in line, f"{name}.yaml:{lineno} has a number without a comment: {line!r}"
        tags = SOURCE_TAG.findall(line.split("#", 1)[1])
        assert all(t in allowed for t in tags), f"{name}.yaml:{lineno}: unknown source {tags}"


def test_datasheet_figures_reach_si_units():
    a100 = load_profile("a100-80gb")
    assert a100.peak("matmul", "bf16") == 312e12
    assert a100.peak("matmul", "fp32") == 19.5e12
    assert a100.memory_bytes == 80 * 2**30
    assert a100.memory_bandwidth == 2039e9
    assert a100.intra.bandwidth == 300e9 and a100.intra.effective_bandwidth == 240e9
    assert load_profile("a100-40gb").memory_bandwidth == 1555e9
    assert load_profile("h100-sxm").peak("matmul", "fp16") == pytest.approx(989.4e12)
    cs2 = load_profile("cs2")
    assert cs2.execution == "weight_streaming" and cs2.streaming.bandwidth == 150e9
    assert "compute.matrix_tflops.bf16" in cs2.unknown
    with pytest.raises(ProfileError, match="no published matmul peak for bf16"):
        cs2.peak("matmul", "bf16")


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ProfileError) as err:
        load_profile("a100-81gb")
    text = str(err.value)
    assert text.startswith("device profile 'a100-81gb' does not exist; available: ")
    for name in REQUIRED:
        assert name in text


def test_profile_by_path_and_malformed_profile(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text((PROFILE_DIR / "a100-80gb.yaml").read_text())
    assert load_profile(good).name == "a100-80gb"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ncompute: {}\nmemory: {capacity_gib: 1}\nlinks: {}\n")
    with pytest.raises(ProfileError, match="missing key 'kernel_launch_us'"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nope.yaml")


# -- memory --------------------------------------------------------------------------------


def test_memory_accounting_is_exact_to_the_byte():
    mem = DeviceMemory(10_000, "toy")
    a = mem.allocate("parameters", "w", (3, 5))
    assert a.shape == (3, 5) and a.dtype == np.float32 and not a.any()
    mem.allocate("gradients", "g", 7, np.float64)
    mem.reserve("optimizer_state", "m", 123)
    assert mem.current == {
        "parameters": 60,
        "gradients": 56,
        "optimizer_state": 123,
        "activations": 0,
        "workspace": 0,
        "buckets": 0,
        "streaming_window": 0,
        "total": 239,
    }
    assert mem.free("g") == 56
    mem.reserve("activations", "act", 1000)
    assert mem.current["total"] == 60 + 123 + 1000
    assert mem.peak["gradients"] == 56  # per-category high-water marks survive frees
    assert mem.peak["total"] == 1183  # the peak of the sum, not the sum of peaks (1239)
    assert mem.peak_breakdown["gradients"] == 0
    assert mem.summary()["peak_bytes"]["total"] == 1183
    with pytest.raises(ValueError, match="already allocated"):
        mem.reserve("workspace", "act", 1)
    with pytest.raises(ValueError, match="unknown memory category"):
        mem.reserve("weights", "x", 1)
    with pytest.raises(KeyError):
        mem.free("never")


def test_oom_is_raised_before_allocating(monkeypatch):
    mem = DeviceMemory(1000, "tiny-dev", hint=lambda short: f"drop {short} bytes")
    mem.allocate("parameters", "w", 100)  # 400 B
    mem.reserve("activations", "a", 500)

    def boom(*args, **kwargs):
        raise AssertionError("np.zeros must not run when the device is out of memory")

    monkeypatch.setattr(memory_mod.np, "zeros", boom)
    with pytest.raises(SimulatedOutOfMemoryError) as err:
        mem.allocate("gradients", "g", 100)  # 400 B more: 1300 > 1000
    e = err.value
    assert e.shortfall == 300 and e.needed == 1300 and e.capacity == 1000
    msg = str(e)
    assert "simulated out of memory on tiny-dev" in msg
    assert "'g' (gradients, 400 B)" in msg and "short by 300 B" in msg
    assert "parameters 400 B" in msg and "activations 500 B" in msg
    assert "hint: drop 300 bytes" in msg
    assert "g" not in mem and mem.current["total"] == 900  # nothing was accounted either
    with pytest.raises(SimulatedOutOfMemoryError, match="hint: batch 4 would fit"):
        mem.reserve("workspace", "ws", 2000, hint="batch 4 would fit")


def test_fits_and_what_would_fit():
    mem = DeviceMemory(1000)
    mem.reserve("parameters", "p", 300)
    assert mem.fits(700) and not mem.fits(701)
    assert mem.what_would_fit(100) == 7
    assert mem.what_would_fit(lambda b: 50 + 60 * b) == 10  # 50 + 600 <= 700 < 50 + 660
    assert mem.what_would_fit(lambda b: 800 + b) == 0
    mem.reserve("activations", "fill", 700)  # exactly at capacity: fits
    with pytest.raises(SimulatedOutOfMemoryError) as err:
        mem.reserve("workspace", "one_more", 1)
    assert err.value.shortfall == 1


# -- cost model ----------------------------------------------------------------------------

TOY = """
name: toy
compute:
  matrix_tflops: {{fp32: 1.0, tf32: null, bf16: 4.0, fp16: null}}
  vector_tflops: {{fp32: 0.5, tf32: null, bf16: null, fp16: null}}
  kernel_launch_us: 10
  launch_mode: {launch}
  combine: {combine}
  matrix_efficiency: [[1, 0.5], [0, 0.25]]
  vector_efficiency: null
memory:
  capacity_gib: 1
  bandwidth_gbs: 100
  efficiency: [[1, 1.0], [0, 0.5]]
links:
  devices_per_node: 4
  intra: {{bandwidth_gbs: 10, latency_us: 2, efficiency: 0.5}}
  inter: {{bandwidth_gbs: 1, latency_us: 20, efficiency: 1.0, nics_per_node: 2}}
  host: {{bandwidth_gbs: 4, latency_us: 1, efficiency: 1.0}}
streaming: null
"""


def toy(tmp_path: Path, combine: str = "roofline", launch: str = "hidden") -> CostModel:
    path = tmp_path / f"toy-{combine}-{launch}.yaml"
    path.write_text(TOY.format(combine=combine, launch=launch))
    return CostModel(load_profile(path), "fp32")


def test_roofline_kernel_times(tmp_path):
    cm = toy(tmp_path)
    # 2 GFLOP at 1 TF x 0.5 = 4 ms; 10 MB at 100 GB/s x 1.0 = 0.1 ms -> compute-bound
    assert cm.compute_time(2e9, 10e6) == pytest.approx(4e-3)
    # 0.5 GFLOP (eff 0.25) = 2 ms vs 400 MB = 4 ms -> memory-bound
    assert cm.compute_time(0.5e9, 400e6) == pytest.approx(4e-3)
    # small: 1 kFLOP, 1 kB (eff 0.5) -> far below the 10 us launch, which bounds it
    assert cm.compute_time(1e3, 1e3) == pytest.approx(10e-6)
    assert cm.compute_time(2e9, 10e6, dtype="bf16") == pytest.approx(1e-3)
    assert toy(tmp_path, "sum").compute_time(2e9, 10e6) == pytest.approx(4.1e-3)
    assert toy(tmp_path, launch="serial").compute_time(2e9, 10e6) == pytest.approx(4.01e-3)
    # vector kernels: bf16 has no vector peak -> falls back to the fp32 vector peak (0.5 TF)
    assert cm.compute_time(1e9, 0, "vector", "bf16") == pytest.approx(2e-3)
    with pytest.raises(ProfileError, match="no published matmul peak for fp16"):
        cm.compute_time(1e9, 0, dtype="fp16")


def test_collective_formulas_match_hand_computation():
    a, bw = 1e-6, 1e9
    link = Link("l", bw, a)
    n, b = 1e6, 1 / bw
    ring_ar = 2 * 3 * a + 2 * 3 / 4 * n * b
    assert collective_time("allreduce", "ring", n, 4, link) == pytest.approx(ring_ar)
    assert collective_time("allreduce", "rhd", n, 4, link) == pytest.approx(4 * a + 1.5 * n * b)
    # p = 6 folds to q = 4: + 2 alpha + 2 n beta
    rhd6 = 2 * 2 * a + 2 * 3 / 4 * n * b + 2 * a + 2 * n * b
    assert collective_time("allreduce", "rhd", n, 6, link) == pytest.approx(rhd6)
    assert collective_time("all-reduce", "recursive_doubling", n, 8, link) == pytest.approx(
        3 * (a + n * b)
    )
    assert collective_time("reduce_scatter", "ring", n, 4, link) == pytest.approx(
        3 * a + 0.75 * n * b
    )
    assert collective_time("allgather", "rhd", n, 5, link) == pytest.approx(3 * a + 0.8 * n * b)
    assert collective_time("broadcast", "rhd", n, 4, link) == pytest.approx(2 * (a + n * b))
    assert collective_time("p2p", "ring", n, 2, link) == pytest.approx(a + n * b)
    assert collective_time("allreduce", "ring", n, 1, link) == 0.0
    assert collective_time("allreduce", "ring", 0, 8, link) == 0.0
    assert collective_time("allreduce", "auto", n, 4, link) == pytest.approx(
        min(ring_ar, 4 * a + 1.5 * n * b)
    )
    # native: MPICH uses recursive doubling up to 2 KiB, Rabenseifner above
    assert collective_time("allreduce", "native", 1024, 4, link) == pytest.approx(
        2 * (a + 1024 * b)
    )
    # hierarchical, 2 nodes x 4: RS(n, 4) + AR(n/4, 2, rail) + AG(n, 4)
    rail = Link("rail", 1e8, 1e-5)
    hier = (3 * a + 0.75 * n * b) * 2 + (2 * 1e-5 + 2 * 0.5 * (n / 4) / 1e8)
    got = collective_time("allreduce", "hierarchical", n, 8, link, inter=rail, devices_per_node=4)
    assert got == pytest.approx(hier)
    gamma = Link("g", bw, a, 1.0, 1e-10)  # CPU reduction cost adds (p-1)/p n gamma
    assert collective_time("allreduce", "ring", n, 4, gamma) == pytest.approx(
        ring_ar + 0.75 * n * 1e-10
    )
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("alltoall", "ring", n, 4, link)


def test_link_classes(tmp_path):
    cm = toy(tmp_path)
    p = cm.profile
    assert cm.link("intra") is p.intra
    # a ring over 8 ranks on 2 nodes: node NIC aggregate 2 x 1 GB/s, capped by intra 5 GB/s
    inter = cm.link("inter", 8)
    assert inter.bandwidth == pytest.approx(2e9)
    assert inter.latency == pytest.approx((20e-6 * 2 + 2e-6 * 6) / 8)
    assert cm.rail(8).bandwidth == pytest.approx(0.5e9)  # 2 NICs shared by 4 GPUs
    n = 1e6
    assert cm.collective_time("allreduce", "ring", n, 4, "auto") == pytest.approx(
        collective_time("allreduce", "ring", n, 4, p.intra)
    )
    assert cm.collective_time("allreduce", "ring", n, 8, "auto") == pytest.approx(
        collective_time("allreduce", "ring", n, 8, inter)
    )
    staged = 2 * 1e-6 + 2 * n / 4e9 + collective_time("allreduce", "ring", n, 4, p.host)
    assert cm.collective_time("allreduce", "ring", n, 4, "host") == pytest.approx(staged)
    a100 = CostModel(load_profile("a100-80gb"))
    assert a100.link("inter", 16).bandwidth == pytest.approx(8 * 25e9 * 0.92)


def test_virtual_clock_overlap_and_summary(tmp_path):
    cm = toy(tmp_path)
    clock = VirtualClock(cm, rank=1)
    f = clock.compute("fwd", 2e9, 0)  # 4 ms
    b = clock.compute("bwd", 4e9, 0)  # 8 ms
    assert (f, b) == pytest.approx((4e-3, 8e-3))
    link = cm.profile.intra  # 5 GB/s effective
    d = 2 * 3 * 2e-6 + 2 * 3 / 4 * 20e6 / 5e9  # 6.012 ms
    # bucket ready 5 ms before the end of backward: 1.012 ms exposed
    dur = clock.collective("bucket0", "allreduce", "ring", 20e6, 4, "intra", overlappable_with=5e-3)
    assert dur == pytest.approx(d)
    assert dur == pytest.approx(collective_time("allreduce", "ring", 20e6, 4, link))
    # the second bucket (ready 1 ms before the end) waits for the comm stream: fully exposed
    clock.collective("bucket1", "allreduce", "ring", 20e6, 4, "intra", overlappable_with=1e-3)
    clock.advance("optimizer", 1e-3)
    s = clock.end_step()
    assert s.compute_s == pytest.approx(12e-3)
    assert s.exposed_comm_s == pytest.approx((d - 5e-3) + d)
    assert s.overlapped_comm_s == pytest.approx(5e-3)
    assert s.total_s == pytest.approx(s.compute_s + s.exposed_comm_s + s.other_s)
    assert s.other_s == pytest.approx(1e-3) and s.flops == 6e9
    # next step starts clean; a blocking collective is fully exposed
    clock.collective("sync", "allreduce", "ring", 20e6, 4, "intra")
    s2 = clock.end_step()
    assert s2.total_s == pytest.approx(d) and s2.exposed_comm_s == pytest.approx(d)
    assert clock.totals()["steps"] == 2
    tracks = {e["track"] for e in clock.events}
    assert tracks == {"compute", "comm"}
    waits = [e for e in clock.events if e["name"].startswith("wait ")]
    assert len(waits) == 3


# -- timeline --------------------------------------------------------------------------------


def test_chrome_trace_structure(tmp_path):
    cm = toy(tmp_path)
    per_rank = []
    for rank in range(2):
        clock = VirtualClock(cm, rank)
        clock.compute("gemm", 1e9, 1e6)
        clock.collective("ar", "allreduce", "ring", 1e6, 2, "intra", overlappable_with=1e-3)
        clock.measured(
            "step (wall)", clock.wall_origin + 0.001, clock.wall_origin + 0.002, step=np.int64(0)
        )
        clock.end_step()
        per_rank.append(clock.events)
    path = write_chrome_trace(tmp_path / "t" / "timeline.json", per_rank, metadata={"run": "x"})
    trace = json.loads(path.read_text())
    validate_chrome_trace(trace)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    assert {e["tid"] for e in xs} == {1, 2, 3}  # measured, compute, comm
    gemm = next(e for e in xs if e["name"] == "gemm")
    assert gemm["ts"] == 0 and gemm["dur"] == pytest.approx(2000.0)  # µs
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] != "process_sort_index"}
    assert (0, "rank 0") in names and (1, "simulated communication") in names
    assert trace["otherData"] == {"run": "x"}
    bad = chrome_trace(per_rank)
    bad["traceEvents"][-1]["dur"] = -1.0
    with pytest.raises(ValueError, match="negative duration"):
        validate_chrome_trace(bad)
    with pytest.raises(ValueError, match="unknown track"):
        chrome_trace([[{"name": "x", "track": "gpu", "start": 0, "dur": 1}]])


# -- plan mode -------------------------------------------------------------------------------


def test_zero_paper_figure_1_exactly():
    """Rajbhandari et al. 2020, Fig. 1: 7.5B, N_d = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB.

    The paper's GB are 1e9 bytes: 16 * 7.5e9 B = 120e9 B = 111.8 GiB.
    """
    psi, n = 7_500_000_000, 64
    exact = [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    shown = [120.0, 31.4, 16.6, 1.9]
    for level, (want, label) in enumerate(zip(exact, shown, strict=True)):
        got = sum(model_state_bytes(psi, n, level, "mixed").values())
        assert got == want
        assert round(got / 1e9, 1) == label
        res = plan(params_count=psi, devices=n, zero=level)
        states = sum(res.memory_bytes[c] for c in ("parameters", "gradients", "optimizer_state"))
        assert states == want


def test_fp32_adam_formulas():
    psi, n = 1_000_000, 8
    totals = [sum(model_state_bytes(psi, n, z, "fp32").values()) for z in range(4)]
    assert totals == [16 * psi, 8 * psi + 8 * psi // n, 4 * psi + 12 * psi // n, 16 * psi // n]


def test_parameter_counts_of_presets():
    counts = {k: MODELS[k].param_count() for k in MODELS}
    assert counts["gpt2"] == 124_439_808  # HF gpt2
    assert counts["gpt2-medium"] == 354_823_168
    assert counts["gpt2-large"] == 774_030_080
    assert counts["gpt2-xl"] == 1_557_611_200
    assert counts["gpt2-mini"] == 3_257_856
    assert counts["fc-mnist"] == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert 1.3e9 < counts["gpt3-xl"] < 1.35e9
    assert abs(counts["gpt-j-6b"] - 6_053_381_344) / 6_053_381_344 < 1e-3


def test_korthikanti_activation_formulas():
    spec = MODELS["megatron-22b"]  # h 6144, a 64, L 48; s 2048, b 4, t 8
    none = spec.n_layer * layer_activation_bytes(spec, 4, 2048, tp=8)
    seqsel = spec.n_layer * layer_activation_bytes(
        spec, 4, 2048, tp=8, sequence_parallel=True, recompute="selective"
    )
    assert none / 2**30 == pytest.approx(59.25)  # Korthikanti Fig. 1
    assert seqsel / 2**30 == pytest.approx(9.5625)
    s, b, h, a = 2048, 4, 6144, 64
    # sbh(34 + 5as/h) for mixed precision; sbh(66 + 9as/h) for fp32
    assert layer_activation_bytes(spec, b, s) == 34 * s * b * h + 5 * a * s * s * b
    assert layer_activation_bytes(spec, b, s, elem=4) == 66 * s * b * h + 9 * a * s * s * b
    assert layer_activation_bytes(spec, b, s, recompute="full") == 2 * s * b * h


def test_plan_cli_is_fast_and_reports(capsys):
    assert main(["--model", "gpt2-xl", "--devices", "64", "--profile", "a100-80gb", "--zero",
                 "2", "--batch", "8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for word in ("parameters", "optimizer_state", "activations", "fits", "samples/s"):
        assert word in out
    assert main(["--model", "gpt2", "--devices", "8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["fits"] and res["step_s"] > 0 and res["plan_seconds"] < 0.5
    assert main(["--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_plan_predicts_oom_with_a_hint():
    res = plan(model="gpt2-xl", devices=8, profile="a100-40gb", zero=0, batch=32)
    assert not res.fits
    assert "simulated out of memory on a100-40gb" in res.oom_message
    assert "micro-batch" in res.oom_message or "zero_opt_level" in res.oom_message
    assert plan(model="gpt2-xl", devices=8, profile="a100-40gb", zero=2, batch=2).fits


def test_plan_overlap_rule_and_zero_levels():
    base = dict(model="gpt2-large", devices=16, batch=8, profile="a100-80gb")
    r0 = plan(**base, zero=0)
    assert r0.breakdown_s["dp_comm_exposed"] <= r0.breakdown_s["dp_comm_total"]
    r0n = plan(**base, zero=0, overlap=False)
    assert r0n.breakdown_s["dp_comm_exposed"] == pytest.approx(r0n.breakdown_s["dp_comm_total"])
    r2 = plan(**base, zero=2)
    assert r2.memory_bytes["optimizer_state"] < r0.memory_bytes["optimizer_state"]
    r3 = plan(**base, zero=3)
    assert r3.breakdown_s["dp_comm_total"] > r0.breakdown_s["dp_comm_total"]  # 1.5x volume


def test_weight_streaming_and_missing_figures():
    res = plan(model="gpt2-xl", devices=1, profile="cs2", batch=8)
    assert res.step_s == pytest.approx(2 * 2 * res.params / 150e9)
    assert any("streaming" in n for n in res.notes)
    sn = plan(model="gpt2", devices=16, profile="sn30-rdu", batch=8)
    assert any("not modelled" in n for n in sn.notes)


def test_plan_matches_the_pipeline_formula():
    """(m + (pp-1)/v) stage times: the bubble is (pp-1)/v of one micro-batch's stage time."""
    cfg = PlanConfig(model="gpt3-175b", devices=64, tp=8, pp=8, interleave=3, batch=64,
                     micro_batch=1, recompute="full")  # fmt: skip
    r = Planner(cfg).run()
    per_micro = (r.step_s - r.breakdown_s["optimizer"] - r.breakdown_s["pp_bubble"]) / 64
    assert r.breakdown_s["pp_bubble"] == pytest.approx(7 / 3 * per_micro, rel=1e-9)


# -- calibrate -----------------------------------------------------------------------------


def test_calibrate_times_the_kernels_gemm_on_every_layout(monkeypatch):
    """The GEMM sweeps time ``kernels.blas.gemm`` (the library the run's products use: oneMKL
    or oneDNN where bound), not numba's np.dot (always SciPy's OpenBLAS), each layout as
    the kernels pass it (a transposed operand as a .T view)."""
    from simdist.kernels import blas

    from simdist.calibration import compute

    calls, gemm = [], blas.gemm

    def counted(a, b, c, alpha, beta):
        calls.append((a.flags.c_contiguous, b.flags.c_contiguous, a.shape, b.shape))
        gemm(a, b, c, alpha, beta)

    monkeypatch.setattr(blas, "gemm", counted)
    rates = compute.measure_gemm([64], repeats=1)
    assert rates[64] > 0 and calls and all(c[2] == c[3] == (64, 64) for c in calls)
    calls.clear()
    compute.measure_gemm_shapes([8], repeats=1)
    layouts = {(a, b) for a, b, *_ in calls}
    assert layouts == {(True, True), (True, False), (False, True)}  # nn, nt, tn


def test_alpha_beta_fit_recovers_a_synthetic_link():
    from simdist.calibrate import fit_alpha_beta

    sizes = [8 * 4**k for k in range(11)]
    times = [3e-6 + s / 5e9 for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(3e-6, rel=1e-6) and 1 / beta == pytest.approx(5e9, rel=1e-6)


def _plain_host(tmp_path: Path) -> tuple[str, Path]:
    """The shipped host profile without its optional size- and shape-keyed tables (the text
    and a file of it), so the tests below can add tables of their own."""
    text = re.sub(
        r"\n *(size_efficiency|reduce_efficiency|store_efficiency|reducing_efficiency):[^\n]*"
        r"(\n +- [^\n]*)*",
        "",
        (PROFILE_DIR / "host.yaml").read_text(),
    )
    text = re.sub(r"\n  matrix_shape_efficiency:[^\n]*(\n    [^\n]*)*", "", text)
    path = tmp_path / "host-plain.yaml"
    path.write_text(text)
    prof = load_profile(path)
    assert not (prof.intra.size_efficiency or prof.matrix_shape_efficiency)
    return text, path


def test_size_keyed_link_tables(tmp_path):
    """A link's optional per-size tables: the Sendrecv rates after the latency (calibrate's
    ``message_rates``) and the add rates, used per message by the schedule model."""
    from simdist.calibrate import message_rates
    from simdist.device.schedule import step_time

    sizes = [8 * 4**k for k in range(11)]
    rate = {s: (2e9 if s < 2**20 else 8e9) for s in sizes}  # caches: a two-speed link
    times = [2e-6 + s / rate[s] for s in sizes]
    got = message_rates(sizes, times, 2e-6)
    assert min(got) == 32768 and all(got[s] == pytest.approx(rate[s]) for s in got)

    text, plain_path = _plain_host(tmp_path)
    text = text.replace(
        "    reduce_gbs:",
        "    size_efficiency: [[1048576, 1.0], [0, 0.25]]\n"
        "    reduce_efficiency: [[16777216, 0.5], [0, 1.0]]\n    reduce_gbs:",
        1,
    )
    path = tmp_path / "host-sized.yaml"
    path.write_text(text)
    link = load_profile(path).intra
    plain = load_profile(plain_path).intra
    assert link.beta_at(4 << 20) == pytest.approx(plain.beta)
    assert link.beta_at(4096) == pytest.approx(4 * plain.beta)
    assert link.gamma_at(32 << 20) == pytest.approx(2 * plain.gamma)
    assert link.gamma_at(1 << 20) == pytest.approx(plain.gamma)
    # each step at its message's size: the Sendrecv, then what the reduce exchange adds
    small, big = 65536.0, 32.0 * 2**20
    step = [(1, small, small, small), (1, big, big, big)]
    want = max(link.latency + small * 4 * plain.beta + small * plain.gamma,
               link.latency + big * plain.beta + big * 2 * plain.gamma)  # fmt: skip
    assert step_time(step, link) == pytest.approx(want)
    bad = text.replace("[0, 0.25]", "[0, 1.5]")
    path.write_text(bad)
    with pytest.raises(ProfileError, match="size_efficiency"):
        load_profile(path)


def test_a_link_made_from_probes_gives_them_back_at_their_sizes():
    """calibrate's rules turn probe times into a link that the schedule model reads back at
    the probed sizes: a 2-rank ring all-gather is the Sendrecv of its block plus the call
    overhead, a reduce-scatter the reduce exchange plus it (even where the exchange beats
    the plain Sendrecv), the shm ones two fences around the peer loads, loads that add,
    and for the all-reduce's second half stores."""
    from simdist.calibrate import (
        DIRECT_SIZES,
        MESSAGE_SIZES,
        REDUCE_SIZES,
        fit_alpha_beta,
        intra_link,
    )
    from simdist.device.profile import parse_link
    from simdist.device.schedule import schedule_time

    sendrecv = {s: 3e-6 + s / 10e9 for s in MESSAGE_SIZES}
    reduce = {s: sendrecv[s] + s / 20e9 for s in REDUCE_SIZES}
    reduce[2**21] = 3e-6 + 2**21 / 12e9  # its pipelined segments beat the plain Sendrecv
    mpi = {
        "sizes": MESSAGE_SIZES,
        "sendrecv": list(sendrecv.values()),
        "sendrecv_fit": fit_alpha_beta(MESSAGE_SIZES, list(sendrecv.values())),
        "reduce_sizes": REDUCE_SIZES,
        "reduce": list(reduce.values()),
        "call": 2e-6,
    }
    direct = {
        "sizes": DIRECT_SIZES,
        "copy": [s / 30e9 for s in DIRECT_SIZES],
        "add": [s / 30e9 + s / 60e9 for s in DIRECT_SIZES],
        "store": [s / 40e9 for s in DIRECT_SIZES],
        "step": 4e-6,
    }
    link = parse_link(intra_link(mpi, direct, 40e9), "intra")
    for block in (2**19, 2**21, 2**23):
        two = [block, block]
        ag = schedule_time("allgather", "ring", two, link)
        assert ag == pytest.approx(2e-6 + sendrecv[block], rel=1e-6)
        rs = schedule_time("reduce_scatter", "ring", two, link)
        assert rs == pytest.approx(2e-6 + reduce[block], rel=1e-6)
        ar = schedule_time("allreduce", "ring", two, link)
        assert ar == pytest.approx(2e-6 + reduce[block] + sendrecv[block], rel=1e-6)
        shm_rs = schedule_time("reduce_scatter", "shm", two, link)
        assert shm_rs == pytest.approx(8e-6 + block / 30e9 + block / 60e9, rel=1e-6)
        shm_ag = schedule_time("allgather", "shm", two, link)
        assert shm_ag == pytest.approx(8e-6 + block / 30e9, rel=1e-6)
        shm_ar = schedule_time("allreduce", "shm", two, link)  # 1 fence per half, stores
        assert shm_ar == pytest.approx(8e-6 + block / 30e9 + block / 60e9 + block / 40e9)
    # with the Sendrecv after a reduce measured too, the all-reduce's second half is that
    # probe; an all-gather alone stays the plain Sendrecv
    gather = {s: 3e-6 + s / 8e9 for s in REDUCE_SIZES}
    after = parse_link(intra_link({**mpi, "gather": list(gather.values())}, None, 40e9), "intra")
    assert len(after.gather_efficiency) == len(REDUCE_SIZES)
    for block in (2**19, 2**21, 2**23):
        two = [block, block]
        ar = schedule_time("allreduce", "ring", two, after)
        assert ar == pytest.approx(2e-6 + reduce[block] + gather[block], rel=1e-6)
        ag = schedule_time("allgather", "ring", two, after)
        assert ag == pytest.approx(2e-6 + sendrecv[block], rel=1e-6)


def test_shm_schedule_runs_on_the_links_direct_peer_access(tmp_path):
    """ "shm" is costed on the link's ``direct`` figures (peer load/store: fences and a copy
    rate), or on the link itself where the profile has none (GPU peer-to-peer)."""
    from simdist.device.schedule import schedule_time

    _, plain_path = _plain_host(tmp_path)
    link = load_profile(plain_path).intra
    d = link.direct
    assert d is not None and d.known and d.latency > 0 and link.peer_access is d
    assert d.gamma > 0  # the host adds on its cores: the direct link has a reduce rate
    b = 1 << 20  # per-rank block bytes, 2 ranks
    # all-reduce: 2 fences, pull the peer's half of my block (adding), store the sum into
    # the peer's buffer
    assert schedule_time("allreduce", "shm", [b, b], link) == pytest.approx(
        2 * d.latency + 2 * b * d.beta + b * d.gamma
    )
    # 2 fences each alone; the reduce-scatter adds what it pulls
    rs = schedule_time("reduce_scatter", "shm", [b, b], link)
    assert rs == pytest.approx(2 * d.latency + b * d.beta + b * d.gamma)
    ag = schedule_time("allgather", "shm", [b, b], link)
    assert ag == pytest.approx(2 * d.latency + b * d.beta)
    # 4 ranks: each pulls 3 blocks' worth in each half
    assert schedule_time("allreduce", "shm", [b] * 4, link) == pytest.approx(
        2 * d.latency + 2 * 3 * b * d.beta + 3 * b * d.gamma
    )
    gpu = load_profile("a100-80gb").intra
    assert gpu.direct is None and gpu.peer_access is gpu
    assert schedule_time("allreduce", "shm", [b] * 8, gpu) == pytest.approx(
        2 * gpu.latency + 2 * 7 * b * gpu.beta + 7 * b * gpu.gamma
    )


def test_scalar_rates_cost_the_serial_part_of_vector_kernels(tmp_path):
    """compute.scalar_tflops (calibrated for host: rowops.row_sum, the float64 norm) costs
    the FLOPs a kernel cannot vectorise; profiles without it (GPUs) cost them as vector
    FLOPs. Older profiles with vector_tflops.fp64 are an error that says to recalibrate."""
    host = load_profile("host")
    assert set(host.scalar_flops) == {"fp32", "fp64"}
    assert all(0 < r < host.peak("vector", "fp32") for r in host.scalar_flops.values())
    cm = CostModel(host)
    flops, serial = 8e6, 4e6
    t_c, _ = cm.kernel_terms(flops, 0.0, "vector", serial_flops=serial)
    assert t_c == pytest.approx(
        serial / host.scalar_flops["fp32"] + (flops - serial) / host.peak("vector", "fp32")
    )
    t64, _ = cm.kernel_terms(2e6, 0.0, "vector", "fp64", serial_flops=2e6)
    assert t64 == pytest.approx(2e6 / host.scalar_flops["fp64"])
    gpu = CostModel(load_profile("a100-80gb"))
    assert not gpu.profile.scalar_flops
    assert gpu.kernel_terms(flops, 0.0, "vector", "bf16", serial_flops=serial) == (
        gpu.kernel_terms(flops, 0.0, "vector", "bf16")
    )
    text = (PROFILE_DIR / "host.yaml").read_text()
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("  scalar_tflops:", "  scalar_tflops:\n    fp8: 1.0", 1))
    with pytest.raises(ProfileError, match="scalar_tflops"):
        load_profile(path)
    old = text.replace("    fp16: null          # not applicable\n", "    fp64: 0.007\n", 1)
    path.write_text(old)
    with pytest.raises(ProfileError, match="re-run"):
        load_profile(path)


def test_combine_per_kind_and_memory_keyed_by_working_set(tmp_path):
    """Host: GEMMs add their operand traffic (sum), streaming loops hide it (roofline), and
    the memory rate is the one for arrays of the step's resident bytes."""
    host = load_profile("host")
    assert host.combine_for("matmul") == "sum" and host.combine_for("vector") == "roofline"
    assert host.memory_efficiency_key == "working_set"
    cold, warm = CostModel(host, working_set=64e6), CostModel(host)
    flops, nbytes = 2 * 32 * 784 * 512, 4 * (32 * 784 + 784 * 512 + 32 * 512)
    tc, tm = cold.kernel_terms(flops, nbytes, "matmul")
    _, tm_warm = warm.kernel_terms(flops, nbytes, "matmul")
    assert tm > 2 * tm_warm  # 64 MB resident: DRAM's rate, not the cache's
    launch = host.kernel_launch
    assert cold.compute_time(flops, nbytes, "matmul") == pytest.approx(tc + tm + launch)
    vc, vm = cold.kernel_terms(1e6, nbytes, "vector")
    assert cold.compute_time(1e6, nbytes, "vector") == pytest.approx(max(vc, vm) + launch)
    # GPU profiles key by the kernel's own bytes: the working set changes nothing
    gpu = load_profile("a100-80gb")
    assert gpu.memory_efficiency_key == "kernel"
    assert CostModel(gpu, working_set=1e12).kernel_terms(1e9, 1e6) == CostModel(gpu).kernel_terms(
        1e9, 1e6
    )
    text = (PROFILE_DIR / "host.yaml").read_text()
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("    vector: roofline", "    vector: overlap", 1))
    with pytest.raises(ProfileError, match="combine"):
        load_profile(path)
    path.write_text(text.replace("efficiency_key: working_set", "efficiency_key: cache", 1))
    with pytest.raises(ProfileError, match="efficiency_key"):
        load_profile(path)


def test_the_optimizer_pass_is_priced_by_its_own_sweep(tmp_path):
    """A host profile with ``memory.optimizer_efficiency`` prices the optimizer's update
    (and only it) at that table's rate, in a run's step model and in plan mode alike;
    without one (the shipped host, GPU profiles) the memory table prices it."""
    from simdist.sim.clock import VirtualClock
    from simdist.sim.step import StepModel

    text = (PROFILE_DIR / "host.yaml").read_text()
    # AdamW at half the copy / add sweep's rate at every size
    rows = [r for r in load_profile("host").memory_efficiency]
    table = "".join(f"    - [{size / 1e6:g}, {eff / 2:g}]\n" for size, eff in rows)
    doc = text.replace("links:\n", "  optimizer_efficiency:\n" + table + "links:\n", 1)
    (path := tmp_path / "opt.yaml").write_text(doc)
    prof, plain = load_profile(path), load_profile("host")
    assert prof.optimizer_efficiency == tuple((s, e / 2) for s, e in rows)
    assert plain.optimizer_efficiency == ()
    n = 669_706  # FC-MNIST's parameters: AdamW moves 28 bytes each
    for ws in (0.0, 11e6, 64e6):
        cost = CostModel(prof, working_set=ws)
        _, t_opt = cost.kernel_terms(14.0 * n, 28.0 * n, "vector", optimizer=True)
        _, t_mem = cost.kernel_terms(14.0 * n, 28.0 * n, "vector")
        assert t_opt == pytest.approx(2 * t_mem)
        assert t_mem == CostModel(plain, working_set=ws).kernel_terms(14.0 * n, 28.0 * n)[1]
    bad = doc.replace(f"    - [{rows[0][0] / 1e6:g}, {rows[0][1] / 2:g}]", "    - [1, 1.5]", 1)
    (tmp_path / "bad.yaml").write_text(bad)
    with pytest.raises(ProfileError, match="optimizer_efficiency"):
        load_profile(tmp_path / "bad.yaml")

    def step_optimizer_seconds(profile) -> float:
        cost = CostModel(profile, working_set=64e6)
        clock = VirtualClock(cost, 0, record_events=False)
        model = StepModel(clock, cost, "fp32", None, 0, (0, n), lambda *a: [], [])
        model._vector("optimizer.adamw", 14.0 * n, 28.0 * n, optimizer=True)
        model._vector("optimizer.sgd", 6.0 * n, 20.0 * n)
        model._vector("grad.accumulate.add", n, 12.0 * n)
        names = ("optimizer.adamw", "optimizer.sgd", "grad.accumulate.add")
        return [clock._by_name[k] for k in names]

    (opt_s, *rest), (opt_plain, *rest_plain) = map(step_optimizer_seconds, (prof, plain))
    assert opt_s > 1.5 * opt_plain and rest == rest_plain  # only AdamW's pass


def test_working_set_rate_is_read_between_the_sweeps_points():
    """The host's memory table is a sweep's samples: between two of them the efficiency is
    linear in log(size), outside them the table's own rows (the row keyed 0 stands for the
    smallest size and everything below it); GPU tables stay step functions."""
    from simdist.device.cost import efficiency, interpolated_efficiency

    table = ((8e6, 0.25), (4e6, 0.5), (2e6, 1.0), (0.0, 0.8))
    assert interpolated_efficiency(table, 2e6) == pytest.approx(1.0)
    assert interpolated_efficiency(table, 2**0.5 * 2e6) == pytest.approx(0.75)
    assert interpolated_efficiency(table, 2**0.5 * 4e6) == pytest.approx(0.375)
    assert interpolated_efficiency(table, 16e6) == 0.25  # beyond the last sample: flat
    assert interpolated_efficiency(table, 1e6) == 0.8  # below the smallest keyed size
    assert efficiency(table, 2**0.5 * 2e6) == 1.0  # the step function, for comparison
    host = load_profile("host")
    rows = [r for r in host.memory_efficiency if r[0] > 0]
    (hi, e_hi), (lo, e_lo) = rows[-2], rows[-1]  # two sample points of the shipped sweep
    mid = (hi * lo) ** 0.5
    _, t_mid = CostModel(host, working_set=mid).kernel_terms(1e3, 1e6, "vector")
    _, t_lo = CostModel(host, working_set=lo).kernel_terms(1e3, 1e6, "vector")
    assert t_mid == pytest.approx(t_lo * e_lo / ((e_lo + e_hi) / 2))


def test_calibrate_under_mpi_measures_the_link_and_direct_peer_access(tmp_path):
    from mpi_launch import run_mpi

    out = tmp_path / "host.yaml"
    r = run_mpi(2, ["-m", "simdist.calibrate", "--quick", "--repeats", "1", "--out", out], 300)
    assert r.returncode == 0, r.stdout
    prof = load_profile(out)
    assert prof.intra.known and prof.intra.latency > 0 and prof.intra.size_efficiency
    assert prof.intra.reducing_efficiency and prof.intra.call_overhead > 0
    # the Sendrecv after a reduce exchange (an all-reduce's second half): one row per size
    assert len(prof.intra.gather_efficiency) == len(prof.intra.reducing_efficiency)
    assert all(0 < frac <= 1 for _, frac in prof.intra.gather_efficiency)
    assert "Sendrecv after reduce at" in out.read_text()
    d = prof.intra.direct
    assert d is not None and d.known and d.latency > 0 and d.size_efficiency
    assert d.reducing_efficiency and d.gamma > 0
    text = out.read_text()
    assert d.store_efficiency
    raws = ("sendrecv_us", "reduce_exchange_us", "gather_after_reduce_us", "direct_copy_us")
    for raw in (*raws, "direct_add_us", "direct_store_us"):
        assert raw in text


def test_gemm_efficiency_by_shape_and_layout(tmp_path):
    from simdist.device.cost import gemm_efficiency
    from simdist.models.base import gemm

    k = gemm("fc2.dinput", 32, 512, 512, "backward", layout="nt")
    assert k.shape == (32, 512, 512, "nt") and k.flops == 2 * 32 * 512 * 512
    text, plain_path = _plain_host(tmp_path)
    big = "[[512, 1.0], [0, 1.0]]"
    table = (
        "  matrix_shape_efficiency:\n"
        f"    nn: {{m: [[512, 1.0], [64, 0.8], [0, 0.5]], k: [[512, 1.0], [0, 0.9]], n: {big}}}\n"
        "    nt: {m: [[512, 0.9], [0, 0.45]], k: [[512, 0.9], [0, 0.9]],"
        " n: [[512, 0.9], [0, 0.9]]}\n"
    )
    text = text.replace("  vector_efficiency:", table + "  vector_efficiency:", 1)
    path = tmp_path / "host-shapes.yaml"
    path.write_text(text)
    shaped, plain = CostModel(load_profile(path)), CostModel(load_profile(plain_path))
    tables = shaped.profile.matrix_shape_efficiency
    peak = shaped.profile.peak("matmul", "fp32")
    # the small axis picks the table; a second small axis multiplies its ratio in
    assert gemm_efficiency(tables, 32, 512, 512, "nn") == pytest.approx(0.5)
    assert gemm_efficiency(tables, 128, 512, 512, "nn") == pytest.approx(0.8)
    assert gemm_efficiency(tables, 512, 16, 512, "nn") == pytest.approx(0.9)
    assert gemm_efficiency(tables, 32, 16, 512, "nn") == pytest.approx(0.45)
    assert gemm_efficiency(tables, 1024, 1024, 1024, "nn") == pytest.approx(1.0)
    # a measured layout uses its own tables (ratios to its own reference); an unmeasured
    # one falls back to "nn"
    assert gemm_efficiency(tables, 32, 512, 512, "nt") == pytest.approx(0.45)
    assert gemm_efficiency(tables, 32, 512, 512, "tn") == pytest.approx(0.5)
    t_c, _ = shaped.kernel_terms(k.flops, k.bytes, "matmul", shape=k.shape)
    assert t_c == pytest.approx(k.flops / (0.45 * peak))
    # without a shape (or without the tables) the FLOP-keyed table applies, as before
    assert shaped.kernel_terms(k.flops, k.bytes) == plain.kernel_terms(k.flops, k.bytes)
    assert plain.kernel_terms(k.flops, k.bytes, shape=k.shape) == plain.kernel_terms(
        k.flops, k.bytes
    )
    # malformed tables and the older format are errors that say what to do
    path.write_text(text.replace("    nt: {m:", "    tt: {m:"))
    with pytest.raises(ProfileError, match="matrix_shape_efficiency"):
        load_profile(path)
    path.write_text(text.replace(", n: " + big, ""))
    with pytest.raises(ProfileError, match="one table for each axis"):
        load_profile(path)
    old = text.replace(table, "  matrix_min_dim_efficiency: [[512, 1.0], [0, 0.5]]\n")
    path.write_text(old)
    with pytest.raises(ProfileError, match="re-run"):
        load_profile(path)


def test_calibrate_link_only_keeps_the_base_compute_section(tmp_path):
    """--link-only BASE re-measures links and memory and copies BASE's compute verbatim."""
    from mpi_launch import run_mpi

    from simdist.calibrate import _compute_section
    from simdist.calibrate import main as calibrate

    out = tmp_path / "link.yaml"
    args = ["-m", "simdist.calibrate", "--quick", "--repeats", "1", "--link-only", "host"]
    r = run_mpi(2, [*args, "--out", out], 300)
    assert r.returncode == 0, r.stdout
    text = out.read_text()
    assert _compute_section(text) == _compute_section((PROFILE_DIR / "host.yaml").read_text())
    assert "--link-only: the compute section is host's" in text
    prof = load_profile(out)
    assert prof.intra.known and prof.intra.direct is not None and prof.matrix_shape_efficiency
    with pytest.raises(SystemExit, match="mpiexec"):  # serial: there is no link to measure
        calibrate(["--link-only", "host", "--out", str(tmp_path / "x.yaml")])


def test_validate_sim_published_points_stay_within_their_targets(tmp_path, monkeypatch):
    """The published part of scripts/validate_sim.py is deterministic (plan mode and the
    collective model on shipped profiles, no timing): every row within 15 %, 10 % mean."""
    mod = _validate_sim_module(monkeypatch)
    out = tmp_path / "rows.json"
    assert mod.main(["--part", "published", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) >= 20 and all(r["part"] == "published" for r in rows)
    errs = [abs(r["rel_error"]) for r in rows]
    misses = [(r["case"], r["rel_error"]) for r in rows if abs(r["rel_error"]) > 0.15]
    assert not misses, misses
    assert sum(errs) / len(errs) <= 0.10
    zero = [r for r in rows if r["unit"] == "GB"]  # the ZeRO paper's model states: exact
    assert len(zero) == 4 and all(abs(r["rel_error"]) < 0.02 for r in zero)


def _validate_sim_module(monkeypatch):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "validate_sim.py"
    spec = importlib.util.spec_from_file_location("validate_sim", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "validate_sim", mod)  # its dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


def test_validate_sim_parallel_rows_on_a_tiny_config(tmp_path, monkeypatch, capsys):
    """validate_sim's tensor-parallel and pipeline rows (``measured_parallel``) on FC-MNIST
    (gpt2-mini for weight mode), 3 steps: one ``parallel step`` row per case with the run's
    simulated and measured step (the pipeline's prediction holds no measured part), printed
    with the summary line the other kinds get; every prediction includes its measured host
    time, as DP's do. The pipeline and weight-mode cases add a ``plan vs run`` row each:
    plan mode for the run's configuration against the run's ``est_step_time_s``, whose
    device part it equals (rel 1e-5, as tests/test_simulate.py checks), so its error is the
    run's measured host share (below 5 % only on an idle machine: not asserted)."""
    mod = _validate_sim_module(monkeypatch)
    cases = {
        "TP2 (batch) tiny": ("fc_mnist", 3, 2, ["--tensor-parallel=2"]),
        "PP2 1f1b tiny": ("fc_mnist", 3, 2, ["--pipeline-parallel=2",
                          "--optimizer.grad_accum_steps=2", "--train_input.batch_size=8"]),
        "TP2 (weight) tiny": ("gpt2_mini", 3, 2, ["--tensor-parallel=2",
                              "--tensor-parallel-mode=weight", mod.NO_CLIP]),
    }  # fmt: skip
    assert mod.NO_CLIP in mod.PARALLEL_MEASURED["TP2 (weight) gpt2-mini"][3]
    rows = mod.measured_parallel(1, tmp_path, cases)
    assert [r["case"] for r in rows] == [
        "step TP2 (batch) tiny np 2",
        "step PP2 1f1b tiny np 2",
        "plan vs run PP2 1f1b tiny np 2",
        "step TP2 (weight) tiny np 2",
        "plan vs run TP2 (weight) tiny np 2",
    ]
    tp, pp, pp_plan, tpw, tpw_plan = rows
    for r in (tp, pp, tpw):
        assert r["kind"] == "parallel step" and r["target"] == 0.15 and r["np"] == 2
        assert r["predicted"] > 0 and 0 < r["measured"] <= r["measured_median"]
        assert r["rel_error"] == pytest.approx((r["predicted"] - r["measured"]) / r["measured"])
    assert tp["measured_share"] > 0 and "other" in tp["breakdown_ms"]
    assert pp["measured_share"] > 0 and "forward_backward" in pp["breakdown_ms"]
    assert tpw["measured_share"] > 0 and "other" in tpw["breakdown_ms"]
    for row, run in ((pp_plan, pp), (tpw_plan, tpw)):
        assert row["kind"] == "plan vs run" and row["target"] == 0.05
        assert row["measured"] == pytest.approx(run["predicted"])  # the run's est_step_time_s
        assert abs(row["device_rel_error"]) <= 1e-5
        # what is left is the run's measured host time, which a plan cannot know
        assert row["rel_error"] == pytest.approx(-row["host_share"], abs=1e-5)
    mod._print(rows)
    out = capsys.readouterr().out
    assert "step PP2 1f1b tiny np 2" in out and "parallel step" in out
    assert "plan vs run PP2 1f1b tiny np 2" in out and tpw_plan["case"] in out


def test_validate_sim_collectives_worker_probes_each_cases_buffer(tmp_path, monkeypatch):
    """validate_sim's collectives worker at 2 ranks with --worker-probe: every case has its
    calls timed and the link probed on its own buffer in every round (MPI exchanges for
    ring and rhd; peer loads, adds and stores for shm), and ``case_links`` makes one link
    per round on which the model gives back that round's probes at the case's block: a
    ring step is the probed exchange plus the call overhead (an all-reduce's second half
    the Sendrecv probed right after a reduce), an shm half its probed pass plus the
    fences."""
    from mpi_launch import run_mpi

    from simdist.comm.partition import partition
    from simdist.device.schedule import schedule_time

    mod = _validate_sim_module(monkeypatch)
    out = tmp_path / "cases.json"
    r = run_mpi(2, [mod.__file__, "--collectives-worker", out, "--worker-probe"], 600)
    assert r.returncode == 0, r.stdout
    rows = json.loads(out.read_text())
    assert len(rows) == len(mod.COLL_OPS) * len(mod.COLL_ALGS) * len(mod.COLL_SIZES)
    base = CostModel(load_profile("host")).link("intra", 2)
    for row in rows:
        assert 0 < row["best_us"] <= row["median_us"], row
        calls = row["calls_us"]  # every timed call, in order (rounded to 0.01 us)
        assert len(calls) == mod.COLL_CALLS
        assert min(calls) == pytest.approx(row["best_us"], abs=0.01), row
        shm = row["algorithm"] == "shm"
        rounds = row["link"]["rounds"]
        mpi = {"sendrecv", "reduce"} | ({"gather"} if row["op"] == "allreduce" else set())
        assert set(rounds) == ({"copy", "add", "store"} if shm else mpi)
        for kind, by_size in rounds.items():  # up to the case's own block, every round
            assert max(int(s) for s in by_size) == row["bytes"] // 2, (kind, row)
            assert {len(v) for v in by_size.values()} == {mod.COLL_CALLS}
        links = mod.case_links(row, base)
        assert len(links) == mod.COLL_CALLS
        bounds = partition(row["bytes"] // 4, 2)
        blocks = [4 * int(x) for x in bounds[1:] - bounds[:-1]]
        half, lat = str(row["bytes"] // 2), row["link"]["latency"]
        for k, link in enumerate(links):
            t = {kind: by_size[half][k] for kind, by_size in rounds.items()}
            if shm:  # fences as the call pays them, then its passes over the peer's memory
                want = {
                    "reduce_scatter": 2 * lat["step"] + t["add"],
                    "allgather": 2 * lat["step"] + t["copy"],
                    "allreduce": 2 * lat["step"] + t["add"] + t["store"],
                }[row["op"]]
            else:
                # an all-reduce's second half is the Sendrecv probed right after a reduce
                first, second = {
                    "reduce_scatter": ("reduce", None),
                    "allgather": ("sendrecv", None),
                    "allreduce": ("reduce", "gather"),
                }[row["op"]]
                want = lat["call"] + t[first] + (t[second] if second else 0.0)
            got = schedule_time(row["op"], row["algorithm"], blocks, link)
            assert got == pytest.approx(want, rel=1e-3), (row["op"], row["algorithm"], k)


def test_calibrate_writes_a_loadable_host_profile(tmp_path):
    from simdist.calibrate import main as calibrate

    out = tmp_path / "host.yaml"
    assert calibrate(["--out", str(out), "--quick", "--repeats", "1"]) == 0
    prof = load_profile(out)
    assert prof.name == "host" and prof.launch_mode == "serial"
    assert prof.peak("matmul", "fp32") > 1e9
    assert prof.memory_bandwidth > 1e9
    assert "links.intra.bandwidth_gbs" in prof.unknown  # serial run, no previous figures
    text = out.read_text()
    assert "not measured" in text and "cores" in text
    assert math.isfinite(CostModel(prof).compute_time(1e9, 1e6))
    # the optimizer's own pass, one row per array size of the sweep (2 in --quick)
    assert len(prof.optimizer_efficiency) == 2 and "AdamW's update" in text
    assert all(0 < eff <= 1 for _, eff in prof.optimizer_efficiency)
    # which CPU the rates are of: a run elsewhere says so (next test)
    assert prof.sources["cpu"] == cpu_identity() and cpu_identity() in prof.description


def test_a_run_says_when_its_profile_was_calibrated_on_another_cpu(tmp_path, capsys):
    """calibrate records its CPU in the profile's sources; a run (and plan mode) on another
    CPU notes that the predictions describe that machine, on the same CPU says nothing."""
    from mpi_launch import run_mpi

    shipped = (PROFILE_DIR / "host.yaml").read_text()
    assert "sources:\n" in shipped
    logs = {}
    for name, cpu in (("other", "Imaginary CPU (NoVendor 1/2/3)"), ("same", cpu_identity())):
        profile = tmp_path / f"{name}.yaml"
        profile.write_text(shipped.replace("sources:\n", f"sources:\n  cpu: {json.dumps(cpu)}\n"))
        assert load_profile(profile).sources["cpu"] == cpu
        model_dir = tmp_path / name
        args = ["-m", "simdist.train", "--params", "fc_mnist", "--runconfig.max_steps=2",
                f"--runconfig.model_dir={model_dir}", f"--runconfig.device_profile={profile}",
                "--runconfig.save_checkpoints_steps=0"]  # fmt: skip
        out = run_mpi(1, args, 300)
        assert out.returncode == 0, out.stdout
        logs[name] = (model_dir / "run.log").read_text()
    note = f"was calibrated on Imaginary CPU (NoVendor 1/2/3), this CPU is {cpu_identity()}"
    assert note in logs["other"]
    assert "was calibrated on" not in logs["same"]
    # plan mode says it too, on stderr (stdout stays --json's)
    from simdist.plan import main as plan

    for name, noted in (("other", True), ("same", False)):
        args = ["--model", "gpt2-mini", "--precision", "fp32", "--json"]
        assert plan([*args, "--profile", str(tmp_path / f"{name}.yaml")]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out) and (note in err) == noted, err


def test_bench_gpt2_step_says_when_its_predictions_may_describe_another_machine(tmp_path):
    """bench_gpt2_step's per-kernel predictions note a profile that names no CPU (the
    packaged ``host``, written before calibrate recorded one) or names another CPU; one
    calibrated here, and a GPU profile, get no note."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpt2_step.py"
    spec = importlib.util.spec_from_file_location("bench_gpt2_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shipped = (PROFILE_DIR / "host.yaml").read_text()
    profiles = {"unnamed": tmp_path / "unnamed.yaml"}
    profiles["unnamed"].write_text(shipped.replace("\n  cpu: ", "\n  old_cpu: "))
    for name, cpu in (("other", "Imaginary CPU (NoVendor 1/2/3)"), ("same", cpu_identity())):
        profiles[name] = tmp_path / f"{name}.yaml"
        profiles[name].write_text(
            shipped.replace("sources:\n", f"sources:\n  cpu: {json.dumps(cpu)}\n", 1)
        )
    assert "cpu" not in load_profile(profiles["unnamed"]).sources
    assert "names no CPU" in mod.profile_note(str(profiles["unnamed"]))
    assert "calibrated on Imaginary CPU" in mod.profile_note(str(profiles["other"]))
    assert mod.profile_note(str(profiles["same"])) is None
    assert mod.profile_note("a100-80gb") is None


def test_cpu_identity_names_model_vendor_family_model_stepping():
    from simdist.hostcpu import parse_cpuinfo

    text = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
        "model name\t: Intel(R) Xeon(R) Processor\nstepping\t: 2\n"
        "flags\t\t: fpu sse4_2 avx2 fma avx512f amx_tile\n\n"
        "processor\t: 1\nvendor_id\t: OtherVendor\nflags\t\t: avx512_fp16\n"
    )  # only the first processor's entry counts
    info = parse_cpuinfo(text)
    assert cpu_identity(info) == "Intel(R) Xeon(R) Processor (GenuineIntel 6/207/2)"
    assert info["isa"] == ["sse4_2", "avx2", "fma", "avx512f", "amx_tile"]
    assert "fpu" in info["flags"] and "avx512_fp16" not in info["flags"]
    bare = parse_cpuinfo("")  # no /proc/cpuinfo: platform's name, nothing more
    assert cpu_identity(bare) == bare["model"] and bare["model"] and bare["isa"] == []


def test_device_bundle_summary():
    from simdist.device import Device, gemm_cost

    dev = Device.create("a100-80gb", rank=3, dtype="fp16", hint="try zero_opt_level 2")
    dev.memory.allocate("parameters", "flat", 1000)
    flops, nbytes = gemm_cost(64, 128, 32, itemsize=2)
    assert (flops, nbytes) == (2 * 64 * 128 * 32, 2 * (64 * 128 + 128 * 32 + 64 * 32))
    dev.clock.compute("gemm", flops, nbytes)
    dev.clock.end_step()
    s = dev.summary(samples_per_step=8)
    assert s["profile"] == "a100-80gb" and s["memory"]["peak_bytes"]["parameters"] == 4000
    assert s["est_samples_per_sec"] == pytest.approx(8 / dev.clock.steps[0].total_s)
    with pytest.raises(SimulatedOutOfMemoryError, match="hint: try zero_opt_level 2"):
        dev.memory.reserve("activations", "huge", 81 * 2**30)


def test_model_kernel_costs_mark_their_serial_flops():
    """The models' cost lists: serial FLOPs only on vector kernels and never more than the
    kernel's FLOPs; the row reductions (layernorm, softmax) and the loss carry some."""
    from simdist.model_config import FCMNISTConfig
    from simdist.models.fc_mnist import FCMNIST
    from simdist.models.gpt2 import GPT2, resolve_config

    gpt2 = GPT2(resolve_config("gpt2-mini")).kernel_costs(2, 16)
    fc = FCMNIST(FCMNISTConfig()).kernel_costs(8)
    for k in gpt2 + fc:
        assert 0 <= k.serial_flops <= k.flops, k.name
        assert k.kind == "vector" or k.serial_flops == 0, k.name
    serial = {k.name.split(".")[-1] for k in gpt2 if k.serial_flops}
    assert {"ln_1", "ln_2", "softmax", "bwd", "softmax_ce"} <= serial
    assert any(k.serial_flops for k in fc if k.name == "softmax_ce")


def test_estimate_fields_split_and_log_line():
    """``simdist.device.estimate``: the shared performance.json fields of every mode."""
    from simdist.device import load_profile
    from simdist.device.estimate import busy_split, est_fields, peak_by_category, simulated_line

    # compute [0, 2) and [1, 3); comm [2.5, 4) and [5, 5.5): 3 s computing, 1.5 s exposed
    assert busy_split([(0, 2), (1, 2)], [(2.5, 1.5), (5, 0.5)], 10.0) == (3.0, 1.5, 5.5)
    assert busy_split([], [(0, 1)], 1.0) == (0.0, 1.0, 0.0)
    prof = load_profile("a100-80gb")
    f = est_fields(prof, 32, 0.5, {"compute": 0.4, "exposed_comm": 0.1})
    assert f["est_samples_per_sec"] == 64.0 and f["est_step_time_s"] == 0.5
    assert f["device_profile"] == "a100-80gb" and f["device_profile_sha256"] == prof.sha256
    assert (
        simulated_line(f) == "Simulated on a100-80gb: 64.00 samples/second (500.000 ms per step)."
    )
    none = est_fields(prof, 32, 0.0, {"compute": 0.0})
    assert none["est_samples_per_sec"] is None and simulated_line(none) is None
    peaks = peak_by_category(
        [{"peak_bytes": {"a": 1, "total": 3}}, {"peak_bytes": {"a": 2, "total": 2}}]
    )
    assert peaks == {"a": 2, "total": 3}


def test_link_latencies_run_each_primitive_right_after_the_written_buffer():
    """``LinkProbe.latencies(written=buf)``: every timed primitive (the bare Sendrecv, the
    ring call, and on shared memory the shm call, its addition and the fence) runs right
    after ``buf`` is written, as validate_sim's collective cases run their calls; without
    it nothing is written (the tight loop calibrate takes)."""
    from mpi4py import MPI

    from simdist.calibration.link import LinkProbe
    from simdist.comm import Collectives

    class Counted(np.ndarray):
        fills = 0

        def fill(self, value):
            type(self).fills += 1
            super().fill(value)

    coll = Collectives(MPI.COMM_SELF)
    probe = LinkProbe(MPI.COMM_SELF, coll.exchanger)
    tiny = coll.buffer(16)
    written = np.zeros(1024, np.float32).view(Counted)
    lat = probe.latencies(coll, tiny, repeats=4, warmup=1, written=written)
    # one rank shares no window: the two MPI primitives (the shm three run at 2 ranks, in
    # the collectives worker's test above)
    assert not coll.registered(tiny)
    assert Counted.fills == (1 + 4) * 2
    assert (np.asarray(written) == 1.0).all()
    assert lat["raw"] > 0 and lat["call"] >= 0
    Counted.fills = 0
    probe.latencies(coll, tiny, repeats=2, warmup=0)
    assert Counted.fills == 0
    probe.free()
    coll.free()
