"""Tensor parallelism in weight mode (``runconfig.tensor_parallel_mode: weight``): gpt2-mini
split Megatron-style over 2 and 4 ranks, alone and under data parallelism, tracks one rank
per step (Megatron reorders sums, so not bitwise); ZeRO-1 and -2 equal ZeRO-0 bit for bit on the
data-parallel axis; resume, reshard and the errors; per-rank memory follows the split."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from model_runs import assert_resume_identical, assert_same_state, runner
from mpi_launch import REPO, run_mpi
from test_train import final_state

from simdist.arena import ALIGN
from simdist.models.gpt2 import PRESETS, parameter_specs
from simdist.models.gpt2_tp import extract, insert, shard_index, shard_specs

GPT2 = [
    "--params=gpt2_mini",
    "--runconfig.save_summary_steps=1",
    "--runconfig.progress_bar=false",
    "--runconfig.mode=train",
]
WEIGHT = ["--runconfig.tensor_parallel_mode=weight"]
train = runner(GPT2)
train_and_eval = runner(GPT2[:-1])  # + eval.json
STEPS = 50


def losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"global_step = \d+, loss = ([0-9.e+-]+)", stdout)]


PP2 = ["--train_input.batch_size=1", "--optimizer.grad_accum_steps=2", "--pipeline-parallel=2"]


def tp(n: int) -> list[str]:
    return ["--tensor-parallel", str(n), *WEIGHT]


# ------------------------------------------------------------------ the split, serially
def test_shards_cover_the_model_once():
    """Every rank's slices put back together give the whole tensors; the shard's shapes
    are the whole model's with heads, MLP columns and vocabulary divided."""
    cfg = PRESETS["gpt2-mini"]
    rng = np.random.default_rng(0)
    whole = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in parameter_specs(cfg)}
    for T in (2, 4):
        specs = {s.name: s.shape for s in shard_specs(cfg, T)}
        back = {k: np.zeros_like(v) for k, v in whole.items()}
        for t in range(T):
            for name, split in shard_index(cfg, T, t).items():
                part = extract(whole[name], split)
                assert part.shape == specs[name], name
                insert(back[name], part, split)
        assert all(np.array_equal(back[k], whole[k]) for k in whole)
    assert specs["wte.weight"] == (64, 256)
    assert specs["h.0.attn.c_attn.weight"] == (256, 3 * 64)
    assert specs["h.0.mlp.c_proj.weight"] == (256, 256)
    assert specs["h.0.mlp.c_proj.bias"] == (256,)  # row-parallel bias: replicated


# ------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """50 steps of gpt2-mini at a global batch of 4: one rank; TP 2 at np 2; TP 4 at np 4;
    DP 2 x TP 2 at np 4 (2 sequences per replica); DP 2 x TP 2 x PP 2 at np 8
    (oversubscribed; 2 micro-batches of 1 per replica through the 1F1B pipeline). Learning
    rate 3e-4: at the preset's 1e-3 this batch trains on the edge of stability (loss
    spikes), where Adam amplifies any reordered sum (data parallelism's too) past 1e-5
    within 50 steps (README)."""
    root = tmp_path_factory.mktemp("tpw")
    steps = [
        f"--runconfig.max_steps={STEPS}",
        f"--runconfig.save_checkpoints_steps={STEPS}",
        "--optimizer.learning_rate=3e-4",
    ]
    out = {}
    for key, n, args, launch in (
        # eval: the first 64 held-out sequences, 4 batches on one replica, 2 on each of two
        ("one", 1, ["--train_input.batch_size=4", "--runconfig.eval_steps=4"], train_and_eval),
        ("tp2", 2, ["--train_input.batch_size=4", *tp(2)], train),
        ("tp4", 4, ["--train_input.batch_size=4", *tp(4)], train),
        (
            "dp2tp2",
            4,
            ["--train_input.batch_size=2", "--runconfig.eval_steps=2", *tp(2)],
            train_and_eval,
        ),
        ("dp2tp2pp2", 8, [*PP2, *tp(2)], train),
    ):
        d = root / key
        res = launch(n, d, *steps, *args)
        out[key] = (d, res.stdout)
    return out


@pytest.mark.parametrize("key", ["tp2", "tp4", "dp2tp2", "dp2tp2pp2"])
def test_weight_mode_tracks_one_rank_per_step(runs, key):
    want = losses(runs["one"][1])
    got = losses(runs[key][1])
    assert len(got) == len(want) == STEPS
    rel = np.abs(np.array(got) - np.array(want)) / np.abs(np.array(want))
    assert rel.max() <= 1e-5, (key, int(rel.argmax()) + 1, float(rel.max()))
    assert "tensor parallel (weight mode)" in runs[key][1]


def test_eval_matches_one_rank(runs):
    """The vocab-parallel loss and argmax over the held-out set, split over the replicas."""
    one = json.loads((runs["one"][0] / "eval.json").read_text())
    tp = json.loads((runs["dp2tp2"][0] / "eval.json").read_text())
    assert tp["eval_samples"] == one["eval_samples"] == 64
    assert abs(tp["loss"] - one["loss"]) <= 1e-5 * one["loss"], (tp, one)
    assert abs(tp["accuracy"] - one["accuracy"]) <= 1e-4, (tp, one)  # argmax near-ties


def shard_numel(T: int) -> int:
    """The split formula: V C / T + n_ctx C + L (12 C^2 / T + 7 C / T + 6 C) + 2 C."""
    c = PRESETS["gpt2-mini"]
    C, L, V, P = c.n_embd, c.n_layer, c.vocab_size, c.block_size
    return V * C // T + P * C + L * (12 * C * C // T + 7 * C // T + 6 * C) + 2 * C


@pytest.mark.parametrize(("key", "T", "D"), [("tp2", 2, 1), ("tp4", 4, 1), ("dp2tp2", 2, 2)])
def test_per_rank_memory_follows_the_split(runs, key, T, D):
    """Parameters, gradients and AdamW state of every rank: 4, 4 and 8 bytes per element
    of its shard (padded to the data-parallel slices), ZeRO-0."""
    perf = json.loads((runs[key][0] / "performance.json").read_text())
    n = shard_numel(T)
    padded = -(-n // (D * ALIGN)) * (D * ALIGN)
    assert perf["parameters_per_rank"] == n
    assert perf["parameters"] == sum(s.numel for s in parameter_specs(PRESETS["gpt2-mini"]))
    assert perf["world_size"] == T * D and perf["tensor_parallel"] == T
    assert len(perf["memory_bytes_per_rank"]) == T * D
    for mem in perf["memory_bytes_per_rank"]:
        assert mem["parameters"] == 4 * padded
        assert mem["gradients"] == 4 * padded
        assert mem["optimizer_state"] == 8 * padded
    assert perf["tensor_parallel_bytes_sent_per_step"] > 0
    # every rank's trace has the group's all-reduces
    trace = json.loads((runs[key][0] / "timeline.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e.get("pid") for e in events if e.get("name") == "forward.allreduce"}
    assert len(pids) == T * D


def test_pipeline_rank_memory_is_its_stage_of_its_shard(runs):
    """DP 2 x TP 2 x PP 2: every rank accounts 4 bytes per parameter of its stage's range
    of the shard's flat layout (the last stage also its copy of the tied wte shard), 4 per
    gradient twice (the step's sum and the micro-batch's), 8 of Adam state (ZeRO-0); the
    two shards of a stage alike; the stages' ranges cover the shard once."""
    perf = json.loads((runs["dp2tp2pp2"][0] / "performance.json").read_text())
    T, P, n = 2, 2, shard_numel(2)
    assert perf["world_size"] == 8 and perf["replicas"] == 2 and perf["tensor_parallel"] == T
    assert perf["tensor_parallel_mode"] == "weight" and perf["parameters_per_rank"] == n
    split = perf["pipeline_split"]
    assert sum(x["parameters"] for x in split) == n
    c = PRESETS["gpt2-mini"]
    tied = c.vocab_size * c.n_embd // T
    for r, mem in enumerate(perf["memory_bytes_per_rank"]):
        s = (r // T) % P
        a, b = split[s]["flat_range"]
        assert mem["parameters"] == 4 * (b - a + (tied if s == P - 1 else 0)), r
        assert mem["optimizer_state"] == 8 * (b - a), r
        assert mem["gradients"] >= 2 * 4 * (b - a), r
    assert perf["tensor_parallel_bytes_sent_per_step"] > 0
    assert min(perf["est_group_collectives_s"]) > 0


def test_zero_levels_identical_on_the_data_parallel_axis(tmp_path):
    """DP 2 x TP 2: ZeRO-1 and ZeRO-2 end with ZeRO-0's parameters and state, bit for bit."""
    args = ["--runconfig.max_steps=4", "--train_input.batch_size=2", *tp(2)]
    z0 = train(4, tmp_path / "z0", *args, "--zero_opt_level=0")
    for level in (1, 2):
        z = train(4, tmp_path / f"z{level}", *args, f"--zero_opt_level={level}")
        assert losses(z.stdout) == losses(z0.stdout)
        state = final_state(tmp_path / f"z{level}")
        assert_same_state(final_state(tmp_path / "z0"), state, f"ZeRO-{level}")


def test_resume_and_reshard(tmp_path):
    """Resumed at TP 2 = uninterrupted, bit for bit; TP 4 refuses the TP-2 checkpoint
    until it is resharded, then continues as TP 2 does (to 1e-5). A batch-mode run at the
    same degree refuses the weight-mode checkpoint too (and weight mode a batch-mode one),
    naming runconfig.tensor_parallel_mode and the reshard command, which then works."""
    args = ("--train_input.batch_size=2", *tp(2))
    assert_resume_identical(train, tmp_path, *args)
    ckpt = tmp_path / "res" / "checkpoint_6.h5"
    more = ["--runconfig.max_steps=9", "--train_input.batch_size=2"]
    res = f"--runconfig.model_dir={tmp_path / 'res'}"
    refused = run_mpi(4, ["-m", "simdist.train", *GPT2, res, *more, *tp(4)], timeout=240)
    assert refused.returncode == 2, refused.stdout
    assert "written with runconfig.tensor_parallel=2, this run has 4" in refused.stdout
    assert "python -m simdist.checkpoint reshard" in refused.stdout
    out = tmp_path / "tp4.h5"
    cmd = [sys.executable, "-m", "simdist.checkpoint", "reshard", str(ckpt), str(out),
           "--tensor-parallel", "4"]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    four = train(4, tmp_path / "four", *more, *tp(4), f"--runconfig.checkpoint_path={out}")
    two = train(2, tmp_path / "two", *more, *tp(2), f"--runconfig.checkpoint_path={ckpt}")
    assert "resumed from" in four.stdout and "global_step = 9" in four.stdout
    a, b = losses(four.stdout), losses(two.stdout)
    assert len(a) == len(b) == 3
    assert np.allclose(a, b, rtol=1e-5, atol=0), (a, b)
    # the mode, at the same degree: refused both ways until resharded with the mode
    batch = ["--tensor-parallel", "2", "--runconfig.tensor_parallel_mode=batch"]
    bdir = tmp_path / "batch"
    from_weight = [f"--runconfig.checkpoint_path={ckpt}", f"--runconfig.model_dir={bdir}"]
    refused = run_mpi(2, ["-m", "simdist.train", *GPT2, *more, *batch, *from_weight], 240)
    assert refused.returncode == 2, refused.stdout
    assert (
        "written with runconfig.tensor_parallel_mode=weight, this run has batch" in refused.stdout
    )
    assert f"reshard {ckpt} OUT --tensor-parallel 2 --tensor-parallel-mode batch" in refused.stdout
    assert not bdir.exists()  # refused before anything is written
    as_batch = tmp_path / "batch.h5"
    cmd = [sys.executable, "-m", "simdist.checkpoint", "reshard", str(ckpt), str(as_batch),
           "--tensor-parallel", "2", "--tensor-parallel-mode", "batch"]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    back = [f"--runconfig.checkpoint_path={as_batch}", f"--runconfig.model_dir={tmp_path / 'w'}"]
    refused = run_mpi(2, ["-m", "simdist.train", *GPT2, *more, *tp(2), *back], 240)
    assert refused.returncode == 2, refused.stdout
    assert "runconfig.tensor_parallel_mode=batch, this run has weight" in refused.stdout
    resumed = train(2, bdir, *more, *batch, f"--runconfig.checkpoint_path={as_batch}")
    assert "resumed from" in resumed.stdout and "global_step = 9" in resumed.stdout


@pytest.mark.parametrize(
    ("np_", "args", "message"),
    [
        (4, ["--model.n_head=2", *tp(4)], "=4 (weight mode) must divide model.n_head (2)"),
        (2, ["--model.vocab_size=257", *tp(2)], "must divide model.vocab_size (257)"),
        (2, ["--params=fc_mnist", *tp(2)], "runs model.name gpt2 only, not fc_mnist"),
        (2, ["--zero_opt_level=3", *tp(2)], "runs ZeRO 0-2 on the data-parallel axis"),
        (2, ["--runconfig.ranks_per_node=1", *tp(2)], "ranks [0, 1] span nodes [0, 1]"),
        (3, [*tp(2)], "tensor_parallel=2 must divide the 3 ranks"),
        (4, ["--runconfig.pipeline_parallel=2", "--runconfig.ranks_per_node=1", *tp(2)],
         "ranks [0, 1] span nodes [0, 1]"),
        (6, ["--runconfig.pipeline_parallel=2", *tp(2)],
         "pipeline_parallel=2 x runconfig.tensor_parallel=2 must divide the 6 ranks"),
    ],
)  # fmt: skip
def test_bad_weight_mode_input_exits_2_and_writes_nothing(tmp_path, np_, args, message):
    d = tmp_path / "run"
    base = GPT2[1:] if "--params=fc_mnist" in args else GPT2  # another model's params
    cmd = ["-m", "simdist.train", *base, f"--runconfig.model_dir={d}", "--runconfig.max_steps=2"]
    out = run_mpi(np_, [*cmd, *args], timeout=240)
    assert out.returncode == 2, out.stdout
    assert message in out.stdout
    assert not d.exists()
