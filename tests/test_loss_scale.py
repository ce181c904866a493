"""Dynamic loss scaling: GradScaler's scales and skipped steps, hysteresis, bad input."""

from __future__ import annotations

import pytest

from simdist.loss_scale import LossScaleConfig, LossScaler

# steps whose gradients overflow, in a run of 40 steps with a growth interval of 4
OVERFLOWS = {0, 1, 7, 8, 9, 20, 33}


def _drive(scaler: LossScaler, steps: int = 40) -> list[tuple[float, bool]]:
    out = []
    for i in range(steps):
        scale = scaler.scale
        out.append((scale, scaler.update(i in OVERFLOWS)))
    return out


def test_same_scales_and_skips_as_torch_grad_scaler():
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=4)
    want = []
    for i in range(40):
        opt.zero_grad()
        scale = ref.get_scale()
        loss = ref.scale(w.sum() * (float("inf") if i in OVERFLOWS else 1.0))
        loss.backward()
        ref.step(opt)
        applied = not torch.isinf(w.grad).any().item()  # GradScaler skipped the step if not
        ref.update()
        want.append((scale, applied))
    got = _drive(LossScaler(LossScaleConfig(growth_interval=4)))
    assert got == want
    assert [s for s, _ in got][:3] == [2.0**16, 2.0**15, 2.0**14]


def test_hysteresis_and_min_scale_as_deepspeed():
    s = LossScaler(
        LossScaleConfig(initial_scale=8.0, growth_interval=100, hysteresis=2, min_scale=2.0)
    )
    applied = [s.update(True) for _ in range(4)]
    assert applied == [False] * 4 and s.skipped_steps == 4
    # the first overflow spends the tolerance; every one after it halves, down to min_scale
    assert s.scale == 2.0


def test_static_scale_skips_overflowing_steps_without_changing():
    s = LossScaler(LossScaleConfig(dynamic=False, initial_scale=1024.0))
    assert [x for x, _ in _drive(s)] == [1024.0] * 40
    assert s.skipped_steps == len(OVERFLOWS)


def test_state_round_trip_resumes_exactly():
    a = LossScaler(LossScaleConfig(growth_interval=4))
    _drive(a, 15)
    b = LossScaler(LossScaleConfig(growth_interval=4))
    b.load(a.state())
    for i in range(15, 40):
        assert (a.scale, a.update(i in OVERFLOWS)) == (b.scale, b.update(i in OVERFLOWS))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"initial_scale": 0.0}, "initial_scale"),
        ({"initial_scale": -1.0}, "initial_scale"),
        ({"initial_scale": float("inf")}, "initial_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": float("nan")}, "min_scale"),
    ],
)
def test_bad_scaler_config_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"runconfig.loss_scale.{key}: must be"):
        LossScaler(LossScaleConfig(**kwargs))
