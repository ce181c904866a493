"""ZeRO-3 on a pipeline's data-parallel axis (``runconfig.pipeline_parallel`` with
``zero_opt_level: 3``): each stage rank keeps its slice of the stage's range and gathers a
model stage's parameters into a window before its forward and backward.

Runs under mpiexec at D 2 x P 2 (np 4): the bits of ZeRO 0, 1 and 2 pipelines (one
micro-batch: all four levels sum the same; four: ZeRO-2, which like ZeRO-3 reduces every
micro-batch), fp32 and bf16, FC-MNIST and gpt2-mini (tied embedding); resume bit-exact and
at another ZeRO level and data-parallel size; memory by category as the formula; the
gathers counted by the run, the simulated step and its trace alike; plan == run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_runs import assert_same_state
from test_pipeline import FC, GPT2, losses, run_record, train
from test_train import final_state

from simdist.arena import Layout
from simdist.model_config import FCMNISTConfig
from simdist.models.fc_mnist import FCMNIST
from simdist.param_gather import GatherPlan

PP2 = ["--pipeline-parallel=2"]
ONE_MICRO = ["--optimizer.grad_accum_steps=1", "--train_input.batch_size=32"]


def zero_runs(tmp_path: Path, base: list[str], levels, *args: str) -> dict[int, tuple]:
    out = {}
    for z in levels:
        d = tmp_path / f"z{z}"
        r = train(4, d, base, *args, *PP2, f"--zero_opt_level={z}")
        assert "2 replica(s) x 2 stages" in r.stdout and f"ZeRO-{z} on the" in r.stdout
        evals = "--runconfig.mode=train" not in args
        out[z] = run_record(r, d) if evals else (losses(r.stdout), final_state(d), "")
    return out


def assert_same(a: tuple, b: tuple, what: str) -> None:
    assert a[0] and a[0] == b[0], f"{what}: loss lines"
    assert_same_state(a[1], b[1], what)
    assert a[2] == b[2], f"{what}: eval.json"  # "" for both where no eval ran


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fc_mnist_zero3_equals_zero_0_1_2(tmp_path, precision):
    """One micro-batch: ZeRO 0-3 all train to the same bits (losses, parameters, optimizer
    state, eval.json after 4 steps); four micro-batches: ZeRO-3 those of ZeRO-2."""
    args = ["--runconfig.max_steps=4", f"--runconfig.precision={precision}"]
    runs = zero_runs(tmp_path / "m1", FC, (0, 1, 2, 3), *args, *ONE_MICRO)
    for z in (0, 1, 2):
        assert_same(runs[3], runs[z], f"fc {precision} m1: ZeRO-3 vs ZeRO-{z}")
    runs = zero_runs(tmp_path / "m4", FC, (2, 3), *args)
    assert_same(runs[3], runs[2], f"fc {precision} m4: ZeRO-3 vs ZeRO-2")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt2_mini_zero3_equals_zero_0_1_2_tied_embedding(tmp_path, precision):
    """gpt2-mini: stage 0 owns wte, the last stage's head reads it again from its slice of
    the tied group, gathered over its own stage group: the bits of ZeRO 0-2 (3 steps, one
    micro-batch of 4), and of ZeRO-2 with 4 micro-batches."""
    args = ["--runconfig.max_steps=3", "--runconfig.mode=train"]
    args.append(f"--runconfig.precision={precision}")
    one = ["--optimizer.grad_accum_steps=1", "--train_input.batch_size=4"]
    runs = zero_runs(tmp_path / "m1", GPT2, (0, 1, 2, 3), *args, *one)
    for z in (0, 1, 2):
        assert_same(runs[3], runs[z], f"gpt2 {precision} m1: ZeRO-3 vs ZeRO-{z}")
    runs = zero_runs(tmp_path / "m4", GPT2, (2, 3), *args)
    assert_same(runs[3], runs[2], f"gpt2 {precision} m4: ZeRO-3 vs ZeRO-2")


def test_zero3_resume_is_bit_exact_and_continues_at_another_level_and_size(tmp_path):
    """6 steps straight vs 3 + 3 resumed, at ZeRO-3 (optimizer state in one shard per rank,
    parameters gathered from the slices). The step-3 checkpoint continues at ZeRO-2 with the
    straight run's bits (ZeRO-2 and 3 train alike), and at D 1 x P 2 (np 2, ZeRO-0) and
    D 4 x P 1 (plain data parallelism, ZeRO-3) as its consolidated export does."""
    from simdist.checkpoint import consolidate

    ck = ["--runconfig.save_checkpoints_steps=3", "--runconfig.mode=train"]
    z3 = [*PP2, "--zero_opt_level=3"]
    train(4, tmp_path / "full", FC, *ck, *z3, "--runconfig.max_steps=6")
    train(4, tmp_path / "res", FC, *ck, *z3, "--runconfig.max_steps=3")
    shards = sorted(p.name for p in (tmp_path / "res").glob("checkpoint_3.optim-*"))
    assert shards == [f"checkpoint_3.optim-{r}-of-4.h5" for r in range(4)]
    step3 = tmp_path / "res" / "checkpoint_3.h5"
    out = train(4, tmp_path / "res", FC, *ck, *z3, "--runconfig.max_steps=6")
    assert "resumed from" in out.stdout and "world size 2, ZeRO-3" in out.stdout
    full = final_state(tmp_path / "full")
    assert_same_state(full, final_state(tmp_path / "res"), "ZeRO-3 resumed")
    d = tmp_path / "at_z2"
    train(4, d, FC, *ck, *PP2, "--zero_opt_level=2", "--runconfig.max_steps=6",
          f"--runconfig.checkpoint_path={step3}")  # fmt: skip
    assert_same_state(full, final_state(d), "ZeRO-3 checkpoint resumed at ZeRO-2")
    cons = consolidate(step3, tmp_path / "consolidated.h5")
    for n, extra in ((2, [*PP2, "--zero_opt_level=0"]), (4, ["--zero_opt_level=3"])):
        a, b = tmp_path / f"np{n}", tmp_path / f"np{n}cons"
        for where, path in ((a, step3), (b, cons)):
            train(n, where, FC, *ck, *extra, "--runconfig.max_steps=5",
                  f"--runconfig.checkpoint_path={path}")  # fmt: skip
        assert_same_state(final_state(a), final_state(b), f"resumed at np {n} {extra}")


def test_memory_gathers_trace_and_plan_of_a_zero3_pipeline(tmp_path):
    """FC-MNIST 784-64-32-32-10 (fc1 on stage 0; fc2, fc3, fc4 on stage 1), D 2 x P 2, 1F1B,
    4 micro-batches. Memory per rank: parameters its slice of the stage range (cut at the
    data-parallel slice boundaries, as ZeRO-1/2 cut it for the optimizer) plus two windows
    of the stage's largest gathered group; gradients the slice, the bucket the stage range,
    AdamW's two moments over the slice. The run's gathers per step, the simulated step's
    and the trace's agree, and are the window cache's (worked out in the comments below).
    Plan mode predicts the run's device step (rel 1e-9) and its largest rank's memory."""
    from simdist.device import validate_chrome_trace
    from simdist.plan import plan

    d = tmp_path / "run"
    out = train(4, d, FC, "--profile=a100-80gb", "--runconfig.collective_algorithm=ring",
                "--runconfig.mode=train", "--runconfig.max_steps=3", "--runconfig.trace_steps=2",
                "--runconfig.save_checkpoints_steps=0", *PP2, "--zero_opt_level=3")  # fmt: skip
    assert "its slice [" in out.stdout
    p = json.loads((d / "performance.json").read_text())
    assert [s["model_stages"] for s in p["pipeline_split"]] == [["fc1"], ["fc2", "fc3", "fc4"]]
    model = FCMNIST(FCMNISTConfig("fc_mnist", [64, 32, 32], 784, 10))
    layout = Layout(model.parameter_specs(), 2)
    stages, groups = model.stages(), model.gradient_groups()
    windows = [GatherPlan(layout, stages[:1], groups).window]
    windows.append(GatherPlan(layout, stages[1:], groups).window)
    assert windows == [784 * 64 + 64, 64 * 32 + 32]  # fc1; fc2, the largest of stage 1's
    owned = [0, 0]
    for rank, mem in enumerate(p["memory_bytes_per_rank"]):
        s, dd = rank % 2, rank // 2
        lo, hi = p["pipeline_split"][s]["flat_range"]
        own = max(0, int(min(hi, layout.bounds[dd + 1]) - max(lo, layout.bounds[dd])))
        owned[s] += own
        assert mem.get("parameters", 0) == 4 * (own + 2 * windows[s]), rank
        assert mem.get("gradients", 0) == 4 * own, rank
        assert mem.get("optimizer_state", 0) == 8 * own, rank
        assert mem["buckets"] == 4 * (hi - lo), rank
    # each stage's replicas hold disjoint slices covering its range
    assert owned == [hi - lo for lo, hi in (x["flat_range"] for x in p["pipeline_split"])]
    # gathers per step. Stage 0: fc1 once (its backward reads no weights: it stays in its
    # window). Stage 1 (F0 B0 F1 B1 ...): F0 gathers fc2 and prefetches fc3, fc3 prefetches
    # fc4 over fc2, B0's fc3 prefetches fc2 over fc4: 4; every later micro-batch: fc4
    # (forward) and fc2 (backward) again: 4 + 3 x 2
    assert p["est_param_gathers_per_step"] == [1, 10]
    assert p["param_gathers_per_step_per_rank"] == [1, 10, 1, 10]
    assert all(t > 0 for t in p["est_param_gather_s"])
    trace = json.loads((d / "timeline.json").read_text())
    validate_chrome_trace(trace)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        got = [e for e in events if e["pid"] == rank and e["name"] == "params.allgather"]
        assert len(got) == 2 * [1, 10][rank % 2], rank  # two traced steps
        assert all(e["args"]["phase"] in ("forward", "backward") for e in got)
        # each sits between its op's compute on the stage, never overlapping it
        compute = [e for e in events if e["pid"] == rank and e["cat"] in ("forward", "backward")]
        for g in got:
            assert not any(
                c["ts"] < g["ts"] + g["dur"] - 1e-6 and g["ts"] < c["ts"] + c["dur"] - 1e-6
                for c in compute
            )
    r = plan(
        model="fc-mnist", devices=4, profile="a100-80gb", zero=3, pp=2, batch=32,
        micro_batch=8, precision="fp32", optimizer="adam", algorithm="ring",
        model_overrides={"sizes": [784, 64, 32, 32, 10]},
    )  # fmt: skip
    assert any("simdist's own pipeline step" in x for x in r.notes), r.notes
    assert r.step_s == pytest.approx(p["est_device_step_time_s"], rel=1e-9)
    for key, value in p["est_step_phases_s"].items():
        if key != "other":  # the run's measured host time
            assert r.breakdown_s[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key
    largest = max(p["memory_bytes_per_rank"], key=lambda x: sum(x.values()))
    assert {k: v for k, v in r.memory_bytes.items() if v} == largest


def test_fp16_zero3_overflow_skips_as_zero2(tmp_path):
    """fp16 with loss scaling at D 2 x P 2: the gathers move the fp16 weights as 16-bit
    words; overflowing steps are skipped on every rank exactly as ZeRO-2 skips them (the
    same skip lines and scales, the same bits after 6 steps)."""
    from test_pipeline_fp16 import FP16, OVERFLOWING, skips

    args = ["--runconfig.max_steps=6", "--runconfig.mode=train", *FP16, *OVERFLOWING]
    out = {}
    for z in (2, 3):
        d = tmp_path / f"z{z}"
        r = train(4, d, FC, *args, *PP2, f"--zero_opt_level={z}")
        out[z] = (skips(r.stdout), losses(r.stdout), final_state(d))
    assert out[2][0], "the check needs an overflow"
    assert out[3][0] == out[2][0] and out[3][1] == out[2][1]
    assert_same_state(out[3][2], out[2][2], "fp16 ZeRO-3 vs ZeRO-2")
