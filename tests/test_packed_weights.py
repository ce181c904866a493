"""Mixed precision's weights as 16-bit words on the host (simdist.packed_params).

The same bits as float32 words, at every ZeRO level 0-2, through a resume from an fp32
checkpoint, in less host memory (GPT-2); reads outside a stage refused; the float32 window
loaded once per stage use, not per parameter.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_runs import assert_same_state, runner
from simdist.kernels.half import BF16, round_half
from test_precision import FC
from test_precision import GPT2 as GPT2_ARGS
from test_train import final_state

from simdist.arena import Layout
from simdist.models import build_model
from simdist.packed_params import PackedParameters, UnpackedTensor, chosen

GPT2 = [*GPT2_ARGS, "--runconfig.precision=bf16"]


def perf(d) -> dict:
    return json.loads((d / "performance.json").read_text())


def test_gpt2_bf16_weights_as_16_bit_words_train_the_same_bits(tmp_path, monkeypatch):
    """gpt2-mini bf16 at np 2, ZeRO-1: 16-bit words (the default) and float32 words
    (SIMDIST_PACK_WEIGHTS=0) end with the same parameters and optimizer state; the host holds
    2 bytes a weight plus one float32 stage window instead of 4; the device the same."""
    train = runner(GPT2)
    args = ("--runconfig.max_steps=3", "--runconfig.mode=train", "--zero_opt_level=1")
    out = train(2, tmp_path / "words", *args)
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "0")
    train(2, tmp_path / "float", *args)
    assert_same_state(final_state(tmp_path / "float"), final_state(tmp_path / "words"), "packed")
    words, floats = perf(tmp_path / "words"), perf(tmp_path / "float")
    psi = words["parameters_padded"]
    assert floats["host_parameter_bytes"] == 4 * psi
    window = words["host_parameter_bytes"] - 2 * psi  # one float32 window of the largest stage
    assert 0 < window < psi  # 4 W < Ψ here; auto packs where 4 W < 2 Ψ
    assert words["memory_bytes"] == floats["memory_bytes"]  # the device holds 2 Ψ either way
    assert words["memory_bytes"]["parameters"] == 2 * psi
    assert f"weights {2 * psi / 2**20:.1f} MiB as 16-bit words" in out.stdout


@pytest.mark.parametrize("level", [0, 2])
def test_fp16_words_with_loss_scaling_match_float32_words(tmp_path, monkeypatch, level):
    """fc_mnist fp16 (dynamic loss scaling, growth every 2 steps) at np 2: forced 16-bit
    words (SIMDIST_PACK_WEIGHTS=1; auto keeps float32 words, its first layer being most of
    the model) give ZeRO-0's float32-word bits at ZeRO-`level`."""
    train = runner([*FC, "--runconfig.precision=fp16", "--runconfig.loss_scale_growth_interval=2"])
    args = ("--runconfig.max_steps=5", "--runconfig.mode=train")
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "0")
    train(2, tmp_path / "float", *args, "--zero_opt_level=0")
    assert (
        perf(tmp_path / "float")["host_parameter_bytes"]
        == 4 * perf(tmp_path / "float")["parameters_padded"]
    )
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "1")
    out = train(2, tmp_path / "words", *args, f"--zero_opt_level={level}")
    assert "as 16-bit words" in out.stdout
    assert_same_state(final_state(tmp_path / "float"), final_state(tmp_path / "words"), "packed")


def test_fp32_checkpoint_resumes_into_16_bit_words(tmp_path, monkeypatch):
    """An fp32 gpt2-mini checkpoint resumed in bf16 at np 2, ZeRO-2: its parameters become the
    fp32 master (not their rounding) and the words their rounding; the same state after 2
    more steps as the float32-word path, whose master is a copy of the float32 words."""
    fp32 = runner([a for a in GPT2 if a != "--runconfig.precision=bf16"])
    for d in ("words", "float"):
        fp32(2, tmp_path / d, "--runconfig.max_steps=2", "--runconfig.mode=train",
             "--runconfig.save_checkpoints_steps=2")  # fmt: skip
    train = runner(GPT2)
    args = ("--runconfig.max_steps=4", "--runconfig.mode=train", "--zero_opt_level=2")
    out = train(2, tmp_path / "words", *args)
    assert "was written in fp32: its parameters become the fp32 master" in out.stdout
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "0")
    train(2, tmp_path / "float", *args)
    assert_same_state(final_state(tmp_path / "float"), final_state(tmp_path / "words"), "resumed")


def test_stages_read_exact_unpacked_windows_and_nothing_else(monkeypatch):
    """In process, gpt2-mini bf16: the loss through 16-bit words equals the loss on float32
    views of the same rounded weights, bit for bit; each stage use loads its groups once
    (one window, no prefetch); a read outside a stage raises; SIMDIST_PACK_WEIGHTS is checked."""
    from simdist.config import ConfigError, load_params
    from simdist.precision import Precision

    params = load_params(["--params", "gpt2_mini"])
    model = build_model(params.model)
    model.set_precision(Precision("bf16"))
    model.allocate(2)
    layout = Layout(model.parameter_specs(), 1)
    flat = np.zeros(layout.padded, np.float32)
    model.init_parameters(layout.views(flat), np.random.default_rng(0))
    round_half(flat, BF16)
    rng = np.random.default_rng(1)
    T = model.config.block_size
    x = rng.integers(0, model.config.vocab_size, (2, T)).astype(np.int32)
    y = rng.integers(0, model.config.vocab_size, (2, T)).astype(np.int32)
    want = model.forward(layout.views(flat), x, y)

    other = build_model(params.model)
    other.set_precision(Precision("bf16"))
    other.allocate(2)
    words = np.zeros(layout.padded, np.uint16)
    packed = PackedParameters(layout, other, words, BF16)
    master = np.zeros(layout.padded, np.float32)
    packed.write(0, flat, master, 0)
    assert np.array_equal(master, flat) and len(packed.windows) == 1
    assert other.forward(packed, x, y) == want
    uses = [u for u in packed.plan.forward if u]  # no two alike in a row: each one loads
    assert all(a != b for a, b in zip(uses[:-1], uses[1:], strict=True))
    assert packed.loads == sum(len(u) for u in uses)
    with pytest.raises(KeyError, match="read outside a stage"):
        packed["wte"]
    # the checkpoint writer's tensors unpack in blocks of rows (here 5 elements: 1 row of
    # wte, several of a bias) into the dataset, to the values of the whole tensor
    monkeypatch.setattr(UnpackedTensor, "BLOCK", 5)
    views = layout.views(flat)
    for name, t in packed.tensors().items():
        into = np.full(t.shape, np.nan, np.float32)
        t.write_to(into)
        assert np.array_equal(into, views[name]) and np.array_equal(np.asarray(t), into), name
    assert chosen(layout, other)  # auto: gpt2-mini's largest stage is under Ψ / 2
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "yes")
    with pytest.raises(ConfigError, match="SIMDIST_PACK_WEIGHTS='yes'"):
        chosen(layout, other)


def test_zero3_slices_as_words_resume_and_take_fp32_checkpoints(tmp_path):
    """fc_mnist bf16 at np 2, ZeRO-3 (its slices as 16-bit words): 3 + 3 steps resumed equal
    6 straight; an fp32 checkpoint resumed at ZeRO-3 trains as at ZeRO-0 (float32 words),
    its parameters the fp32 master of both."""
    from model_runs import assert_resume_identical

    bf16 = [*FC, "--runconfig.precision=bf16"]
    assert_resume_identical(runner(bf16), tmp_path / "resume", "--zero_opt_level=3")
    p = perf(tmp_path / "resume" / "res")
    assert p["memory_bytes"]["parameters"] < p["host_parameter_bytes"]  # + float32 windows
    fp32 = runner(FC)
    for level in (0, 3):
        d = tmp_path / f"z{level}"
        fp32(2, d, "--runconfig.max_steps=2", "--runconfig.mode=train")
        runner(bf16)(2, d, "--runconfig.max_steps=4", "--runconfig.mode=train",
                     f"--zero_opt_level={level}")  # fmt: skip
    assert_same_state(final_state(tmp_path / "z0"), final_state(tmp_path / "z3"), "ZeRO-3")


def test_pipeline_stages_hold_16_bit_words_with_the_bits_of_float32_words(tmp_path, monkeypatch):
    """gpt2-mini bf16, 2 replicas x 2 stages (np 4), the tied wte read again by stage 1's
    head: forced 16-bit words (SIMDIST_PACK_WEIGHTS=1) at ZeRO-1 give float32 words' loss
    lines, eval.json and state; resumed from float32 words' step-2 checkpoint at ZeRO-2 they
    end as float32 words resumed do. The host holds 2 bytes a weight (range and tied group)
    plus one float32 window; the device the same 2 bytes either way."""
    from test_pipeline import GPT2 as PIPE_GPT2
    from test_pipeline import losses

    train = runner([*PIPE_GPT2, "--runconfig.precision=bf16", "--pipeline-parallel=2"])
    args = ("--runconfig.max_steps=4", "--runconfig.save_checkpoints_steps=2")
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "0")
    floats = train(4, tmp_path / "float", *args, "--zero_opt_level=1")
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "1")
    words = train(4, tmp_path / "words", *args, "--zero_opt_level=1")
    assert "as 16-bit words" in words.stdout and "as 16-bit words" not in floats.stdout
    assert losses(words.stdout) == losses(floats.stdout) and len(losses(words.stdout)) == 4
    assert_same_state(final_state(tmp_path / "float"), final_state(tmp_path / "words"), "PP words")
    evals = [(tmp_path / d / "eval.json").read_text() for d in ("words", "float")]
    assert evals[0] == evals[1]
    pw, pf = perf(tmp_path / "words"), perf(tmp_path / "float")
    assert pw["memory_bytes_per_rank"] == pf["memory_bytes_per_rank"]
    for rank in range(4):
        a, b = pw["pipeline_split"][rank % 2]["flat_range"]
        host_w, host_f = (
            pw["host_parameter_bytes_per_rank"][rank],
            pf["host_parameter_bytes_per_rank"][rank],
        )
        assert host_f >= 4 * (b - a) and host_w < host_f, (rank, host_w, host_f)
        assert host_w >= 2 * (b - a) + 4  # the words and a window
    # float32 words' step-2 checkpoint resumed at ZeRO-2 (whose per-micro-batch reduction
    # sums in another order than ZeRO-1's) with 16-bit words and with float32 words
    ckpt = tmp_path / "float" / "checkpoint_2.h5"
    for pack in ("1", "0"):
        monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", pack)
        d = tmp_path / f"resumed{pack}"
        d.mkdir()
        out = train(4, d, "--runconfig.max_steps=4", f"--runconfig.checkpoint_path={ckpt}",
                    "--zero_opt_level=2", "--runconfig.mode=train")  # fmt: skip
        assert "resumed from" in out.stdout and ("as 16-bit words" in out.stdout) == (pack == "1")
    assert_same_state(final_state(tmp_path / "resumed0"), final_state(tmp_path / "resumed1"),
                      "PP words resumed at ZeRO-2")  # fmt: skip


def test_pipeline_zero3_slices_as_words_resume_and_take_fp32_checkpoints(tmp_path, monkeypatch):
    """gpt2-mini bf16 at 2 replicas x 2 stages, ZeRO-3 (each slice, the last stage's slice of
    the tied group too, as 16-bit words): 2 + 2 steps resumed equal 4 straight; an fp32
    checkpoint resumed at ZeRO-3 trains as at ZeRO-2 with float32 words (its parameters the
    fp32 master of both). The host holds the device's 2 bytes a weight plus float32 windows
    (float32 slices would be twice the device's bytes)."""
    from test_pipeline import GPT2 as PIPE_GPT2

    pipe = [*PIPE_GPT2, "--pipeline-parallel=2", "--runconfig.mode=train"]
    bf16 = runner([*pipe, "--runconfig.precision=bf16", "--runconfig.save_checkpoints_steps=2"])
    z3 = "--zero_opt_level=3"
    bf16(4, tmp_path / "full", z3, "--runconfig.max_steps=4")
    bf16(4, tmp_path / "res", z3, "--runconfig.max_steps=2")
    out = bf16(4, tmp_path / "res", z3, "--runconfig.max_steps=4")
    assert "resumed from" in out.stdout
    assert_same_state(final_state(tmp_path / "full"), final_state(tmp_path / "res"), "resumed")
    p = perf(tmp_path / "res")
    for host, mem in zip(
        p["host_parameter_bytes_per_rank"], p["memory_bytes_per_rank"], strict=True
    ):
        assert mem["parameters"] < host < 2 * mem["parameters"], (host, mem)
    fp32 = runner([*pipe, "--runconfig.save_checkpoints_steps=2"])
    for level, pack in ((3, "1"), (2, "0")):
        d = tmp_path / f"z{level}"
        fp32(4, d, f"--zero_opt_level={level}", "--runconfig.max_steps=2")
        monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", pack)
        out = bf16(4, d, f"--zero_opt_level={level}", "--runconfig.max_steps=4")
        assert "become the fp32 master weights" in out.stdout
    assert_same_state(final_state(tmp_path / "z2"), final_state(tmp_path / "z3"), "fp32 resumed")


def test_weight_mode_pipeline_shards_as_16_bit_words(tmp_path, monkeypatch):
    """gpt2-mini bf16, tensor-parallel weight mode T 2 on each of 2 stages (np 4): forced
    16-bit words at ZeRO-2 and ZeRO-3 give float32 words' loss lines, eval.json and
    whole-tensor checkpoint at ZeRO-2 (one replica: both reduce per micro-batch); the
    shards' replicated parameters are compared as words at every summary; words resumed
    from float32 words' step-2 checkpoint end where float32 words do."""
    from test_pipeline import GPT2 as PIPE_GPT2
    from test_pipeline import WEIGHT, losses

    train = runner([*PIPE_GPT2, *WEIGHT, "--runconfig.precision=bf16", "--pipeline-parallel=2"])
    args = ("--runconfig.max_steps=4", "--runconfig.save_checkpoints_steps=2")
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "0")
    ref = train(4, tmp_path / "float", *args, "--zero_opt_level=2")
    want = final_state(tmp_path / "float")
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "1")
    for level in (2, 3):
        d = tmp_path / f"words{level}"
        out = train(4, d, *args, f"--zero_opt_level={level}")
        assert ("as 16-bit words" in out.stdout) == (level == 2)  # ZeRO-3: its slices' words
        assert losses(out.stdout) == losses(ref.stdout) and len(losses(out.stdout)) == 4
        assert_same_state(want, final_state(d), f"weight mode words ZeRO-{level}")
        evals = [(x / "eval.json").read_text() for x in (d, tmp_path / "float")]
        assert evals[0] == evals[1]
        p = perf(d)
        for host, mem in zip(
            p["host_parameter_bytes_per_rank"], p["memory_bytes_per_rank"], strict=True
        ):
            assert host < 2 * mem["parameters"], (level, host, mem)  # float32: twice or more
    d = tmp_path / "resumed"
    d.mkdir()
    step2 = tmp_path / "float" / "checkpoint_2.h5"
    out = train(4, d, *args, "--zero_opt_level=2", f"--runconfig.checkpoint_path={step2}")
    assert "resumed from" in out.stdout and "as 16-bit words" in out.stdout
    assert_same_state(want, final_state(d), "weight mode words resumed")


def test_pipeline_stages_answer_apart_except_the_tied_pair(tmp_path, monkeypatch):
    """gpt2-mini with 12 blocks and an 8,192-token vocabulary at P 4, bf16, auto: the middle
    stages (four blocks each) hold 16-bit words, while stage 0 and the last stage, linked by
    the tied wte whose float32 window would cost more than its words save, both keep float32
    words; the same bits as float32 words everywhere."""
    from test_pipeline import GPT2 as PIPE_GPT2

    model = ["--model.n_layer=12", "--model.vocab_size=8192", "--pipeline-parallel=4"]
    train = runner([*PIPE_GPT2, *model, "--runconfig.precision=bf16", "--runconfig.mode=train"])
    for pack in ("auto", "0"):
        monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", pack)
        train(4, tmp_path / pack, "--runconfig.max_steps=2")
    assert_same_state(final_state(tmp_path / "0"), final_state(tmp_path / "auto"), "P 4 mixed")
    p = perf(tmp_path / "auto")
    host, device = p["host_parameter_bytes_per_rank"], p["memory_bytes_per_rank"]
    float32 = [h == 2 * d["parameters"] for h, d in zip(host, device, strict=True)]
    assert float32 == [True, False, False, True], (host, device)
    assert host[1] < 0.8 * 2 * device[1]["parameters"]
    assert perf(tmp_path / "0")["host_parameter_bytes_per_rank"][0] == host[0]
