"""scripts/bench_train.py's PyTorch side trains with the preset's optimizer step: the same
AdamW hyperparameters and, where the preset clips the gradient's global norm, the clip."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def bench_train(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPTS / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_train", mod)
    spec.loader.exec_module(mod)
    return mod


def test_pytorch_clips_and_steps_as_the_preset_does(bench_train):
    torch = pytest.importorskip("torch")
    from simdist.config import load_params

    for model, preset in (("gpt2-mini", "gpt2_mini"), ("fc_mnist", "fc_mnist")):
        o = load_params(["--params", preset]).optimizer
        net = torch.nn.Linear(8, 4)
        opt, clip = bench_train.torch_optimizer(model, net)
        group = opt.param_groups[0]
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
            o.learning_rate, (o.beta1, o.beta2), o.eps, o.weight_decay,
        )  # fmt: skip
        assert group["fused"]
        for p in net.parameters():
            p.grad = torch.full_like(p, 10.0)  # global norm 10 * sqrt(36) = 60
        clip()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in net.parameters()))
        if o.max_gradient_norm is None:  # FC-MNIST's preset clips nothing
            assert norm.item() == pytest.approx(60.0)
        else:
            assert o.max_gradient_norm == 1.0
            assert norm.item() == pytest.approx(1.0, rel=1e-5)
