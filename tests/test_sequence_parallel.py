"""Sequence parallelism in tensor-parallel weight mode (``runconfig.sequence_parallel``):
gpt2-mini with the residual stream and LayerNorms on 1/N of the token rows tracks one rank
and tensor parallelism without it (1e-5 per step, as the weight-mode tests); a checkpoint
moves between the two; the activation arena shrinks by exactly the rows no longer held; the
group's collectives are reduce-scatters and all-gathers (a ring sends the bytes counted
here); bad input exits 2 and writes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_runs import assert_resume_identical, assert_same_state, runner
from mpi_launch import run_mpi
from test_tensor_parallel_weight import GPT2, STEPS, losses, tp
from test_train import final_state

from simdist.models.gpt2 import PRESETS
from simdist.models.gpt2_tp import GPT2TP, kernel_costs, position_runs

train = runner(GPT2)
SP = ["--sequence-parallel"]
MINI = PRESETS["gpt2-mini"]


# ------------------------------------------------------------------ serially
def rows_saved(B: int, n: int) -> int:
    """Arena elements a rank no longer holds: of the N = B T token rows it keeps N / n in
    encoded, dres, and per layer ln1, res2, ln2, res3 (C each) and the four LayerNorm
    statistics, plus ln_f's two; it adds one (N, C) all-gather buffer."""
    C, L, N = MINI.n_embd, MINI.n_layer, B * MINI.block_size
    gone = N - N // n
    return gone * C * (2 + 4 * L) + gone * (4 * L + 2) - N * C


@pytest.mark.parametrize(("B", "n"), [(4, 2), (4, 4), (2, 4)])
def test_activation_bytes_lose_the_other_ranks_rows(B, n):
    plain, seq = GPT2TP(MINI, n, 0), GPT2TP(MINI, n, 0, sequence_parallel=True)
    assert plain.activation_bytes(B) - seq.activation_bytes(B) == 4 * rows_saved(B, n)


def test_kernel_list_runs_the_layernorms_on_the_shard():
    """LayerNorm FLOPs are 1/n of the shard's without sequence parallelism, the GEMMs
    unchanged; the copies into the all-gather buffer are listed."""
    B, n = 4, 2
    plain = kernel_costs(MINI, n, B, MINI.block_size)
    seq = kernel_costs(MINI, n, B, MINI.block_size, sequence_parallel=True)

    def flops(costs, pick):
        return sum(k.flops * k.count for k in costs if pick(k.name))

    def is_ln(name: str) -> bool:
        return any(s in name for s in ("ln_1", "ln_2", "ln_f")) and "stage" not in name

    assert flops(seq, is_ln) * n == flops(plain, is_ln) > 0
    gemms = [k for k in plain if k.kind == "gemm"]
    assert gemms == [k for k in seq if k.kind == "gemm"]
    L = MINI.n_layer
    assert sum(k.name.endswith(".stage") for k in seq) == 2 * L + 4 * L + 1
    assert [k.done for k in plain if k.done] == [k.done for k in seq if k.done]


def test_position_runs():
    assert position_runs(0, 4, 8) == [(0, 4, 0)]
    assert position_runs(6, 5, 4) == [(0, 2, 2), (2, 5, 0)]
    assert position_runs(12, 12, 8) == [(0, 4, 4), (4, 12, 0)]


# ------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """50 steps of gpt2-mini at a global batch of 4, as the weight-mode tests: one rank;
    TP 2 without and with sequence parallelism; TP 4 with it; DP 2 x TP 2 with it."""
    root = tmp_path_factory.mktemp("sp")
    steps = [
        f"--runconfig.max_steps={STEPS}",
        f"--runconfig.save_checkpoints_steps={STEPS}",
        "--optimizer.learning_rate=3e-4",
    ]
    out = {}
    for key, n, args in (
        ("one", 1, ["--train_input.batch_size=4"]),
        ("tp2", 2, ["--train_input.batch_size=4", *tp(2)]),
        ("sp2", 2, ["--train_input.batch_size=4", *tp(2), *SP]),
        ("sp4", 4, ["--train_input.batch_size=4", *tp(4), *SP]),
        ("dp2sp2", 4, ["--train_input.batch_size=2", *tp(2), *SP]),
    ):
        d = root / key
        out[key] = (d, train(n, d, *steps, *args).stdout)
    return out


@pytest.mark.parametrize("key", ["sp2", "sp4", "dp2sp2"])
def test_sequence_parallel_tracks_one_rank_and_tp(runs, key):
    got = np.array(losses(runs[key][1]))
    assert len(got) == STEPS
    for ref in ("one", "tp2"):
        want = np.array(losses(runs[ref][1]))
        rel = np.abs(got - want) / np.abs(want)
        assert rel.max() <= 1e-5, (key, ref, int(rel.argmax()) + 1, float(rel.max()))
    assert "sequence parallel: 1/" in runs[key][1]


def test_arena_per_rank_shrinks_by_the_rows(runs):
    """performance.json's activation bytes: TP 2 minus TP 2 with sequence parallelism is
    the rows the rank no longer holds, on every rank."""
    mem = {
        k: [m["activations"] for m in json.loads((runs[k][0] / "performance.json").read_text())[
            "memory_bytes_per_rank"]]
        for k in ("tp2", "sp2")
    }  # fmt: skip
    assert len(set(mem["tp2"])) == len(set(mem["sp2"])) == 1
    assert mem["tp2"][0] - mem["sp2"][0] == 4 * rows_saved(4, 2)


def test_trace_has_the_reduce_scatters_and_all_gathers(runs):
    """Per step and rank: forward 2L + 1 reduce-scatters (blocks, embedding) and 2L + 2
    all-gathers (blocks, ln_f, the vocab-parallel maxima) with one all-reduce left (the
    cross-entropy's sums); backward 2L + 1 reduce-scatters and 4L + 1 all-gathers (the
    residual gradient, the LayerNorm outputs again, the embedding's)."""
    L = MINI.n_layer
    trace = json.loads((runs["sp2"][0] / "timeline.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = 3  # runconfig.trace_steps
    for pid in (0, 1):
        names = [e["name"] for e in events if e.get("pid") == pid and "name" in e]
        per_step = {n: names.count(n) / steps for n in set(names)}
        assert per_step["forward.reduce_scatter"] == 2 * L + 1
        assert per_step["forward.allgather"] == 2 * L + 2
        assert per_step["forward.allreduce"] == 1
        assert per_step["grad.reduce_scatter"] == 2 * L + 1
        assert per_step["grad.allgather"] == 4 * L + 1
        assert not any("params.allgather" in n for n in names)


def test_ring_bytes_of_sequence_parallelism(tmp_path):
    """With ring collectives a reduce-scatter plus an all-gather sends what an all-reduce
    sends: per step SP sends TP's bytes plus its 2L extra all-gathers (the LayerNorm
    outputs gathered again in backward) and the all-reduce of the row-share gradients."""
    args = ["--runconfig.max_steps=3", "--train_input.batch_size=4", *tp(2), "--algorithm=ring"]
    sent = {}
    for key, extra in (("tp", []), ("sp", SP)):
        train(2, tmp_path / key, *args, *extra)
        perf = json.loads((tmp_path / key / "performance.json").read_text())
        sent[key] = perf["tensor_parallel_bytes_sent_per_step"]
    C, L, N = MINI.n_embd, MINI.n_layer, 4 * MINI.block_size
    shares = 4 * L * C + 2 * C + MINI.block_size * C  # ln_1, ln_2, ln_f and wpe
    half = 1 / 2  # (n - 1) / n of a buffer leaves each rank per ring pass, n = 2
    assert sent["sp"] - sent["tp"] == half * 4 * (2 * L * N * C + 2 * shares)


def test_zero_levels_identical_with_sequence_parallelism(tmp_path):
    """DP 2 x TP 2 with SP: ZeRO-1 and ZeRO-2 (whose bucket reduce-scatters leave each rank
    its slice before the row-share gradients are summed over the group) end with ZeRO-0's
    parameters and state, bit for bit."""
    args = ["--runconfig.max_steps=4", "--train_input.batch_size=2", *tp(2), *SP]
    z0 = train(4, tmp_path / "z0", *args, "--zero_opt_level=0")
    for level in (1, 2):
        z = train(4, tmp_path / f"z{level}", *args, f"--zero_opt_level={level}")
        assert losses(z.stdout) == losses(z0.stdout)
        state = final_state(tmp_path / f"z{level}")
        assert_same_state(final_state(tmp_path / "z0"), state, f"ZeRO-{level}")


def test_checkpoint_moves_between_sequence_parallel_and_not(tmp_path):
    """Resumed with SP = uninterrupted with SP, bit for bit; the same checkpoint (written
    with SP) resumed without it continues as the SP run does (to 1e-5)."""
    args = ("--train_input.batch_size=2", *tp(2))
    resumed = assert_resume_identical(train, tmp_path, *args, *SP)
    ckpt = tmp_path / "res" / "checkpoint_3.h5"
    plain = train(
        2,
        tmp_path / "plain",
        *args,
        "--runconfig.max_steps=6",
        "--runconfig.mode=train",
        f"--runconfig.checkpoint_path={ckpt}",
    )
    assert "resumed from" in plain.stdout
    a, b = losses(plain.stdout), losses(resumed.stdout)
    assert len(a) == len(b) == 3
    assert np.allclose(a, b, rtol=1e-5, atol=0), (a, b)


@pytest.mark.parametrize(
    ("np_", "args", "message"),
    [
        (1, [*SP], "needs runconfig.tensor_parallel > 1 (this run: 1)"),
        (2, ["--tensor-parallel", "2", *SP], "tensor_parallel_mode weight (this run: batch)"),
        (2, ["--model.block_size=127", *tp(2), *SP],
         "sequence length (model.block_size, 127) to divide by runconfig.tensor_parallel=2"),
    ],
)  # fmt: skip
def test_bad_sequence_parallel_input_exits_2_and_writes_nothing(tmp_path, np_, args, message):
    d = tmp_path / "run"
    cmd = ["-m", "simdist.train", *GPT2, f"--runconfig.model_dir={d}", "--runconfig.max_steps=2"]
    out = run_mpi(np_, [*cmd, *args], timeout=240)
    assert out.returncode == 2, out.stdout
    assert message in out.stdout
    assert "runconfig.sequence_parallel" in out.stdout
    assert not d.exists()
