"""simdist's T5 vs Hugging Face ``T5ForConditionalGeneration``: same weights, same batches.

The Hugging Face model is built from a ``T5Config`` of t5-mini's shapes with random weights
(nothing is downloaded), dropout off, and its state dict goes into simdist through the
interop path (safetensors -> ``import`` -> checkpoint). Error measure per tensor:
max|a - b| / max|b| (b = PyTorch). Skipped without torch or transformers.

Gradients are compared with the same Hugging Face model run in float64 (the float32
weights upcast exactly): T5's N(0, 1) embeddings and unscaled scores make PyTorch's own
float32 gradients drift from float64 by up to ~5e-4 (the bias table's gradient sums
B T^2 scores per head; a ReLU input near 0 flips), while simdist's stay within ~3e-6 of
float64. The loss is compared with the float32 run as well.

A ReLU input within float32 rounding of 0 may land on either side in any float32 run (with
millions of inputs a step, one or two such ties are expected, their sign set by the CPU's
rounding), and a flip moves one gradient row by ~5e-4. So the float64 reference takes
simdist's ReLU decision where the two disagree, and the test asserts each disagreement is
such a tie (``_RELU_TIE``): a mask that differs anywhere else still fails.
"""

from pathlib import Path

import numpy as np
import pytest

from simdist import interop
from simdist.config import OptimizerConfig
from simdist.data.t5 import PAD, T5Data
from simdist.data.text import load_corpus_bytes
from simdist.models.t5 import T5, resolve_config
from simdist.optim import Optimizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from simdist.testing.hf_reference import hf_t5, load_into_simdist, t5_inputs  # noqa: E402

TOL = 1e-4
_RELU_TIE = 1e-6  # |float64 ReLU input| / max |input| of its layer below which float32 may flip


class _ReluWithDecisions(torch.nn.Module):
    """ReLU whose mask follows ``decisions`` (simdist's, float32: input > 0) where the
    float64 input disagrees; records each disagreement's relative size in ``ties``."""

    def __init__(self, decisions: list[np.ndarray], ties: list[float]):
        super().__init__()
        self.decisions, self.ties = decisions, ties

    def forward(self, h):
        ours = torch.from_numpy(self.decisions.pop(0).reshape(h.shape))
        theirs = h > 0
        differ = ours != theirs
        scale = float(h.abs().max())
        self.ties.extend((h[differ].abs() / scale).tolist())
        return h * torch.where(differ, ours, theirs).to(h.dtype)


def _record_relu_inputs(monkeypatch) -> list[np.ndarray]:
    """simdist's ReLU decisions (input > 0), one array per call in forward order."""
    import simdist.models.t5 as t5

    seen: list[np.ndarray] = []
    forward = t5.relu_forward

    def recording(out, inp):
        seen.append(np.asarray(inp) > 0)
        forward(out, inp)

    monkeypatch.setattr(t5, "relu_forward", recording)
    return seen


def rel(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def _hf_model(cfg, seed: int):
    m = hf_t5(cfg, seed)
    with torch.no_grad():  # non-trivial layer norms (HF initialises them to 1)
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m.double().float()  # a fresh float32 copy


def _batch(cfg, B: int, start: int = 0):
    data = T5Data(load_corpus_bytes(), cfg.max_seq_length, B, "")
    x, y = data.train_batch(np.arange(B) * 7 + start)
    x, y = x.copy(), y.copy()
    x[0, cfg.max_seq_length - 9 : cfg.max_seq_length] = PAD  # padding: the key mask matters
    return x, y


def _load_into_simdist(hf, cfg, tmp: Path):
    model = T5(cfg)
    return (model, *load_into_simdist(hf, model, "t5", tmp))


def _config(**kw):
    return resolve_config("t5-mini", dropout_rate=0.0, **kw)


@pytest.mark.parametrize("ffn", ["relu", "gated-gelu"])
def test_loss_and_every_gradient_match_hugging_face(tmp_path, ffn, monkeypatch):
    # transformers 5 always ties the head (an untied simdist head is checked against
    # central differences in test_t5.py)
    cfg = _config(feed_forward_proj=ffn)
    B = 4
    hf = _hf_model(cfg, seed=0)
    model, _, _, _, params, grads = _load_into_simdist(hf, cfg, tmp_path)
    x, y = _batch(cfg, B)
    model.allocate(B)
    for g in grads.values():
        g.fill(np.nan)  # backward must overwrite every gradient
    decisions = _record_relu_inputs(monkeypatch)
    loss = model.forward(params, x, y)
    model.backward(params, grads, 1.0 / B)

    loss32 = hf(**t5_inputs(x, y, cfg.max_seq_length)).loss.item()
    hf64 = hf.double()
    ties: list[float] = []
    if ffn == "relu":
        kind = type(hf64.encoder.block[0].layer[-1].DenseReluDense)
        ffns = [m for m in hf64.modules() if isinstance(m, kind)]  # encoder, then decoder
        assert len(decisions) == len(ffns) == cfg.num_layers + cfg.num_decoder_layers
        for m in ffns:
            m.act = _ReluWithDecisions(decisions, ties)
    out = hf64(**t5_inputs(x, y, cfg.max_seq_length))
    out.loss.backward()
    assert not decisions, "simdist and Hugging Face ran different numbers of ReLUs"
    assert all(t < _RELU_TIE for t in ties), f"ReLU masks differ beyond a tie: {ties}"
    assert abs(loss - loss32) / abs(loss32) < 1e-5, (loss, loss32)
    assert abs(loss - out.loss.item()) / abs(out.loss.item()) < 1e-5, (loss, out.loss.item())
    named = {n: p for n, p in hf64.named_parameters() if n in grads}
    assert set(named) == set(grads)
    errs = {name: rel(grads[name], p.grad.numpy()) for name, p in named.items()}
    worst = max(errs, key=errs.get)
    print(f"\nloss {loss:.7f} vs {loss32:.7f} (float32), {out.loss.item():.7f} (float64); "
          f"worst {worst} rel err {errs[worst]:.2e}")  # fmt: skip
    assert errs[worst] < TOL, {k: v for k, v in errs.items() if v >= TOL}


def test_ten_adamw_steps_match_hugging_face(tmp_path):
    cfg = _config()
    B = 4
    hf = _hf_model(cfg, seed=1)
    model, layout, pflat, gflat, params, grads = _load_into_simdist(hf, cfg, tmp_path)
    data = T5Data(load_corpus_bytes(), cfg.max_seq_length, B, "")
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
        tl = hf(**t5_inputs(x, y, cfg.max_seq_length)).loss
        tl.backward()
        topt.step()
        losses.append((loss, tl.item()))
    print("\n" + "\n".join(f"step {i + 1}: {a:.6f} vs {b:.6f}" for i, (a, b) in enumerate(losses)))
    assert losses[-1][0] < losses[0][0]  # it learns
    for a, b in losses:
        assert abs(a - b) / abs(b) < TOL, losses


def test_interop_round_trip_loads_into_hugging_face(tmp_path):
    """HF -> simdist checkpoint (import) -> safetensors (export) -> HF: same tensors, and
    the exported file loads into T5ForConditionalGeneration with only tied copies missing."""
    from safetensors.numpy import load_file

    cfg = _config()
    hf = _hf_model(cfg, seed=2)
    _load_into_simdist(hf, cfg, tmp_path)
    out = interop.export(tmp_path / "t5.h5", tmp_path / "out.safetensors")
    back = load_file(str(out))
    state = hf.state_dict()
    for name, value in back.items():
        assert np.array_equal(value, state[name].numpy()), name
    hf2 = _hf_model(cfg, seed=3)
    missing, unexpected = hf2.load_state_dict(
        {k: torch.from_numpy(v) for k, v in back.items()}, strict=False
    )
    assert not unexpected
    tied = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    assert set(missing) <= tied, missing
    for name, p in hf2.state_dict().items():
        assert torch.equal(p, state[name]), name
