"""Weight-streaming execution (simdist.streaming, issue #8).

Unit tests of the pieces (roles, ownership plan, transfers, simulated overlap, the exact
norm), then MPI runs of a tiny GPT-2: weight streaming with 1 and 2 servers trains to the
same bits as pipelined data parallelism, checkpoints cross between the modes, and the
demo model (parameters 4.2x the made-up tiny-ws device) fails pipelined with a hint and
trains streamed within the device's memory.
"""

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi_launch import run_mpi
from perf_fields import assert_simulated_fields
from simdist.kernels.optim import LANES, combine_lanes, lane_sum_of_squares, sum_of_squares

from simdist.arena import Layout
from simdist.comm.groups import DEVICE, SERVER, WORKER, Roles
from simdist.config import ConfigError
from simdist.models.base import GradientViews
from simdist.models.gpt2 import GPT2, GPT2Config
from simdist.sim.streaming_step import device_footprint, simulate_step
from simdist.streaming import StreamPlan

TINY_CFG = GPT2Config(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64)


# ------------------------------------------------------------------------- roles
def test_roles_layout_and_round_robin_workers():
    roles = Roles.plan(world=7, servers=1, workers_per_replica=2)
    assert (roles.replicas, roles.servers) == (2, 1)
    assert [roles.role(r) for r in range(7)] == [SERVER, DEVICE, DEVICE] + [WORKER] * 4
    # worker i feeds replica i mod R; a replica's workers take turns in index order
    assert [roles.replica_of_worker(w) for w in range(4)] == [0, 1, 0, 1]
    assert roles.workers_of(0) == [0, 2] and roles.workers_of(1) == [1, 3]
    assert roles.device_rank(1) == 2 and roles.worker_rank(0) == 3
    assert Roles.plan(3, 0, 0).replicas == 3  # pipelined, no workers: every rank a replica


def test_roles_too_few_workers_is_a_clear_error():
    with pytest.raises(ConfigError, match="fewer input workers") as err:
        Roles.plan(world=4, servers=1, workers_per_replica=1)  # 3 ranks: 2 devices, 1 worker
    assert "-np 3" in str(err.value) and "-np 5" in str(err.value)
    with pytest.raises(ConfigError, match="not enough for one replica"):
        Roles.plan(world=1, servers=1, workers_per_replica=0)


# ------------------------------------------------------------------------- the plan
def _tiny_plan(servers: int, replicas: int = 2):
    model = GPT2(TINY_CFG)
    layout = Layout(model.parameter_specs(), replicas)
    return model, layout, StreamPlan(layout, model.stages(), model.gradient_groups(), servers)


@pytest.mark.parametrize("servers", [1, 2, 3])
def test_plan_owners_tile_the_parameters_and_pieces_rebuild_every_stage(servers):
    model, layout, plan = _tiny_plan(servers)
    edges = [lo for lo, _ in plan.ranges] + [plan.ranges[-1][1]]
    assert edges[0] == 0 and edges[-1] == layout.numel
    assert all(a < b for a, b in zip(edges, edges[1:], strict=False))
    for gr in plan.groups:  # a server owns whole groups
        assert plan.ranges[gr.owner][0] <= gr.lo and gr.hi <= plan.ranges[gr.owner][1]
    flat = np.arange(layout.padded, dtype=np.float32)
    truth = layout.views(flat)
    for item in plan.forward_items + plan.backward_items:
        slot = np.full(plan.slot_size, -1, np.float32)
        for p in item.pieces:  # what the owner of each piece broadcasts
            assert plan.ranges[p.server][0] <= p.lo and p.hi <= plan.ranges[p.server][1]
            slot[p.at : p.at + p.hi - p.lo] = flat[p.lo : p.hi]
        for name, view in plan.views(item, slot).items():
            assert np.array_equal(view, truth[name]), (item.stage, name)
    head = plan.forward_items[-1]  # ln_f and the tied wte: two ranges, maybe two owners
    assert set(head.names) == {"ln_f.weight", "ln_f.bias", "wte.weight"}
    assert len(head.pieces) == 2
    assert plan.stages[0].backward_params == ()  # the embedding backward streams nothing


def test_streamed_bytes_analysis():
    """Weights twice per step (the tied wte once more for the head, wpe not needed by the
    embedding's backward), gradients once."""
    model, layout, plan = _tiny_plan(2)
    C, V, T = TINY_CFG.n_embd, TINY_CFG.vocab_size, TINY_CFG.block_size
    s = plan.streamed_elements(accum=2)
    assert s["weights_in"] == 2 * (2 * layout.numel + V * C - T * C)
    assert s["gradients_out"] == 2 * layout.numel


def test_device_footprint_is_the_window_plus_activations():
    model, layout, plan = _tiny_plan(1)
    f = device_footprint(model, replicas=2, micro_batch=4, depth=2)
    assert f["window.weights"] == 4 * 3 * plan.slot_size
    assert f["model.arena"] == model.activation_bytes(4)
    C, V, T = TINY_CFG.n_embd, TINY_CFG.vocab_size, TINY_CFG.block_size
    block = 12 * C * C + 13 * C  # the largest stage and the largest gradient group
    assert plan.slot_size == block
    assert f["window.gradients"] == 4 * 2 * block
    assert f["window.held_gradients"] == 4 * (V * C + T * C)  # the tied embeddings
    assert f["collectives.scratch"] > 0  # 2 replicas reduce-scatter


# ------------------------------------------------------------------------- simulated time
def test_simulated_prefetch_overlap():
    # 4 stages, each 1 s of transfer (bandwidth 1 B/s, 1 B) and 1 s of compute
    work = [(1.0, 1.0, 0.0)] * 4
    serial = simulate_step(work, depth=0, bandwidth=1.0)
    assert serial.total_s == pytest.approx(8.0) and serial.weight_wait_s == pytest.approx(4.0)
    overlapped = simulate_step(work, depth=1, bandwidth=1.0)
    # only the first transfer is exposed once the next one streams during compute
    assert overlapped.total_s == pytest.approx(5.0)
    assert overlapped.exposed_streaming_s == pytest.approx(1.0)
    free = simulate_step(work, depth=1, bandwidth=None)
    assert free.exposed_streaming_s == 0.0 and free.total_s == pytest.approx(4.0)
    # gradients: 3 s out per stage, two slots: compute waits for the slot, then it drains
    grads = simulate_step([(0.0, 1.0, 3.0)] * 3, depth=0, bandwidth=1.0, gradient_slots=2)
    assert grads.total_s == pytest.approx(10.0)  # transfers end at 4, 7, 10
    assert grads.gradient_wait_s == pytest.approx(2.0)  # third stage waits from 2 to 4
    assert grads.drain_s == pytest.approx(5.0) and grads.gradients_out_bytes == 9.0


# ------------------------------------------------------------------------- exact norm
def test_lane_sums_rebuild_sum_of_squares_bitwise():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(16 * 997) * 10.0 ** rng.integers(-4, 4, 16 * 997)).astype(np.float32)
    for cuts in ([], [5, 1000, 1001, 7777], list(range(3, x.size, 613))):
        acc = np.zeros(LANES)
        edges = [0, *cuts, x.size]
        for a, b in zip(edges, edges[1:], strict=False):
            lane_sum_of_squares(x[a:b], a % LANES, acc)
        assert combine_lanes(acc) == sum_of_squares(x)


# ------------------------------------------------------------------------- stages
def test_stage_by_stage_with_separate_weight_copies_matches_forward_backward():
    """The executor's view of the model: each stage gets its own copy of its weights (as a
    window slot would hold them) and writes gradients through a sink."""
    model = GPT2(TINY_CFG)
    layout = Layout(model.parameter_specs(), 1)
    flat = np.zeros(layout.padded, np.float32)
    model.init_parameters(layout.views(flat), np.random.default_rng(3))
    model.allocate(2)
    rng = np.random.default_rng(4)
    x = rng.integers(0, 64, (2, 16)).astype(np.int32)
    y = rng.integers(0, 64, (2, 16)).astype(np.int32)
    g_ref = np.zeros_like(flat)
    loss_ref = model.forward(layout.views(flat), x, y)
    model.backward(layout.views(flat), GradientViews(layout.views(g_ref)), 0.5)
    pv = layout.views(flat)
    g = np.zeros_like(flat)
    gv = GradientViews(layout.views(g))
    stages = model.stages()
    model.begin(x, y)
    for k, st in enumerate(stages):
        loss = model.forward_stage(k, {n: pv[n].copy() for n in st.forward_params})
    for k in range(len(stages) - 1, -1, -1):
        model.backward_stage(k, {n: pv[n].copy() for n in stages[k].backward_params}, gv, 0.5)
    assert loss == loss_ref and np.array_equal(g, g_ref)


# ------------------------------------------------------------------------- MPI runs
TINY = [
    "--params",
    "gpt2_mini",
    "--model.n_layer=2",
    "--model.n_embd=64",
    "--model.n_head=2",
    "--model.block_size=32",
    "--train_input.batch_size=2",
    "--eval_input.batch_size=64",
    "--runconfig.save_summary_steps=3",
    "--runconfig.save_checkpoints_steps=3",
    "--runconfig.keep_checkpoint_max=2",
    "--runconfig.progress_bar=false",
    "--optimizer.max_gradient_norm=1.0",  # clipping active: the norm must match too
]
STREAM = ["-m", "simdist.train", "--execution_mode", "weight_streaming"]
PIPELINED = ["-m", "simdist.train"]


def run(np_: int, entry: list[str], model_dir: Path, *args: str, timeout: int = 240):
    out = run_mpi(np_, [*entry, *TINY, f"--runconfig.model_dir={model_dir}", *args], timeout)
    assert out.returncode == 0, out.stdout
    return out.stdout


def state(path: Path) -> dict[str, np.ndarray]:
    """Parameters and the full optimizer state of one checkpoint, shards merged."""
    from simdist.checkpoint import consolidate

    merged = consolidate(path, path.parent / f"merged-{path.stem}.h5")
    with h5py.File(merged) as f:
        out = {f"model/{k}": f["model"][k][...] for k in f["model"]}
        for s in f["optimizer"]:
            out.update({f"{s}/{k}": f["optimizer"][s][k][...] for k in f["optimizer"][s]})
    merged.unlink()
    return out


def assert_same_bits(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[0]}"


def test_weight_streaming_is_bitwise_data_parallel_and_checkpoints_cross_modes(tmp_path):
    """Pipelined DP on 2 ranks for 6 steps is the reference (clipping on, eval at the end).
    Weight streaming with 2 servers + 2 devices (prefetch depth 2) matches its step-3
    checkpoint bit for bit; pipelined DP resumed from that streamed checkpoint and weight
    streaming with 1 server resumed from DP's step-3 checkpoint both end at its step 6,
    bit for bit, and evaluate to the same numbers."""
    dp = tmp_path / "dp"
    log = run(2, PIPELINED, dp, "--runconfig.max_steps=6")
    ref3, ref6 = state(dp / "checkpoint_3.h5"), state(dp / "checkpoint_6.h5")
    ref_eval = json.loads((dp / "eval.json").read_text())

    ws = tmp_path / "ws2"
    out = run(
        4, STREAM, ws, "--weight_servers=2", "--runconfig.prefetch_depth=2",
        "--runconfig.max_steps=3", "--runconfig.mode=train",
    )  # fmt: skip
    assert "2 weight server(s) + 2 device(s)" in out
    assert_same_bits(state(ws / "checkpoint_3.h5"), ref3, "2 servers vs DP, step 3")
    losses = [ln for ln in log.splitlines() if ln.startswith("global_step = 3,")]
    assert losses and losses[0] in out  # the logged loss and norm, to every digit
    perf = json.loads((ws / "performance.json").read_text())
    sent, analysis = perf["streamed_bytes_per_step"], perf["streamed_bytes_analysis"]
    assert sent["weights_in"] == analysis["weights_in"]
    assert sent["gradients_out"] == analysis["gradients_out"] == perf["parameter_bytes"]

    # streamed checkpoint -> pipelined
    out = run(2, PIPELINED, ws, "--runconfig.max_steps=6")
    assert_same_bits(state(ws / "checkpoint_6.h5"), ref6, "WS step 3 -> DP step 6")
    assert json.loads((ws / "eval.json").read_text()) == ref_eval

    # pipelined checkpoint -> streamed (1 server)
    ws1 = tmp_path / "ws1"
    out = run(
        3, STREAM, ws1, "--weight_servers=1", "--runconfig.max_steps=6",
        f"--runconfig.checkpoint_path={dp / 'checkpoint_3.h5'}",
    )  # fmt: skip
    assert "written in pipelined mode" in out
    assert_same_bits(state(ws1 / "checkpoint_6.h5"), ref6, "DP step 3 -> WS 1 server step 6")
    assert json.loads((ws1 / "eval.json").read_text()) == ref_eval


def test_fc_mnist_streams_its_layers_bitwise_as_data_parallel(tmp_path):
    """FC-MNIST is a model of stages too (one per layer, as ZeRO-3 gathers them): streamed
    through 1 server to 2 devices it trains to the bits of 2-rank data parallelism."""
    args = ["--params=fc_mnist", "--model.hidden_sizes=[64, 32]", "--runconfig.mode=train",
            "--runconfig.max_steps=4", "--runconfig.save_checkpoints_steps=4",
            "--runconfig.progress_bar=false", "--optimizer.max_gradient_norm=1.0"]  # fmt: skip
    dp, ws = tmp_path / "dp", tmp_path / "ws"
    out = run_mpi(2, [*PIPELINED, *args, f"--runconfig.model_dir={dp}"], 180)
    assert out.returncode == 0, out.stdout
    out = run_mpi(3, [*STREAM, *args, f"--runconfig.model_dir={ws}"], 180)
    assert out.returncode == 0, out.stdout
    assert "1 weight server(s) + 2 device(s)" in out.stdout
    assert_same_bits(state(ws / "checkpoint_4.h5"), state(dp / "checkpoint_4.h5"), "FC WS vs DP")


DEMO = ["--params", "gpt2_streaming", "--runconfig.progress_bar=false"]


def test_demo_model_fails_pipelined_and_trains_streamed(tmp_path):
    """gpt2_streaming on tiny-ws: parameters >= 4x the device; pipelined is a simulated
    OOM whose hint names weight streaming; streamed, the device's accounted peak stays
    within its memory, as device_footprint predicted."""
    from simdist.device import load_profile
    from simdist.models import build_model

    cap = load_profile("tiny-ws").memory_bytes
    d = tmp_path / "pipelined"
    out = run_mpi(
        2,
        ["-m", "simdist.train", *DEMO, "--execution_mode=pipelined", f"--model_dir={d}"],
        120,
    )
    assert out.returncode == 2, out.stdout
    assert "simulated out of memory on tiny-ws" in out.stdout
    assert "execution_mode=weight_streaming would fit" in out.stdout
    assert not d.exists()

    d = tmp_path / "streamed"
    cmd = ["-m", "simdist.train", *DEMO, "--runconfig.max_steps=3", f"--model_dir={d}"]
    out = run_mpi(3, cmd, 240)
    assert out.returncode == 0, out.stdout
    perf = json.loads((d / "performance.json").read_text())
    assert perf["parameter_bytes"] >= 4 * cap
    assert perf["device_capacity_bytes"] == cap
    from simdist.config import load_params

    model = build_model(load_params(DEMO).model)
    predicted = sum(device_footprint(model, 2, 1, 1).values())
    assert perf["device_peak_bytes"] == predicted <= cap
    assert perf["exposed_streaming_time_s"] > 0
    assert perf["simulated_step_time_s"] >= perf["simulated_compute_s_per_step"]
    # the documented simulated-device fields, as data parallelism's, from the same step
    assert_simulated_fields(perf, out.stdout, {"compute", "exposed_comm"})
    assert perf["est_step_time_s"] == perf["simulated_step_time_s"]
    parts = perf["est_step_time_breakdown_s"]
    assert parts["compute"] == perf["simulated_compute_s_per_step"]
    assert parts["exposed_comm"] == pytest.approx(perf["exposed_streaming_time_s"], rel=1e-12)
    assert perf["device_memory_peak_bytes"]["total"] == perf["device_peak_bytes"]
    assert perf["device_memory_capacity_bytes"] == cap
    # timeline.json: the same replay as events, per device (2 here), 3 steps (trace_steps)
    from simdist.device import validate_chrome_trace

    trace = json.loads((d / "timeline.json").read_text())
    validate_chrome_trace(trace)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    mine = [e for e in spans if e["pid"] == 0]
    assert {e["args"]["step"] for e in mine} == {0, 1, 2}
    first = [e for e in mine if e["args"]["step"] == 0]
    compute = sorted((e["ts"], e["dur"]) for e in first if e["tid"] == 2)
    # each stage forward and backward per micro-batch, one after another
    assert len(compute) == 2 * len(model.stages()) * perf["grad_accum_steps"]
    assert all(
        a + da <= b * (1 + 1e-12) for (a, da), (b, _) in zip(compute[:-1], compute[1:], strict=True)
    )
    us = 1e6 * perf["simulated_compute_s_per_step"]
    assert sum(dur for _, dur in compute) == pytest.approx(us, rel=1e-9)
    end = max(e["ts"] + e["dur"] for e in first)  # the last gradient out: the step's end
    assert end == pytest.approx(1e6 * perf["simulated_step_time_s"], rel=1e-9)
    assert any(e["tid"] == 3 and e["name"].startswith("weights ") for e in first)
    assert any(e["tid"] == 3 and e["name"].startswith("gradients ") for e in first)
    shutil.rmtree(d)


@pytest.mark.parametrize("accum", [1, 2])
def test_plan_predicts_the_streamed_runs_simulated_step(tmp_path, accum):
    """``python -m simdist.plan --execution weight_streaming`` on gpt2-mini's shapes and a
    run of gpt2_mini on 2 devices + 1 server replay the same step through
    ``simdist.sim.streaming_step.device_step``: equal to float round-off; the device memory
    is the same footprint (the run also holds its input batch)."""
    from simdist.plan import plan

    d = tmp_path / "run"
    cmd = [
        *STREAM,
        "--params=gpt2_mini",
        "--train_input.batch_size=2",
        f"--optimizer.grad_accum_steps={accum}",
        "--profile=a100-80gb",
        "--runconfig.mode=train",
        "--runconfig.max_steps=2",
        "--runconfig.save_checkpoints_steps=0",
        "--runconfig.progress_bar=false",
        f"--runconfig.model_dir={d}",
    ]
    out = run_mpi(3, cmd, 300)
    assert out.returncode == 0, out.stdout
    p = json.loads((d / "performance.json").read_text())
    r = plan(model="gpt2-mini", devices=2, profile="a100-80gb", precision="fp32",
             execution="weight_streaming", batch=2 * accum, micro_batch=2)  # fmt: skip
    assert any("weight-streaming step" in n for n in r.notes), r.notes
    assert r.step_s == pytest.approx(p["simulated_step_time_s"], rel=1e-9)
    assert r.breakdown_s["compute"] == pytest.approx(p["simulated_compute_s_per_step"], rel=1e-9)
    assert r.breakdown_s["exposed_weight_wait"] == pytest.approx(
        p["exposed_weight_wait_s"], rel=1e-9, abs=1e-15
    )
    assert p["exposed_streaming_time_s"] > 0  # the link is really in both
    peak = p["device_memory"][0]["peak_bytes"]
    for cat in ("streaming_window", "workspace", "parameters", "gradients"):
        assert r.memory_bytes[cat] == peak[cat], cat
    assert 0 <= peak["activations"] - r.memory_bytes["activations"] <= 2 * 4096
