"""simdist's BERT vs Hugging Face ``BertForPreTraining``: same weights, same batches.

The Hugging Face model is built from a ``BertConfig`` of bert-mini's shapes with random
weights (nothing is downloaded), dropout off, LayerNorm eps the config's (1e-12 as Hugging
Face's default, and a larger one to show the key reaches both sides), and
its state dict goes into simdist through the interop path (safetensors -> ``import`` ->
checkpoint). Error measure per tensor: max|a - b| / max|b| (b = PyTorch). Skipped without
torch or transformers (``pip install -e .[test]`` installs transformers).
"""

from pathlib import Path

import numpy as np
import pytest

from simdist import interop
from simdist.config import OptimizerConfig
from simdist.data.bert import PAD, BertData
from simdist.data.text import load_corpus_bytes
from simdist.models.bert import Bert, resolve_config
from simdist.optim import Optimizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from simdist.testing.hf_reference import (  # noqa: E402
    bert_inputs,
    hf_bert,
    load_into_simdist,
)

TOL = 1e-4


def rel(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def _hf_model(cfg, seed: int):
    m = hf_bert(cfg, seed)
    with torch.no_grad():  # non-trivial biases and LayerNorms (HF initialises them 0 / 1)
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m.double().float()  # a fresh float32 copy (no shared storage surprises)


def _batch(cfg, B: int):
    data = BertData(load_corpus_bytes(), cfg.max_seq_length, cfg.max_predictions_per_seq, B, "")
    x, y = data.train_batch(np.arange(B) * 7)
    x, y = x.copy(), y.copy()
    x[0, 0, -9:] = PAD  # padding at the end of one sequence: the key mask matters
    return x, y


def _load_into_simdist(hf, cfg, tmp: Path):
    model = Bert(cfg)
    return (model, *load_into_simdist(hf, model, "bert", tmp))


def _config(**kw):
    return resolve_config(
        "bert-mini", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw
    )


@pytest.mark.parametrize("eps", [None, 1e-3])
def test_loss_and_every_gradient_match_hugging_face(tmp_path, eps):
    cfg = _config(layer_norm_eps=eps)
    assert cfg.layer_norm_eps == (eps or 1e-12)
    B, P = 4, cfg.max_predictions_per_seq
    hf = _hf_model(cfg, seed=0)
    model, _, _, _, params, grads = _load_into_simdist(hf, cfg, tmp_path)
    x, y = _batch(cfg, B)
    model.allocate(B)
    for g in grads.values():
        g.fill(np.nan)  # backward must overwrite every gradient
    loss = model.forward(params, x, y)
    model.backward(params, grads, 1.0 / B)

    out = hf(**bert_inputs(x, y, P))
    out.loss.backward()
    assert abs(loss - out.loss.item()) / abs(out.loss.item()) < 1e-5, (loss, out.loss.item())
    named = {n: p for n, p in hf.named_parameters() if n in grads}
    assert set(named) == set(grads)
    # The key bias adds q . b_k to every score of a softmax row, which changes nothing: its
    # gradient is exactly 0 and both sides hold rounding noise. Check that it is noise (tiny
    # next to the query bias's gradient) and measure every other tensor relatively.
    errs = {}
    for name, p in named.items():
        if name.endswith("attention.self.key.bias"):
            scale = np.abs(named[name.replace("key", "query")].grad.numpy()).max()
            assert np.abs(grads[name]).max() < 1e-5 * scale, name
            assert np.abs(p.grad.numpy()).max() < 1e-5 * scale, name
        else:
            errs[name] = rel(grads[name], p.grad.numpy())
    worst = max(errs, key=errs.get)
    print(f"\nloss {loss:.7f} vs {out.loss.item():.7f}; worst {worst} rel err {errs[worst]:.2e}")
    assert errs[worst] < TOL, {k: v for k, v in errs.items() if v >= TOL}


def test_ten_adamw_steps_match_hugging_face(tmp_path):
    cfg = _config()
    B, P = 4, cfg.max_predictions_per_seq
    hf = _hf_model(cfg, seed=1)
    model, layout, pflat, gflat, params, grads = _load_into_simdist(hf, cfg, tmp_path)
    data = BertData(load_corpus_bytes(), cfg.max_seq_length, P, B, "")
    model.allocate(B)
    ocfg = OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, beta2=0.98, eps=1e-6)
    opt = Optimizer(ocfg, layout, 0, layout.padded, lambda kind, name, n: np.zeros(n, np.float32))
    named = {n: p for n, p in hf.named_parameters() if n in params}
    decay = [p for p in named.values() if p.dim() >= 2]
    no_decay = [p for p in named.values() if p.dim() < 2]
    topt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.98),
        eps=1e-6,
        foreach=False,
    )
    losses = []
    for step in range(10):
        x, y = data.train_batch(np.arange(B) + B * step)
        loss = model.forward(params, x, y)
        model.backward(params, grads, 1.0 / B)
        opt.step(pflat, gflat, step + 1, ocfg.learning_rate)
        topt.zero_grad()
        tl = hf(**bert_inputs(x, y, P)).loss
        tl.backward()
        topt.step()
        losses.append((loss, tl.item()))
    print("\n" + "\n".join(f"step {i + 1}: {a:.6f} vs {b:.6f}" for i, (a, b) in enumerate(losses)))
    assert losses[-1][0] < losses[0][0]  # it learns
    for a, b in losses:
        assert abs(a - b) / abs(b) < TOL, losses


def test_interop_round_trip_loads_into_hugging_face(tmp_path):
    """HF -> simdist checkpoint (import) -> safetensors (export) -> HF: same tensors, and
    the exported file loads into BertForPreTraining with only the tied decoder missing."""
    from safetensors.numpy import load_file

    cfg = _config()
    hf = _hf_model(cfg, seed=2)
    _load_into_simdist(hf, cfg, tmp_path)
    out = interop.export(tmp_path / "bert.h5", tmp_path / "out.safetensors")
    back = load_file(str(out))
    state = hf.state_dict()
    for name, value in back.items():
        assert np.array_equal(value, state[name].numpy()), name
    hf2 = _hf_model(cfg, seed=3)
    missing, unexpected = hf2.load_state_dict(
        {k: torch.from_numpy(v) for k, v in back.items()}, strict=False
    )
    assert not unexpected
    assert set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    for name, p in hf2.state_dict().items():
        assert torch.equal(p, state[name]), name
