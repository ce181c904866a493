"""BERT as a model of stages (embeddings, layers, heads): ZeRO-3, weight streaming and
mixed precision's 16-bit weights run it, to the bits of data parallelism at ZeRO-0, with
dropout on and the NSP metrics in the evaluation."""

from __future__ import annotations

import json

import pytest
from model_runs import assert_same_state, runner
from test_bert import TINY_BERT
from test_train import final_state

from simdist.arena import Layout
from simdist.memplan import window_elements
from simdist.models.bert import Bert
from simdist.models.bert_shapes import resolve_config
from simdist.packed_params import chosen
from simdist.sim.streaming_step import stage_compute_times

train = runner(TINY_BERT)
ARGS = ("--runconfig.max_steps=4", "--runconfig.save_checkpoints_steps=4")


def evaluation(d) -> dict:
    out = json.loads((d / "eval.json").read_text())
    assert {"loss", "accuracy", "nsp_loss", "nsp_accuracy"} <= set(out), out
    return out


def perf(d) -> dict:
    return json.loads((d / "performance.json").read_text())


def test_zero3_and_weight_streaming_train_bert_to_zero0s_bits(tmp_path):
    """np 2 (dropout 0.1 on hidden states and attention probabilities): ZeRO-3 and weight
    streaming (1 server + 2 devices) end 4 steps with ZeRO-0's parameters and Adam state
    and evaluate to its numbers, NSP included; ZeRO-3's parameter memory is its slice plus
    two windows of the largest stage (the heads, tied to the word embeddings), as planned."""
    train(2, tmp_path / "z0", *ARGS, "--zero_opt_level=0")
    out = train(2, tmp_path / "z3", *ARGS, "--zero_opt_level=3")
    assert "ZeRO-3" in out.stdout
    ref, ref_eval = final_state(tmp_path / "z0"), evaluation(tmp_path / "z0")
    assert_same_state(ref, final_state(tmp_path / "z3"), "ZeRO-3")
    assert evaluation(tmp_path / "z3") == ref_eval

    model = Bert(resolve_config("bert-mini", num_hidden_layers=2, hidden_size=64,
                                intermediate_size=128, max_seq_length=32))  # fmt: skip
    layout = Layout(model.parameter_specs(), 2)
    window = window_elements(model, 2)
    heads = model.stages()[-1]
    assert window >= sum(s.numel for s in model.parameter_specs() if s.name in heads.forward_params)
    assert perf(tmp_path / "z3")["memory_bytes"]["parameters"] == 4 * layout.shard_size + 8 * window

    out = train(3, tmp_path / "ws", *ARGS, "--execution_mode=weight_streaming",
                "--weight_servers=1")  # fmt: skip
    assert "1 weight server(s) + 2 device(s)" in out.stdout
    assert_same_state(ref, final_state(tmp_path / "ws"), "weight streaming")
    assert evaluation(tmp_path / "ws") == ref_eval


def test_bf16_bert_weights_as_16_bit_words_and_zero3_train_the_same_bits(tmp_path, monkeypatch):
    """bf16 at np 2: float32 words at ZeRO-0 (SIMDIST_PACK_WEIGHTS=0), forced 16-bit words at
    ZeRO-2 and ZeRO-3's 16-bit slice end with the same state; the words' host bytes are
    2 per weight plus one float32 window of the largest stage."""
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
    window = (words["host_parameter_bytes"] - 2 * psi) // 4
    heads = sum(n for n in _heads_numel())
    assert heads <= window < psi


def _heads_numel() -> list[int]:
    model = Bert(resolve_config("bert-mini", num_hidden_layers=2, hidden_size=64,
                                intermediate_size=128, max_seq_length=32))  # fmt: skip
    names = set(model.stages()[-1].forward_params)
    return [s.numel for s in model.parameter_specs() if s.name in names]


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
    """Weight streaming's device model puts each kernel's time on its stage: the layers
    alike, the embeddings' and the heads' their own."""
    from simdist.device import CostModel, load_profile

    model = Bert(resolve_config("bert-base"))
    fwd, bwd, note = stage_compute_times(
        model, model.stages(), CostModel(load_profile("a100-40gb"), "fp32"), 8
    )
    assert "kernel costs" in note
    layers = fwd[1:-1]
    assert len(layers) == 12 and min(layers) == max(layers) > 0
    assert 0 < fwd[0] < layers[0] and fwd[-1] > 0 and bwd[-1] > 0 and bwd[0] > 0
    assert min(bwd[1:-1]) == max(bwd[1:-1]) > layers[0]


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
    assert got["a"].tolist() == [[2, 2, 2], [1, 1, 1]] and got["b"].min() == 3.0

    def back(params, rng):
        init(params, rng)
        params["a"][1] = 0.0

    with pytest.raises(RuntimeError, match="went back to 'a'"):
        fill_tensors(back, None, specs, lambda n, v: None)
