"""Pipeline parallelism (``runconfig.pipeline_parallel``): the schedules' order, then runs
under mpiexec that must equal one rank accumulating the same micro-batches bit for bit
(parameters, optimizer state, loss lines, eval.json), DP x PP equal to data parallelism,
resume and a checkpoint taken up at another P, and the errors for what cannot run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from model_runs import assert_same_state
from mpi_launch import run_mpi
from perf_fields import assert_simulated_fields
from test_train import final_state

from simdist.schedules.pipeline import (
    predicted_bubble,
    schedule_ops,
    simulate_pipeline,
    slots_needed,
    split_stages,
)

FC = [
    "--model.hidden_sizes=[64, 32, 32]",  # 4 layers: up to 4 stages
    "--runconfig.save_summary_steps=1",
    "--runconfig.progress_bar=false",
    "--eval_input.batch_size=100",
    "--optimizer.grad_accum_steps=4",
    "--train_input.batch_size=8",
    "--optimizer.max_gradient_norm=0.5",
    "--optimizer.weight_decay=0.01",
]
GPT2 = [
    "--params=gpt2_mini",
    "--runconfig.save_summary_steps=1",
    "--runconfig.progress_bar=false",
    "--optimizer.grad_accum_steps=4",
    "--train_input.batch_size=1",
    "--eval_input.batch_size=16",
    "--runconfig.eval_steps=2",  # 32 held-out sequences a replica: the bits, not the figure
]


def train(n: int, d: Path, base: list[str], *args: str, ok: bool = True):
    out = run_mpi(n, ["-m", "simdist.train", *base, f"--runconfig.model_dir={d}", *args], 300)
    if ok:
        assert out.returncode == 0, out.stdout
    return out


def losses(stdout: str) -> list[str]:
    return re.findall(r"global_step = \d+, loss = \S+", stdout)


def run_record(out, d: Path) -> tuple:
    return losses(out.stdout), final_state(d), (d / "eval.json").read_text()


def assert_same_run(a: tuple, b: tuple, what: str) -> None:
    assert a[0] and a[0] == b[0], f"{what}: loss lines"
    assert_same_state(a[1], b[1], what)
    assert a[2] == b[2], f"{what}: eval.json"


# ----------------------------------------------------------------------------- serial
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_schedules_run_every_micro_batch_once_in_a_valid_order(P, m):
    for kind in ("1f1b", "gpipe"):
        for s in range(P):
            ops = schedule_ops(kind, P, s, m)
            assert sorted(ops) == sorted(
                [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
            )
            assert [j for op, j in ops if op == "B"] == list(range(m))  # accumulation order
            in_flight, most = set(), 0
            for op, j in ops:
                if op == "F":
                    in_flight.add(j)
                else:
                    assert j in in_flight  # a backward follows its own forward
                    in_flight.remove(j)
                most = max(most, len(in_flight))
            assert most == slots_needed(kind, P, s, m)
    assert schedule_ops("1f1b", 4, 0, 8)[:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert predicted_bubble(4, 12) == 3 / 15


def test_simulated_pipeline_has_the_textbook_bubble_with_equal_stages():
    for kind in ("1f1b", "gpipe"):
        for P, m in ((2, 8), (4, 16), (4, 3)):
            span, busy = simulate_pipeline(kind, [1.0] * P, [2.0] * P, m, [0.0] * (P - 1))
            assert span == (m + P - 1) * 3.0
            assert 1 - sum(busy) / (P * span) == pytest.approx(predicted_bubble(P, m))
    # 1F1B at P = 2 has no slack to hide a send: each micro-batch's round trip (0.5 s each
    # way) shows, 4 x (1 + 2 + 2 x 0.5) + 1 (the last forward), worked out by hand
    span, _ = simulate_pipeline("1f1b", [1.0, 1.0], [2.0, 2.0], 4, [0.5])
    assert span == 17.0
    # a slow last stage sets the pace: its 4 x 6 s, plus stage 0's first forward and last
    # backward
    span, _ = simulate_pipeline("1f1b", [1.0, 2.0], [2.0, 4.0], 4, [0.0])
    assert span == 1.0 + 4 * 6.0 + 2.0


def test_stages_are_split_contiguously_by_their_sizes():
    assert split_stages([1, 5, 5, 5, 5, 1], 4) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert split_stages([3, 3, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_stages([10, 1, 1, 1], 2) == [(0, 1), (1, 4)]


# ----------------------------------------------------------------------------- runs
def test_fc_mnist_pipeline_equals_one_rank_with_accumulation(tmp_path):
    """P = 2 and 4, 1F1B and GPipe: the bits of one rank running the 4 micro-batches."""
    steps = ["--runconfig.max_steps=6"]
    ref = run_record(train(1, tmp_path / "np1", FC, *steps), tmp_path / "np1")
    for n, kind in ((2, "1f1b"), (4, "1f1b"), (4, "gpipe")):
        d = tmp_path / f"pp{n}{kind}"
        out = train(n, d, FC, *steps, f"--pipeline-parallel={n}", f"--pipeline-schedule={kind}")
        assert f"1 replica(s) x {n} stages" in out.stdout and f"schedule {kind}" in out.stdout
        assert_same_run(ref, run_record(out, d), f"PP{n} {kind}")
    perf = json.loads((tmp_path / "pp4gpipe" / "performance.json").read_text())
    assert perf["pipeline_parallel"] == 4 and perf["pipeline_schedule"] == "gpipe"
    assert perf["predicted_bubble_fraction"] == 3 / 7
    assert 0.0 <= perf["bubble_fraction"] <= 1.0
    assert perf["est_forward_backward_s"] > 0 and 0 < perf["est_bubble_fraction"] < 1
    assert [s["model_stages"] for s in perf["pipeline_split"]] == [[f"fc{i}"] for i in range(1, 5)]
    # per rank: its flat range of parameters, gradients (+ micro-batch scratch) and AdamW's
    # two moments, 4 bytes an element; one activation arena per micro-batch in flight
    for split, mem in zip(perf["pipeline_split"], perf["memory_bytes_per_rank"], strict=True):
        lo, hi = split["flat_range"]
        assert mem["parameters"] == 4 * (hi - lo)
        assert mem["gradients"] == 2 * 4 * (hi - lo)
        assert mem["optimizer_state"] == 2 * 4 * (hi - lo)
    arenas = [m["activations"] for m in perf["memory_bytes_per_rank"]]
    assert len(set(arenas)) == 1  # GPipe: all 4 micro-batches on every stage


def test_gpt2_mini_pipeline_equals_one_rank_tied_embedding(tmp_path):
    """The LM head (last stage) and the embedding (first stage) share wte: still the bits
    of one rank, at P = 2 (1F1B) and P = 4 (GPipe)."""
    steps = ["--runconfig.max_steps=2"]
    ref = run_record(train(1, tmp_path / "np1", GPT2, *steps), tmp_path / "np1")
    for n, kind in ((2, "1f1b"), (4, "gpipe")):
        d = tmp_path / f"pp{n}"
        out = train(n, d, GPT2, *steps, f"--pipeline-parallel={n}", f"--pipeline-schedule={kind}")
        assert "stage 0: embed h.0" in out.stdout and "head (" in out.stdout
        assert_same_run(ref, run_record(out, d), f"gpt2 PP{n}")


def test_dp2_x_pp2_equals_data_parallel_at_2_ranks(tmp_path):
    """ZeRO 0 and 1 on the data-parallel axis (data parallelism's levels agree bitwise)."""
    steps = ["--runconfig.max_steps=6"]
    ref = run_record(train(2, tmp_path / "dp2", FC, *steps), tmp_path / "dp2")
    for zero in (0, 1):
        d = tmp_path / f"dp2pp2z{zero}"
        out = train(4, d, FC, *steps, "--pipeline-parallel=2", f"--zero_opt_level={zero}")
        assert "2 replica(s) x 2 stages" in out.stdout and f"ZeRO-{zero} on the" in out.stdout
        assert_same_run(ref, run_record(out, d), f"DP2 x PP2, ZeRO-{zero}")


def test_tp2_batch_mode_x_pp2_equals_data_parallel(tmp_path):
    """TP innermost (batch mode: the group's batch of 8 divided over its 2 ranks), then
    PP: rank (s T + t) is stage s of replica t; the bits of 2 data-parallel ranks with 4."""
    steps = ["--runconfig.max_steps=4"]
    ref = run_record(train(2, tmp_path / "dp2", FC, *steps, "-b", "4"), tmp_path / "dp2")
    d = tmp_path / "tp2pp2"
    out = train(4, d, FC, *steps, "-b", "8", "--pipeline-parallel=2", "--tensor-parallel=2")
    assert "groups of 2 ranks on one node: [0, 1] [2, 3]" in out.stdout
    assert_same_run(ref, run_record(out, d), "TP2 x PP2")


WEIGHT = ["--tensor-parallel=2", "--tensor-parallel-mode=weight"]


def test_tp2_weight_mode_x_pp2_equals_weight_mode_alone_and_resumes_its_checkpoint(tmp_path):
    """Weight mode on each stage: rank (s T + t) holds shard t of stage s (GPT2TP's stage
    functions, the group's collectives on the stage's two ranks). The same bits as TP 2
    alone with the same micro-batches: loss lines, whole-tensor checkpoint (parameters and
    Adam state), eval.json; in fp32 the pipeline at ZeRO-3 (one replica: its per-micro-batch
    sums are ZeRO-1's), and with sequence parallelism in bf16 at ZeRO-2 (the row shares,
    float32 sums of the micro-batches' half gradients, rounded before the group's half-wire
    all-reduce, so their bits do not depend on how each side packs them). The pipeline
    resumes TP 2's step-2 checkpoint (the degree and mode recorded) and ends where TP 2
    does."""
    steps = ["--runconfig.max_steps=4", "--runconfig.save_checkpoints_steps=2"]
    for name, extra, pp_zero in (
        ("fp32", ["--zero_opt_level=1"], ["--zero_opt_level=3"]),
        (
            "sp-bf16",
            [
                "--runconfig.sequence_parallel=true",
                "--runconfig.precision=bf16",
                "--zero_opt_level=2",
            ],
            [],
        ),
    ):
        ref = run_record(train(2, tmp_path / f"tp2-{name}", GPT2, *steps, *WEIGHT, *extra),
                         tmp_path / f"tp2-{name}")  # fmt: skip
        d = tmp_path / f"pp2tp2-{name}"
        out = train(4, d, GPT2, *steps, *WEIGHT, *extra, *pp_zero, "--pipeline-parallel=2")
        assert "tensor parallel (weight mode) innermost" in out.stdout, out.stdout
        assert "shard r % 2, replica r // 4" in out.stdout
        assert_same_run(ref, run_record(out, d), f"TP2 weight x PP2, {name}")
    d = tmp_path / "resumed"
    step2 = f"--runconfig.checkpoint_path={tmp_path / 'tp2-fp32' / 'checkpoint_2.h5'}"
    out = train(4, d, GPT2, *steps, *WEIGHT, "--zero_opt_level=1", "--pipeline-parallel=2", step2)
    assert "resumed from" in out.stdout
    assert_same_state(final_state(tmp_path / "tp2-fp32"), final_state(d), "resumed at PP2")


def test_dp2_x_pp2_zero2_equals_zero0_and_data_parallel_zero2(tmp_path):
    """ZeRO-2 on the data-parallel axis: each micro-batch's stage gradients reduce-scattered
    into the rank's slice after its backward. One micro-batch: the bits of ZeRO-0 (the same
    sums); four: the bits of data parallelism's ZeRO-2 at 2 ranks, which also reduces every
    micro-batch (so neither equals ZeRO-0 with accumulation: (a1 + b1) + (a2 + b2) is not
    (a1 + a2) + (b1 + b2) in floating point). Gradient memory: the slice, plus the stage
    range's micro-batch bucket."""
    steps = ["--runconfig.max_steps=4"]
    one = ["--optimizer.grad_accum_steps=1", "--train_input.batch_size=16"]
    runs = {}
    for zero in (0, 2):
        d = tmp_path / f"m1z{zero}"
        out = train(4, d, FC, *steps, *one, "--pipeline-parallel=2", f"--zero_opt_level={zero}")
        runs[zero] = run_record(out, d)
    assert_same_run(runs[0], runs[2], "DP2 x PP2 ZeRO-2 vs ZeRO-0, one micro-batch")
    ref = run_record(train(2, tmp_path / "dp2", FC, *steps, "--zero_opt_level=2"), tmp_path / "dp2")
    d = tmp_path / "z2"
    out = train(4, d, FC, *steps, "--pipeline-parallel=2", "--zero_opt_level=2")
    assert "ZeRO-2 on the" in out.stdout
    assert_same_run(ref, run_record(out, d), "DP2 x PP2 ZeRO-2 vs DP2 ZeRO-2")
    perf = json.loads((d / "performance.json").read_text())
    owned = [0, 0]
    for rank, mem in enumerate(perf["memory_bytes_per_rank"]):
        lo, hi = perf["pipeline_split"][rank % 2]["flat_range"]
        own = mem.get("optimizer_state", 0) // 8  # AdamW's two moments over the slice
        assert mem.get("gradients", 0) == 4 * own
        assert mem["buckets"] == 4 * (hi - lo)
        owned[rank % 2] += own
    # each stage's two replicas hold disjoint slices covering its range
    assert owned == [hi - lo for lo, hi in (x["flat_range"] for x in perf["pipeline_split"])]


def test_performance_json_has_the_simulated_fields_of_data_parallelism(tmp_path):
    """A pipeline run reports the simulated device as a data-parallel run does (throughput,
    step, compute / exposed communication / bubble / other, profile, peak memory, input
    bottleneck, the log line), from its own simulated step, with its phases beside them."""
    d = tmp_path / "run"
    out = train(2, d, FC, "--runconfig.max_steps=2", "--pipeline-parallel=2")
    perf = json.loads((d / "performance.json").read_text())
    assert_simulated_fields(perf, out.stdout, {"compute", "exposed_comm", "bubble", "other"})
    parts, phases = perf["est_step_time_breakdown_s"], perf["est_step_phases_s"]
    assert phases["other"] == parts["other"]  # both: the measured host time
    assert perf["est_step_time_s"] == pytest.approx(sum(phases.values()), rel=1e-9)
    assert perf["est_device_step_time_s"] + parts["other"] == perf["est_step_time_s"]
    # 4 micro-batches on 2 stages: the critical stage idles for part of the step
    assert parts["bubble"] > 0 and perf["est_breakdown_stage"] in (0, 1)
    assert len(perf["device_memory_rank0"]["peak_bytes"]) > 1


def test_timeline_has_every_micro_batch_on_each_stage_in_1f1b_order(tmp_path):
    """timeline.json of a pipeline run: one process per rank; its forward and backward of
    every micro-batch on the simulated compute track in the schedule's order, each
    activation (gradient) send and receive on the communication track, arriving before the
    op that reads it starts; the bytes the estimate sends per boundary are the run's."""
    from simdist.device import validate_chrome_trace
    from simdist.sim.pp_schedule import boundary_bytes

    d = tmp_path / "run"
    P, m = 3, 5
    out = train(3, d, FC, "--runconfig.max_steps=2", "--runconfig.trace_steps=2",
                f"--pipeline-parallel={P}", f"--optimizer.grad_accum_steps={m}")  # fmt: skip
    perf = json.loads((d / "performance.json").read_text())
    assert perf["timeline"] == "timeline.json" and perf["est_step_time_s"] > 0, out.stdout
    trace = json.loads((d / "timeline.json").read_text())
    validate_chrome_trace(trace)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(P))
    for s in range(P):
        mine = [e for e in events if e["pid"] == s and e["args"]["step"] == 1]
        ops = sorted(
            (e for e in mine if e["cat"] in ("forward", "backward")), key=lambda e: e["ts"]
        )
        assert [(e["name"][0], e["args"]["micro_batch"]) for e in ops] == schedule_ops(
            "1f1b", P, s, m
        )
        assert all(e["args"]["stage"] == s for e in ops)
        recvs = {e["name"].split(" <-")[0]: e for e in mine if e["cat"] == "recv"}
        sends = [e for e in mine if e["cat"] == "send"]
        assert len(recvs) == m * ((s > 0) + (s < P - 1))
        assert len(sends) == m * ((s > 0) + (s < P - 1))
        for e in ops:  # what an op reads arrived before it started
            j, fwd = e["args"]["micro_batch"], e["name"][0] == "F"
            if (fwd and s > 0) or (not fwd and s < P - 1):
                what = "activations" if fwd else "activation gradients"
                r = recvs[f"recv {what} {j}"]
                assert r["ts"] + r["dur"] <= e["ts"] + 1e-6
        assert any(e["name"] == "optimizer" for e in mine)
    # the estimate's message sizes are what the run sent
    model_sizes = [784, 64, 32, 32, 10]  # FC's layers; stage s is layer s (P = 3: see split)
    split = [x["model_stages"] for x in perf["pipeline_split"]]
    assert split == [["fc1"], ["fc2"], ["fc3", "fc4"]]

    class Shapes:
        sizes = model_sizes

    sent = perf["pipeline_bytes_sent_per_step"]
    fwd = [boundary_bytes(Shapes, k, 8)[0] for k in (1, 2)]
    bwd = [boundary_bytes(Shapes, k, 8)[1] for k in (1, 2)]
    assert sent == [m * fwd[0], m * (fwd[1] + bwd[0]), m * bwd[1]]


def test_dp2_x_tp2_x_pp2_at_8_ranks_equals_data_parallel_at_4(tmp_path):
    """World 8 = DP 2 x TP 2 (batch mode) x PP 2, oversubscribed: its 4 replicas per stage
    (2 groups x 2 batch shares) train to the bits of 4 data-parallel ranks with the shares'
    batch (the same samples on the same replicas, one collective algorithm for both)."""
    steps = ["--runconfig.max_steps=3", "--runconfig.collective_algorithm=ring"]
    ref = run_record(train(4, tmp_path / "dp4", FC, *steps, "-b", "4"), tmp_path / "dp4")
    d = tmp_path / "np8"
    out = train(8, d, FC, *steps, "-b", "8", "--pipeline-parallel=2", "--tensor-parallel=2")
    assert "4 replica(s) x 2 stages" in out.stdout, out.stdout
    assert "[0, 1] [2, 3] [4, 5] [6, 7]" in out.stdout
    assert_same_run(ref, run_record(out, d), "DP2 x TP2 x PP2 at np 8")


def test_bf16_pipeline_equals_one_rank_and_data_parallel_in_bf16(tmp_path):
    """Mixed precision (bf16) as data parallelism runs it: fp32 master weights in the
    optimizer state, half weights (the tied copy too), activations and gradients, stored
    half after accumulation and reduced in half. gpt2-mini at P = 2 (tied embedding): the
    bits of one rank in bf16; FC-MNIST DP 2 x PP 2 (ZeRO-1): the bits of 2 data-parallel
    ranks in bf16. Weights and gradients are accounted at 2 bytes, the master at 4."""
    bf16 = ["--runconfig.precision=bf16"]
    steps = ["--runconfig.max_steps=2", "--runconfig.mode=train"]  # eval: the FC runs below
    one = train(1, tmp_path / "np1", GPT2, *steps, *bf16)
    pp2 = train(2, tmp_path / "pp2", GPT2, *steps, *bf16, "--pipeline-parallel=2")
    assert losses(one.stdout) and losses(one.stdout) == losses(pp2.stdout)
    assert_same_state(final_state(tmp_path / "np1"), final_state(tmp_path / "pp2"), "gpt2 bf16")
    steps = ["--runconfig.max_steps=4"]
    ref = run_record(train(2, tmp_path / "dp2", FC, *steps, *bf16), tmp_path / "dp2")
    d = tmp_path / "dp2pp2"
    out = train(4, d, FC, *steps, *bf16, "--pipeline-parallel=2", "--zero_opt_level=1")
    assert_same_run(ref, run_record(out, d), "DP2 x PP2 ZeRO-1 bf16")
    perf = json.loads((d / "performance.json").read_text())
    assert perf["precision"] == "bf16"
    for rank, mem in enumerate(perf["memory_bytes_per_rank"]):
        lo, hi = perf["pipeline_split"][rank % 2]["flat_range"]
        assert mem["parameters"] == 2 * (hi - lo)
        assert mem["gradients"] == 2 * 2 * (hi - lo)  # the step's and a micro-batch's
        own = mem.get("optimizer_state", 0) // 12  # AdamW's moments and the master
        assert 0 <= own <= hi - lo and mem.get("optimizer_state", 0) == 12 * own


def test_resume_is_bit_identical_and_loads_at_another_p(tmp_path):
    """6 steps straight vs 3 + 3 resumed at P = 2; the step-3 checkpoint (full parameters,
    optimizer state in per-stage flat ranges) continues at P = 4 and on one rank alike."""
    ck = ["--runconfig.save_checkpoints_steps=3", "--runconfig.mode=train"]
    train(2, tmp_path / "full", FC, *ck, "--runconfig.max_steps=6", "--pipeline-parallel=2")
    train(2, tmp_path / "res", FC, *ck, "--runconfig.max_steps=3", "--pipeline-parallel=2")
    out = train(2, tmp_path / "res", FC, *ck, "--runconfig.max_steps=6", "--pipeline-parallel=2")
    assert "resumed from" in out.stdout
    full = final_state(tmp_path / "full")
    assert_same_state(full, final_state(tmp_path / "res"), "resumed")
    step3 = f"--runconfig.checkpoint_path={tmp_path / 'res' / 'checkpoint_3.h5'}"
    for n, pp in ((4, ["--pipeline-parallel=4"]), (1, [])):
        d = tmp_path / f"at{n}"
        train(n, d, FC, *ck, "--runconfig.max_steps=6", step3, *pp)
        assert_same_state(full, final_state(d), f"resumed at {n} rank(s)")


def test_non_finite_input_stops_every_stage_at_the_same_step(tmp_path):
    """A NaN in stage 0's batch reaches the last stage's loss and every stage's norm: the
    agreement stops all ranks with exit 3 before the update, the last checkpoint intact."""
    from test_faults import latest_step
    from test_faults import train as train_with_fault

    from simdist.faults import EXIT_NONFINITE

    d = tmp_path / "run"
    rc, out = train_with_fault(
        2, d, "--runconfig.max_steps=100", "--runconfig.save_checkpoints_steps=2",
        "--pipeline-parallel=2", "--optimizer.grad_accum_steps=2",
        fault="nan:rank=0:step=5:value=nan",
    )  # fmt: skip
    assert rc == EXIT_NONFINITE, out
    assert "non-finite loss or gradients in step 5" in out
    assert latest_step(d) == 4


@pytest.mark.parametrize(
    ("n", "args", "message"),
    [
        (3, ["--pipeline-parallel=2"], "pipeline_parallel=2 must divide the 3 ranks"),
        (4, ["--pipeline-parallel=4", "--model.hidden_sizes=[64]"], "exceeds the 2 stages"),
        (
            2,
            ["--pipeline-parallel=2", "--tensor-parallel=2", "-b", "8"],
            "pipeline_parallel=2 x runconfig.tensor_parallel=2 must divide the 2 ranks",
        ),
        (2, ["--pipeline-parallel=2", "--params=t5_mini"], "cannot be pipelined"),
        (
            2,
            ["--pipeline-parallel=2", "--input_workers_per_replica=1"],
            "without input workers (every stage reads its micro-batches itself), not "
            "runconfig.input_workers_per_replica=1; set it to 0",
        ),
        (
            2,
            ["--pipeline-parallel=2", "--execution_mode=weight_streaming"],
            "applies to pipelined execution, not execution_mode=weight_streaming",
        ),
        (
            4,
            ["--pipeline-parallel=2", "--runconfig.collective_algorithm=shm"],
            "the stage groups sync their gradients with auto",
        ),
    ],
)
def test_bad_pipeline_input_exits_2_naming_the_key(tmp_path, n, args, message):
    d = tmp_path / "run"
    base = ["--runconfig.progress_bar=false"]
    out = train(n, d, base, "--runconfig.max_steps=2", *args, ok=False)
    assert out.returncode == 2, out.stdout
    assert message in out.stdout, out.stdout
    assert "runconfig.pipeline_parallel" in out.stdout
    assert not d.exists()
