"""Weight streaming in mixed precision (issue #17 with the streaming of issue #8).

The servers keep the fp32 master and stream its half rounding as 16-bit words; the devices
compute as data parallelism's ranks do and send each gradient group stored half (ZeRO-2's
order: reduce-scattered per micro-batch, summed on the server in float32). So a streamed
run equals data parallelism's ZeRO-2 at the same devices bit for bit, in bf16 and in fp16
with the loss scaler's skips, and every streamed byte is half of fp32's.
"""

from __future__ import annotations

import json

import h5py
import pytest
from model_runs import assert_same_state
from mpi_launch import run_mpi
from test_pipeline import FC, losses, train
from test_pipeline_fp16 import OVERFLOWING, resumed_as_straight, scale_sequence, skips
from test_streaming import PIPELINED, STREAM, TINY, assert_same_bits, state
from test_train import final_state

BF16 = ["--runconfig.precision=bf16"]
FP16 = ["--runconfig.precision=fp16"]


def test_bf16_streamed_gpt2_equals_zero2_data_parallel_with_half_the_bytes(tmp_path):
    """1 server + 2 devices, 2 micro-batches per step, bf16: the step-3 checkpoint (weights,
    fp32 master, moments) and every logged loss and norm equal 2-rank ZeRO-2 in bf16; the
    weights stream as bf16 words and the gradients leave as bf16 words (2 bytes each, as
    the analysis counts them); the device accounts its window at 2 bytes, as
    ``device_footprint`` predicts."""
    from simdist.config import load_params
    from simdist.models import build_model
    from simdist.sim.streaming_step import device_footprint

    args = [*BF16, "--optimizer.grad_accum_steps=2", "--runconfig.max_steps=3",
            "--runconfig.mode=train"]  # fmt: skip
    dp, ws = tmp_path / "dp", tmp_path / "ws"
    ref = run_mpi(2, [*PIPELINED, *TINY, *args, "--zero_opt_level=2", f"--model_dir={dp}"], 240)
    assert ref.returncode == 0, ref.stdout
    out = run_mpi(3, [*STREAM, *TINY, *args, f"--model_dir={ws}"], 240)
    assert out.returncode == 0, out.stdout
    assert "weights streamed in bf16, gradients reduced and sent in bf16" in out.stdout
    got, want = state(ws / "checkpoint_3.h5"), state(dp / "checkpoint_3.h5")
    assert any(k.startswith("master/") for k in got)
    assert_same_bits(got, want, "WS bf16 vs DP ZeRO-2 bf16")
    assert losses(out.stdout) and losses(out.stdout) == losses(ref.stdout)
    with h5py.File(ws / "checkpoint_3.h5") as f:
        assert f.attrs["precision"] == "bf16"

    perf = json.loads((ws / "performance.json").read_text())
    assert perf["precision"] == "bf16" and perf["streamed_bytes_per_element"] == 2
    sent, analysis = perf["streamed_bytes_per_step"], perf["streamed_bytes_analysis"]
    numel = perf["parameters"]
    assert sent["weights_in"] == analysis["weights_in"]
    # 2 micro-batches, every gradient once per micro-batch, 2 bytes each
    assert sent["gradients_out"] == analysis["gradients_out"] == 2 * 2 * numel
    model = build_model(load_params([*TINY, *args]).model)
    want_window = sum(
        n for k, n in device_footprint(model, 2, 2, 1, word=2).items() if k.startswith("window")
    )
    peak = perf["device_memory"][0]["peak_bytes"]
    assert peak["streaming_window"] == want_window
    # on the host: the slots' words and one float32 copy the stage computes from
    slots, words = perf["prefetch_depth"] + 1, device_footprint(model, 2, 2, 1, word=2)
    words = words["window.weights"]
    assert perf["host_window_bytes"] == words + 2 * words // slots
    assert want_window * 2 == sum(
        n for k, n in device_footprint(model, 2, 2, 1).items() if k.startswith("window")
    )


def test_fp16_streamed_overflows_skip_as_data_parallelism(tmp_path):
    """FC-MNIST in fp16 at a scale that overflows (and grows back to overflow again): 2
    servers + 2 devices skip the steps 2-rank ZeRO-2 skips, with the same scales at every
    summary step, and end at its bits; performance.json reports the scaler."""
    args = [*FC, *FP16, *OVERFLOWING, "--runconfig.max_steps=6", "--runconfig.mode=train",
            "--runconfig.save_checkpoints_steps=6"]  # fmt: skip
    dp = train(2, tmp_path / "dp", FC, *args, "--zero_opt_level=2")
    assert skips(dp.stdout), dp.stdout  # the check needs an overflow
    ws = train(4, tmp_path / "ws", FC, *args, "--execution_mode=weight_streaming",
               "--weight_servers=2")  # fmt: skip
    assert "2 weight server(s) + 2 device(s)" in ws.stdout
    assert skips(ws.stdout) == skips(dp.stdout)
    assert losses(ws.stdout) == losses(dp.stdout)
    assert scale_sequence(tmp_path / "ws") == scale_sequence(tmp_path / "dp")
    assert_same_state(final_state(tmp_path / "dp"), final_state(tmp_path / "ws"), "WS fp16")
    perf = json.loads((tmp_path / "ws" / "performance.json").read_text())
    ref = json.loads((tmp_path / "dp" / "performance.json").read_text())
    assert perf["precision"] == "fp16"
    assert perf["loss_scale"] == ref["loss_scale"]
    assert perf["skipped_steps"] == ref["skipped_steps"] == len(skips(dp.stdout))


def test_fp16_streamed_resume_hands_the_scaler_to_the_devices(tmp_path):
    """6 steps straight vs 3 + 3 resumed, overflows on both sides of the checkpoint: the
    servers read the scaler and the devices (which hold no checkpoint state) scale their
    loss with it, so losses, skips and bits equal the straight run."""
    args = [*FC, *FP16, *OVERFLOWING, "--runconfig.save_checkpoints_steps=3",
            "--runconfig.mode=train", "--execution_mode=weight_streaming"]  # fmt: skip
    resumed_as_straight(tmp_path, 3, args, 3, 6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_plan_predicts_the_streamed_half_precision_step(tmp_path, precision):
    """``plan(execution="weight_streaming", precision="mixed", half=...)`` replays the
    run's step: half the bytes on the streaming link, the profile's half-precision rates,
    the window at 2 bytes; equal to float round-off."""
    from simdist.plan import plan

    d = tmp_path / "run"
    cmd = [*STREAM, "--params=gpt2_mini", "--train_input.batch_size=2",
           "--optimizer.grad_accum_steps=2", "--profile=a100-80gb", "--runconfig.mode=train",
           "--runconfig.max_steps=2", "--runconfig.save_checkpoints_steps=0",
           "--runconfig.progress_bar=false", f"--runconfig.precision={precision}",
           f"--runconfig.model_dir={d}"]  # fmt: skip
    out = run_mpi(3, cmd, 300)
    assert out.returncode == 0, out.stdout
    p = json.loads((d / "performance.json").read_text())
    r = plan(model="gpt2-mini", devices=2, profile="a100-80gb", precision="mixed",
             half=precision, execution="weight_streaming", batch=4, micro_batch=2)  # fmt: skip
    assert any("weight-streaming step" in n for n in r.notes), r.notes
    assert r.step_s == pytest.approx(p["simulated_step_time_s"], rel=1e-9)
    assert r.breakdown_s["compute"] == pytest.approx(p["simulated_compute_s_per_step"], rel=1e-9)
    fp32 = plan(model="gpt2-mini", devices=2, profile="a100-80gb", precision="fp32",
                execution="weight_streaming", batch=4, micro_batch=2)  # fmt: skip
    assert r.breakdown_s["compute"] < fp32.breakdown_s["compute"]  # tensor-core rates
    peak = p["device_memory"][0]["peak_bytes"]
    for cat in ("streaming_window", "workspace", "parameters", "gradients"):
        assert r.memory_bytes[cat] == peak[cat], cat
    assert 2 * r.memory_bytes["streaming_window"] == fp32.memory_bytes["streaming_window"]
