"""Learning-rate schedules: each scheduler's formula, the sequence, warmup, bad input."""

from __future__ import annotations

import math

import pytest

from simdist.lr_schedule import ScheduleError, parse_schedule


def test_number_is_constant():
    s = parse_schedule(3e-4)
    assert [s(i) for i in (0, 1, 10**6)] == [3e-4] * 3
    assert s.is_constant and s.total_steps is None


def test_sequence_counts_each_scheduler_from_zero():
    s = parse_schedule(
        [
            {
                "scheduler": "Linear",
                "initial_learning_rate": 0.0,
                "end_learning_rate": 1.0,
                "total_iters": 4,
            },
            {
                "scheduler": "CosineDecay",
                "initial_learning_rate": 1.0,
                "end_learning_rate": 0.1,
                "total_iters": 10,
            },
            {"scheduler": "Constant", "learning_rate": 0.05},
        ],
        max_steps=100,
    )
    assert [s(i) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert s(4 + 5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert s(14) == 0.05 and s(99) == 0.05


def test_closed_schedule_holds_its_last_rate():
    s = parse_schedule(
        [
            {
                "scheduler": "LinearLR",
                "initial_learning_rate": 1.0,
                "end_learning_rate": 0.5,
                "total_iters": 2,
            }
        ]
    )
    assert [s(i) for i in range(4)] == [1.0, 0.75, 0.5, 0.5]


def test_exponential_and_piecewise():
    e = parse_schedule(
        [
            {
                "scheduler": "ExponentialDecay",
                "initial_learning_rate": 1.0,
                "decay_rate": 0.5,
                "decay_steps": 2,
            }
        ]
    )
    assert [e(i) for i in range(5)] == pytest.approx([1.0, 0.5**0.5, 0.5, 0.5**1.5, 0.25])
    st = parse_schedule(
        [
            {
                "scheduler": "exponentialdecay",
                "initial_learning_rate": 1.0,
                "decay_rate": 0.5,
                "decay_steps": 2,
                "staircase": True,
            }
        ]
    )
    assert [st(i) for i in range(5)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    p = parse_schedule(
        [{"scheduler": "PiecewiseConstant", "values": [3.0, 2.0, 1.0], "milestones": [2, 5]}]
    )
    assert [p(i) for i in range(7)] == [3.0, 3.0, 2.0, 2.0, 2.0, 1.0, 1.0]


def test_warmup_shortcut_ramps_to_the_first_rate():
    s = parse_schedule(0.4, warmup_steps=4)
    assert [s(i) for i in range(6)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.4], abs=1e-15)


@pytest.mark.parametrize(
    "lr, kwargs, message",
    [
        (float("nan"), {}, "finite number > 0"),
        (-1e-3, {}, "finite number > 0"),
        ([], {}, "non-empty list"),
        ([{"scheduler": "Warp"}], {}, "unknown scheduler 'Warp'"),
        (
            [{"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1.0}],
            {},
            "missing 'total_iters'",
        ),
        (
            [
                {"scheduler": "Constant", "learning_rate": 1.0},
                {"scheduler": "Constant", "learning_rate": 0.5},
            ],
            {},
            "[0]: only the last scheduler may leave",
        ),
        (
            [{"scheduler": "Constant", "learning_rate": float("inf"), "total_iters": 5}],
            {},
            "[0].learning_rate: a learning rate must be finite",
        ),
        (
            [{"scheduler": "Constant", "learning_rate": 1.0, "total_iters": 5, "decay": 1}],
            {},
            "unknown key 'decay'",
        ),
        (
            [{"scheduler": "Constant", "learning_rate": 1.0, "total_iters": 0}],
            {},
            "total_iters: expected a whole number of steps >= 1",
        ),
        (
            [{"scheduler": "Constant", "learning_rate": 1.0, "total_iters": 5}],
            {"max_steps": 6},
            "add up to 5, fewer than runconfig.max_steps = 6",
        ),
        (
            [{"scheduler": "PiecewiseConstant", "values": [1.0], "milestones": [3]}],
            {},
            "1 values for 1 milestones",
        ),
        (
            [{"scheduler": "PiecewiseConstant", "values": [1.0, 2, 3], "milestones": [3, 3]}],
            {},
            "must increase strictly",
        ),
        (
            [
                {
                    "scheduler": "ExponentialDecay",
                    "initial_learning_rate": 1.0,
                    "decay_rate": 0,
                    "total_iters": 3,
                }
            ],
            {},
            "decay_rate: expected a finite number > 0",
        ),
        (1e-3, {"warmup_steps": -1}, "optimizer.warmup_steps"),
    ],
)
def test_bad_schedules_name_the_key(lr, kwargs, message):
    with pytest.raises(ScheduleError) as e:
        parse_schedule(lr, **kwargs)
    assert message in str(e.value)
    assert str(e.value).startswith(("optimizer.learning_rate", "optimizer.warmup_steps"))


def test_matches_pytorch_schedulers():
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    ref = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=5),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=0.01),
        ],
        milestones=[5],
    )
    ours = parse_schedule(
        [
            {
                "scheduler": "Linear",
                "initial_learning_rate": 0.1,
                "end_learning_rate": 1.0,
                "total_iters": 5,
            },
            {
                "scheduler": "CosineDecay",
                "initial_learning_rate": 1.0,
                "end_learning_rate": 0.01,
                "total_iters": 20,
            },
        ]
    )
    got = []
    for _ in range(25):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert [ours(i) for i in range(25)] == pytest.approx(got, rel=1e-9, abs=1e-12)


SCHEDULE = (
    "--optimizer.learning_rate=[{scheduler: CosineDecay, initial_learning_rate: 0.004,"
    " end_learning_rate: 0.0004, total_iters: 16}, {scheduler: Constant, learning_rate: 0.0004}]"
)


def test_training_follows_the_schedule_and_resumes_exactly(tmp_path):
    """A warmed-up cosine schedule in a 2-rank run: TensorBoard gets each summary step's rate,
    and a run resumed at step 10 ends bitwise where the uninterrupted one does."""
    import numpy as np
    from test_train import final_state, train

    from simdist.events import read_events

    args = [
        "--runconfig.mode=train",
        "--runconfig.save_checkpoints_steps=10",
        SCHEDULE,
        "--optimizer.warmup_steps=4",
        "--zero_opt_level=1",
    ]
    train(2, tmp_path / "full", *args, "--runconfig.max_steps=25")
    train(2, tmp_path / "resumed", *args, "--runconfig.max_steps=10")
    train(2, tmp_path / "resumed", *args, "--runconfig.max_steps=25")
    a, b = final_state(tmp_path / "full"), final_state(tmp_path / "resumed")
    for which in (0, 1):
        for k in a[which]:
            assert np.array_equal(a[which][k], b[which][k]), k
    schedule = parse_schedule(
        [
            {
                "scheduler": "CosineDecay",
                "initial_learning_rate": 0.004,
                "end_learning_rate": 0.0004,
                "total_iters": 16,
            },
            {"scheduler": "Constant", "learning_rate": 0.0004},
        ],
        warmup_steps=4,
    )
    (events,) = (tmp_path / "full").glob("events.out.tfevents.*")
    logged = {step: v for step, tag, v in read_events(events) if tag == "learning_rate"}
    assert sorted(logged) == [5, 10, 15, 20, 25]
    # a summary at global step n reports the rate step n was taken with (index n - 1)
    assert [logged[n] for n in sorted(logged)] == pytest.approx(
        [schedule(n - 1) for n in sorted(logged)], rel=1e-6
    )
    assert logged[5] == pytest.approx(0.004) and logged[25] == pytest.approx(0.0004)


def test_schedule_that_does_not_cover_the_run_is_refused(tmp_path):
    from test_train import train

    out = train(
        1,
        tmp_path / "m",
        "--runconfig.max_steps=30",
        SCHEDULE.replace(", {scheduler: Constant, learning_rate: 0.0004}", ""),
        check=False,
    )
    assert out.returncode == 2
    assert "add up to 16, fewer than runconfig.max_steps = 30" in out.stdout + out.stderr
    assert not (tmp_path / "m").exists()
