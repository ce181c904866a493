"""BERT, T5 and the Transformer as models of stages (embeddings, blocks, heads): ZeRO-3,
weight streaming and mixed precision's 16-bit weights run them, to the bits of data
parallelism at ZeRO-0, with dropout on and the models' own evaluation metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_runs import assert_same_state, runner
from test_bert import TINY_BERT
from test_t5 import TINY_T5
from test_train import final_state
from test_transformer import TINY as TINY_TRANSFORMER

from simdist.arena import Layout
from simdist.config import load_params
from simdist.device import CostModel, load_profile
from simdist.memplan import window_elements
from simdist.models import build_model
from simdist.models.bert import Bert
from simdist.models.bert_shapes import resolve_config
from simdist.packed_params import chosen
from simdist.sim.streaming_step import stage_compute_times

PRESETS = {"bert": TINY_BERT, "t5": TINY_T5, "transformer": TINY_TRANSFORMER}
ARGS = ("--runconfig.max_steps=4", "--runconfig.save_checkpoints_steps=4")


def tiny_model(name: str):
    """The model the runs below build, in process (shapes only)."""
    return build_model(load_params(PRESETS[name]).model)


def numel(model) -> list[tuple[str, int]]:
    return [(s.name, s.numel) for s in model.parameter_specs()]


def evaluation(d) -> dict:
    return json.loads((d / "eval.json").read_text())


def perf(d) -> dict:
    return json.loads((d / "performance.json").read_text())


@pytest.mark.parametrize("name", ["bert", "t5", "transformer"])
def test_zero3_and_weight_streaming_train_to_zero0s_bits(tmp_path, name):
    """np 2, dropout 0.1: ZeRO-3 and weight streaming (1 server + 2 devices) end 4 steps with
    ZeRO-0's parameters and Adam state and evaluate to its numbers (BERT's NSP and the
    Transformer's greedy exact match included: ZeRO-3 decodes through its gathers, weight
    streaming on weights streamed for each decoding pass); ZeRO-3's parameter memory is its
    slice plus two windows of the largest stage, as planned."""
    train = runner(PRESETS[name])
    train(2, tmp_path / "z0", *ARGS, "--zero_opt_level=0")
    out = train(2, tmp_path / "z3", *ARGS, "--zero_opt_level=3")
    assert "ZeRO-3" in out.stdout
    ref, ref_eval = final_state(tmp_path / "z0"), evaluation(tmp_path / "z0")
    assert name != "bert" or {"nsp_loss", "nsp_accuracy"} <= set(ref_eval)
    if name == "transformer":  # decoding scored (its tokens: untrained, nothing matches whole)
        assert {"exact_match", "token_accuracy"} <= set(ref_eval)
        assert 0 < ref_eval["greedy_token_accuracy"] < 1
    assert_same_state(ref, final_state(tmp_path / "z3"), "ZeRO-3")
    assert evaluation(tmp_path / "z3") == ref_eval

    model = tiny_model(name)
    window = window_elements(model, 2)
    numel = {s.name: s.numel for s in model.parameter_specs()}
    assert window >= max(sum(numel[n] for n in s.forward_params) for s in model.stages())
    shard = Layout(model.parameter_specs(), 2).shard_size
    assert perf(tmp_path / "z3")["memory_bytes"]["parameters"] == 4 * shard + 8 * window

    out = train(3, tmp_path / "ws", *ARGS, "--execution_mode=weight_streaming",
                "--weight_servers=1")  # fmt: skip
    assert "1 weight server(s) + 2 device(s)" in out.stdout
    assert_same_state(ref, final_state(tmp_path / "ws"), "weight streaming")
    assert evaluation(tmp_path / "ws") == ref_eval


@pytest.mark.parametrize("name", ["bert", "t5", "transformer"])
def test_bf16_weights_as_16_bit_words_and_zero3_train_the_same_bits(tmp_path, monkeypatch, name):
    """bf16 at np 2: float32 words at ZeRO-0 (SIMDIST_PACK_WEIGHTS=0), forced 16-bit words at
    ZeRO-2 and ZeRO-3's 16-bit slice end with the same state; the words' host bytes are
    2 per weight plus one float32 window of the largest stage."""
    train = runner(PRESETS[name])
    args = (*ARGS, "--runconfig.mode=train", "--runconfig.precision=bf16")
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "0")
    train(2, tmp_path / "float", *args, "--zero_opt_level=0")
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "1")
    out = train(2, tmp_path / "words", *args, "--zero_opt_level=2")
    assert "as 16-bit words" in out.stdout
    train(2, tmp_path / "z3", *args, "--zero_opt_level=3")
    ref = final_state(tmp_path / "float")
    assert_same_state(ref, final_state(tmp_path / "words"), "16-bit words, ZeRO-2")
    assert_same_state(ref, final_state(tmp_path / "z3"), "ZeRO-3 bf16")
    words, floats = perf(tmp_path / "words"), perf(tmp_path / "float")
    psi = words["parameters_padded"]
    assert floats["host_parameter_bytes"] == 4 * psi
    window = window_elements(tiny_model(name), 1)
    assert words["host_parameter_bytes"] == 2 * psi + 4 * window


@pytest.mark.parametrize("preset", ["bert-mini", "bert-base", "bert-large"])
def test_bert_keeps_16_bit_words_by_default(preset, monkeypatch):
    """Every BERT preset packs under auto: its largest stage (the heads with the tied word
    embeddings) is under a quarter of the model, so 2Ψ + 4W < 4Ψ."""
    monkeypatch.delenv("SIMDIST_PACK_WEIGHTS", raising=False)
    model = Bert(resolve_config(preset))
    assert chosen(Layout(model.parameter_specs(), 1), model)
    monkeypatch.setenv("SIMDIST_PACK_WEIGHTS", "0")
    assert not chosen(Layout(model.parameter_specs(), 1), model)


def test_streamed_compute_is_charged_to_the_stage_that_runs_it():
    """Weight streaming's device model puts each kernel's time on its stage: a stack's
    blocks alike, the embeddings', final norms' and heads' their own (T5's bias tables to
    block 0, its embedding dropout to the embedding stage)."""
    cost = CostModel(load_profile("a100-40gb"), "fp32")
    bert = Bert(resolve_config("bert-base"))
    fwd, bwd, note = stage_compute_times(bert, bert.stages(), cost, 8)
    assert "kernel costs" in note
    layers = fwd[1:-1]
    assert len(layers) == 12 and min(layers) == max(layers) > 0
    assert 0 < fwd[0] < layers[0] and fwd[-1] > 0 and bwd[-1] > 0 and bwd[0] > 0
    assert min(bwd[1:-1]) == max(bwd[1:-1]) > layers[0]

    from simdist.models.t5 import T5
    from simdist.models.t5 import resolve_config as t5_config

    t5 = T5(t5_config("t5-small"))
    names = [s.name for s in t5.stages()]
    fwd, bwd, _ = stage_compute_times(t5, t5.stages(), cost, 8)
    time = dict(zip(names, zip(fwd, bwd, strict=True), strict=True))
    enc = [time[f"encoder.{i}"] for i in range(6)]
    dec = [time[f"decoder.{j}"] for j in range(6)]
    # block 0 also computes its stack's bias from its table (and its gradient)
    for stack in (enc, dec):
        assert stack[0][0] > stack[1][0] == stack[5][0] > 0
        assert stack[0][1] > stack[1][1] == stack[5][1] > 0
    assert all(f > 0 and b > 0 for f, b in time.values())
    every = sum(
        kc.count * cost.compute_time(kc.flops, kc.bytes, kc.kind, shape=kc.shape,
                                     serial_flops=kc.serial_flops)
        for kc in t5.kernel_costs(8)
    )  # fmt: skip
    assert sum(fwd) + sum(bwd) == pytest.approx(every, rel=1e-12)  # every kernel charged once


def test_one_tensor_at_a_time_init_refuses_going_back():
    """ZeRO-3 and 16-bit words initialise tensor by tensor (``fill_tensors``): an init that
    returns to a tensor it left (BERT's padding row, before this was fixed) would zero it,
    so it is refused; staying on one tensor is fine."""
    from simdist.models.base import ParamSpec
    from simdist.parallel import fill_tensors

    specs = {n: ParamSpec(n, (2, 3), True) for n in ("a", "b")}
    got = {}

    def init(params, rng):
        params["a"].fill(1.0)
        params["a"][0] = 2.0
        params["b"].fill(3.0)

    fill_tensors(init, None, specs, lambda n, v: got.__setitem__(n, v.copy()))
    assert got["a"].tolist() == [[2, 2, 2], [1, 1, 1]] and np.all(got["b"] == 3.0)

    def back(params, rng):
        init(params, rng)
        params["a"][1] = 0.0

    with pytest.raises(RuntimeError, match="went back to 'a'"):
        fill_tensors(back, None, specs, lambda n, v: None)


def test_bert_pipeline_equals_one_rank(tmp_path):
    """BERT cut into 2 and 3 pipeline stages (1F1B, GPipe) over 3 micro-batches, dropout on:
    one rank's loss lines, parameters, Adam state and evaluation (NSP included), the word
    embeddings tied across the first and last stage; the bytes sent per boundary are what
    the simulated pipeline costs (``boundary_bytes``)."""
    from test_pipeline import assert_same_run, run_record
    from test_pipeline import train as pp_train

    from simdist.sim.pp_schedule import boundary_bytes

    base = [*TINY_BERT, "--optimizer.grad_accum_steps=3", "--runconfig.max_steps=2"]
    ref = run_record(pp_train(1, tmp_path / "np1", base), tmp_path / "np1")
    assert "nsp_accuracy" in ref[2]
    model = tiny_model("bert")
    for n, kind in ((2, "1f1b"), (3, "gpipe")):
        d = tmp_path / f"pp{n}"
        out = pp_train(n, d, base, f"--pipeline-parallel={n}", f"--pipeline-schedule={kind}")
        assert "stage 0: embeddings layer.0" in out.stdout, out.stdout
        assert_same_run(ref, run_record(out, d), f"bert PP{n}")
        p = perf(d)
        cuts = np.cumsum([len(x["model_stages"]) for x in p["pipeline_split"]])[:-1]
        fwd = [3 * boundary_bytes(model, int(k), 4)[0] for k in cuts]
        bwd = [3 * boundary_bytes(model, int(k), 4)[1] for k in cuts]
        # stage s sends activations forward (but the last) and gradients back (but the first);
        # the last also sends each micro-batch's word-embedding gradient to the first (tied)
        want = [a + b for a, b in zip([*fwd, 0], [0, *bwd], strict=True)]
        want[-1] += 3 * 4 * dict(numel(model))["bert.embeddings.word_embeddings.weight"]
        assert p["pipeline_bytes_sent_per_step"] == want
