"""simdist's GPT-2 vs a PyTorch GPT-2 (simdist.testing.torch_reference), same weights, batch.

The PyTorch model uses Hugging Face's GPT-2 parameter names and layouts (Conv1D weights are
(in, out)), so the weights load by name with ``load_state_dict(strict=True)``: that also
checks simdist's names and shapes. Error measure per tensor: max|a - b| / max|b| (b =
PyTorch); every gradient must be within 1e-4. The worst tensor is printed (``pytest -s``).
"""

import numpy as np
import pytest

from simdist.arena import Layout
from simdist.config import OptimizerConfig
from simdist.models.base import GradientViews
from simdist.models.gpt2 import GPT2, PRESETS
from simdist.optim import Optimizer

torch = pytest.importorskip("torch")
TorchGPT2 = pytest.importorskip("simdist.testing.torch_reference").TorchGPT2

TOL = 1e-4


def rel(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def _setup(cfg, B, T, seed=0):
    model = GPT2(cfg)
    layout = Layout(model.parameter_specs(), world=1)
    params_flat = np.zeros(layout.padded, np.float32)
    grads_flat = np.zeros(layout.padded, np.float32)
    params, grads = layout.views(params_flat), GradientViews(layout.views(grads_flat))
    rng = np.random.default_rng(seed)
    model.init_parameters(params, rng)
    for spec in model.parameter_specs():
        if len(spec.shape) == 1:  # non-trivial biases and norm parameters
            params[spec.name] += rng.standard_normal(spec.shape, dtype=np.float32) * 0.1
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    torch_model = TorchGPT2(cfg)
    torch_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in params.items()})
    return model, layout, params_flat, grads_flat, params, grads, tokens, targets, torch_model


@pytest.mark.parametrize("B,T", [(4, 64), (3, 37), (2, 128)])
def test_loss_and_gradients_match_pytorch(B, T):
    torch.manual_seed(0)
    cfg = PRESETS["gpt2-mini"]
    model, _, _, _, params, grads, tokens, targets, tm = _setup(cfg, B, T)
    model.allocate(B)
    for g in grads.values():
        g.fill(np.nan)  # backward must overwrite every gradient
    loss = model.forward(params, tokens, targets)
    model.backward(params, grads, 1.0 / B)

    tloss = tm(torch.from_numpy(tokens).long(), torch.from_numpy(targets).long())
    tloss.backward()
    assert abs(loss - tloss.item()) / abs(tloss.item()) < 1e-6
    errs = {name: rel(grads[name], p.grad.numpy()) for name, p in tm.named_parameters()}
    worst = max(errs, key=errs.get)
    print(
        f"\nB={B} T={T}: loss {loss:.7f} vs {tloss.item():.7f}; worst gradient {worst} "
        f"rel err {errs[worst]:.2e}"
    )
    assert set(errs) == set(grads)
    assert errs[worst] < TOL, errs


def test_adamw_step_matches_pytorch():
    """One AdamW step through simdist's optimizer on the model's flat buffer, decay by spec.

    Both optimizers get the same gradient bits (simdist's), so this checks the weight-decay
    grouping (nanoGPT's: decay iff ndim >= 2) and the update arithmetic, not the gradients
    again (an element whose gradient is ~eps would amplify a 1e-6 gradient difference).
    """
    cfg = PRESETS["gpt2-mini"]
    B, T = 2, 32
    model, layout, pflat, gflat, params, grads, tokens, targets, tm = _setup(cfg, B, T, seed=1)
    model.allocate(B)
    model.forward(params, tokens, targets)
    model.backward(params, grads, 1.0 / B)
    ocfg = OptimizerConfig(learning_rate=1e-3, weight_decay=0.1)

    def alloc(kind, name, n):
        return np.zeros(n, np.float32)

    opt = Optimizer(ocfg, layout, 0, layout.padded, alloc)
    opt.step(pflat, gflat, 1, ocfg.learning_rate)

    # the same gradients (bit for bit) into PyTorch, nanoGPT's grouping: decay iff dim >= 2
    named = dict(tm.named_parameters())
    for name, p in named.items():
        p.grad = torch.from_numpy(grads[name].copy())
    decay = [p for p in named.values() if p.dim() >= 2]
    no_decay = [p for p in named.values() if p.dim() < 2]
    topt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        foreach=False,
    )
    before = {name: p.detach().numpy().copy() for name, p in named.items()}
    topt.step()
    # Parameters after the step, max|a - b| / max|b| per tensor. A wrong decay group would
    # show as lr * wd = 1e-4 relative; the update itself is ~lr = 1e-3 of weights ~0.02..1.
    errs = {name: rel(params[name], p.detach().numpy()) for name, p in named.items()}
    worst = max(errs, key=errs.get)
    print(f"\nAdamW: worst parameter rel err {errs[worst]:.2e} ({worst})")
    assert all(not np.array_equal(params[n], before[n]) for n in named)  # every tensor moved
    assert errs[worst] < 1e-6, errs
