"""fp16 on a pipeline (``runconfig.pipeline_parallel``): data parallelism's loss scaling.

The last stage's backward starts from the scaled loss, so the activation gradients sent
between stages carry the scale; each rank unscales its reduced gradients before the norm
and the update; an overflow on any stage of any replica reaches every rank through the norm
relay and the per-step agreement, so every rank skips the same steps with the same scale.
Held to one rank (and to data parallelism at D ranks) bit for bit: parameters, optimizer
state, loss lines, the skipped steps and the loss scale at every step (TensorBoard).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
from model_runs import assert_same_state
from test_pipeline import FC, GPT2, losses, train
from test_train import final_state

from simdist.events import read_events

FP16 = ["--runconfig.precision=fp16"]
# at 2^21 the last stage's parameter gradients (FC-MNIST, 4 micro-batches of 8) overflow
# fp16 while the activation gradients it sends back, and stage 0's gradients, stay finite;
# growth every 2 clean steps brings the scale back up to where it overflows again
OVERFLOWING = [
    f"--runconfig.initial_loss_scale={2.0**21}",
    "--runconfig.loss_scale_growth_interval=2",
]
SKIP = re.compile(
    r"global_step (\d+): gradients overflowed at loss scale (\S+): step skipped, "
    r"scale now (\S+) \((\d+) skipped so far(?:; (.*))?\)$",
    re.MULTILINE,
)


def skips(stdout: str) -> dict[int, tuple[str, str, str]]:
    """Each skipped step's (scale, new scale, count so far) as the run logged them."""
    return {int(m[1]): (m[2], m[3], m[4]) for m in SKIP.finditer(stdout)}


def skip_origins(stdout: str) -> dict[int, str]:
    """A pipeline's note on each skipped step: where the non-finite values were."""
    return {int(m[1]): m[5] for m in SKIP.finditer(stdout)}


def scale_sequence(d: Path) -> list[tuple[int, float, float]]:
    """(step, loss scale, skipped steps) at every summary step, from TensorBoard's file."""
    (events,) = d.glob("events.out.tfevents.*")
    by_step: dict[int, dict[str, float]] = {}
    for step, tag, v in read_events(events):
        by_step.setdefault(step, {})[tag] = v
    return [(s, x["loss_scale"], x["skipped_steps"]) for s, x in sorted(by_step.items())]


def assert_scaler_agrees(d: Path, ranks: int) -> dict:
    """performance.json: every rank ended with the same scale and skip count."""
    perf = json.loads((d / "performance.json").read_text())
    assert perf["precision"] == "fp16"
    assert perf["loss_scale_per_rank"] == [perf["loss_scale"]] * ranks
    assert perf["skipped_steps_per_rank"] == [perf["skipped_steps"]] * ranks
    return perf


def resumed_as_straight(tmp_path: Path, n: int, args: list[str], split: int, end: int):
    """``n`` ranks straight to step ``end`` (model_dir ``full``) and stopped at ``split``
    then resumed (``res``), overflows on both sides: the same losses, skips and final
    bits. Returns the three runs."""
    full = train(n, tmp_path / "full", FC, *args, f"--runconfig.max_steps={end}")
    first = train(n, tmp_path / "res", FC, *args, f"--runconfig.max_steps={split}")
    second = train(n, tmp_path / "res", FC, *args, f"--runconfig.max_steps={end}")
    assert "resumed from" in second.stdout
    assert losses(full.stdout) == losses(first.stdout) + losses(second.stdout)
    assert skips(full.stdout) == {**skips(first.stdout), **skips(second.stdout)}
    steps = skips(full.stdout)
    assert any(s <= split for s in steps) and any(s > split for s in steps)
    assert_same_state(final_state(tmp_path / "full"), final_state(tmp_path / "res"), "resumed")
    return full, first, second


def test_fp16_gpt2_mini_pipeline_equals_one_rank_with_the_scale_sequence(tmp_path):
    """gpt2-mini at P = 2 (the tied embedding's gradient crosses the pipeline scaled) in fp16
    with the scale growing after every clean step: the bits of one rank, and its scales."""
    args = [*FP16, "--runconfig.max_steps=3", "--runconfig.mode=train",
            "--runconfig.loss_scale_growth_interval=1"]  # fmt: skip
    one = train(1, tmp_path / "np1", GPT2, *args)
    pp2 = train(2, tmp_path / "pp2", GPT2, *args, "--pipeline-parallel=2")
    assert "precision fp16 (dynamic loss scale from 65536)" in pp2.stdout
    assert losses(one.stdout) and losses(one.stdout) == losses(pp2.stdout)
    assert_same_state(final_state(tmp_path / "np1"), final_state(tmp_path / "pp2"), "gpt2 fp16")
    want = [(s, 2.0**16 * 2**s, 0.0) for s in (1, 2, 3)]  # no overflow: doubled each step
    assert scale_sequence(tmp_path / "np1") == want
    assert scale_sequence(tmp_path / "pp2") == want
    assert assert_scaler_agrees(tmp_path / "pp2", 2)["skipped_steps"] == 0


def test_fp16_overflow_on_the_last_stage_only_skips_on_every_rank_as_one_rank(tmp_path):
    """Overflows in the last stage's gradients alone (stage 0's stay finite): both stages
    skip those steps, with one rank's scales, skipped steps, losses and final bits, 1F1B and
    GPipe alike."""
    args = [*FC, *FP16, *OVERFLOWING, "--runconfig.max_steps=8", "--runconfig.mode=train"]
    one = train(1, tmp_path / "np1", FC, *args)
    want = skips(one.stdout)
    assert len(want) >= 2 and want[1] == (f"{2.0**21:g}", f"{2.0**20:g}", "1"), one.stdout
    ref = (losses(one.stdout), final_state(tmp_path / "np1"), scale_sequence(tmp_path / "np1"))
    for kind in ("1f1b", "gpipe"):
        d = tmp_path / kind
        out = train(2, d, FC, *args, "--pipeline-parallel=2", f"--pipeline-schedule={kind}")
        assert skips(out.stdout) == want, out.stdout
        # where the Inf came from: the last stage's gradients, never the first's
        assert set(skip_origins(out.stdout).values()) == {"non-finite gradients on stage(s) [1]"}, (
            out.stdout
        )
        assert losses(out.stdout) == ref[0]
        assert_same_state(ref[1], final_state(d), f"PP2 {kind} fp16 with overflows")
        assert scale_sequence(d) == ref[2]
        perf = assert_scaler_agrees(d, 2)
        assert perf["skipped_steps"] == perf["skipped_steps_this_run"] == len(want)
        assert perf["loss_scale"] == ref[2][-1][1]


def test_fp16_dp2_x_pp2_overflow_skips_on_every_replica_as_data_parallelism(tmp_path):
    """DP 2 x PP 2 (ZeRO-1 and ZeRO-2 on the data-parallel axis) with overflows: the bits,
    skipped steps and scales of 2 data-parallel ranks in fp16, every one of the 4 ranks with
    the same scale."""
    args = [*FC, *FP16, *OVERFLOWING, "--runconfig.max_steps=6", "--runconfig.mode=train"]
    for zero in (1, 2):
        z = f"--zero_opt_level={zero}"
        ref_out = train(2, tmp_path / f"dp2z{zero}", FC, *args, z)
        assert skips(ref_out.stdout), ref_out.stdout  # the check needs an overflow
        ref = (losses(ref_out.stdout), final_state(tmp_path / f"dp2z{zero}"))
        d = tmp_path / f"dp2pp2z{zero}"
        out = train(4, d, FC, *args, z, "--pipeline-parallel=2")
        assert "2 replica(s) x 2 stages" in out.stdout
        assert skips(out.stdout) == skips(ref_out.stdout), out.stdout
        assert ref[0] == losses(out.stdout)
        assert_same_state(ref[1], final_state(d), f"DP2 x PP2 ZeRO-{zero} fp16")
        assert scale_sequence(d) == scale_sequence(tmp_path / f"dp2z{zero}")
        assert_scaler_agrees(d, 4)


def test_fp16_pipeline_resume_restores_the_scaler_bitwise(tmp_path):
    """8 steps straight vs 4 + 4 resumed at P = 2, overflows on both sides of the
    checkpoint, which falls between two growths (its clean-step count matters): the same
    losses, bits, skipped steps and scales; the checkpoint holds the scaler."""
    args = [*FC, *FP16, *OVERFLOWING, "--runconfig.save_checkpoints_steps=4",
            "--runconfig.mode=train", "--pipeline-parallel=2"]  # fmt: skip
    resumed_as_straight(tmp_path, 2, args, 4, 8)
    with h5py.File(tmp_path / "res" / "checkpoint_4.h5") as f:
        assert f.attrs["precision"] == "fp16"
        state4 = {k: float(f.attrs[f"loss_scaler.{k}"]) for k in ("scale", "skipped_steps")}
        assert int(f.attrs["loss_scaler.clean_steps"]) == 1  # one clean step since the last change
    at4 = [x for x in scale_sequence(tmp_path / "full") if x[0] == 4]
    assert at4 == [(4, state4["scale"], state4["skipped_steps"])]
    perf = assert_scaler_agrees(tmp_path / "res", 2)
    full_perf = json.loads((tmp_path / "full" / "performance.json").read_text())
    assert perf["loss_scale"] == full_perf["loss_scale"]
    assert perf["skipped_steps"] == full_perf["skipped_steps"]
    assert perf["skipped_steps_this_run"] == perf["skipped_steps"] - state4["skipped_steps"]


def test_fp16_static_loss_scale_on_a_pipeline_equals_one_rank(tmp_path):
    """A static scale (runconfig.loss_scale: 2^20) never moves; the steps whose gradients
    overflow at it are still skipped, on every stage, as on one rank."""
    args = [*FC, *FP16, f"--runconfig.loss_scale={2.0**20}", "--runconfig.max_steps=6",
            "--runconfig.mode=train"]  # fmt: skip
    one = train(1, tmp_path / "np1", FC, *args)
    pp2 = train(2, tmp_path / "pp2", FC, *args, "--pipeline-parallel=2")
    assert "precision fp16 (static loss scale 1.04858e+06)" in pp2.stdout
    want = skips(one.stdout)
    assert 0 < len(want) < 6, one.stdout  # some steps skipped, some applied
    assert all(a == b == f"{2.0**20:g}" for a, b, _ in want.values())
    assert skips(pp2.stdout) == want
    assert losses(pp2.stdout) == losses(one.stdout)
    assert_same_state(final_state(tmp_path / "np1"), final_state(tmp_path / "pp2"), "static")
    assert {x[1] for x in scale_sequence(tmp_path / "pp2")} == {2.0**20}
    assert assert_scaler_agrees(tmp_path / "pp2", 2)["skipped_steps"] == len(want)
