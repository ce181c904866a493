"""ZeRO-3 (``zero_opt_level: 3``): parameters partitioned, each stage gathered before it runs.

Serial checks of the gather schedule (``simdist.param_gather``) and the memory plan, then
runs under mpiexec: bit-identical to ZeRO 0/1/2 at the same world size (FC-MNIST and
gpt2-mini, np 2 and 4), checkpoints resharded across world sizes and ZeRO levels, and the
errors for combinations that cannot run.
"""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from mpi_launch import run_mpi
from test_train import SMALL, final_state

from simdist.arena import Layout
from simdist.memplan import (
    RankSetup,
    by_category,
    rank_entries,
    suggestions,
    total_bytes,
    window_elements,
)
from simdist.model_config import FCMNISTConfig
from simdist.models.fc_mnist import FCMNIST
from simdist.models.gpt2 import GPT2, GPT2Config
from simdist.param_gather import BACKWARD, FORWARD, GatherPlan, WindowCache, stage_gathers


def gpt2_mini(n_layer: int = 3) -> GPT2:
    return GPT2(GPT2Config(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, vocab_size=64))


def gather_plan(model, world: int) -> GatherPlan:
    layout = Layout(model.parameter_specs(), world)
    return GatherPlan(layout, model.stages(), model.gradient_groups())


def step_gathers(model, world: int, micro_batches: int = 1) -> list[tuple[str, int, int]]:
    """(phase, stage, group) of every all-gather one training step issues."""
    plan = GatherPlan(
        Layout(model.parameter_specs(), world), model.stages(), model.gradient_groups()
    )
    cache = WindowCache(plan)
    n = len(plan.stages)
    out = []
    for _ in range(micro_batches):
        for phase, order in ((FORWARD, range(n)), (BACKWARD, range(n - 1, -1, -1))):
            for k in order:
                for g in stage_gathers(plan, cache, k, phase, True)[1]:
                    out.append((phase, k, g.group))
    return out


def test_every_stage_is_gathered_before_forward_and_again_before_backward():
    model = gpt2_mini()
    plan = GatherPlan(Layout(model.parameter_specs(), 4), model.stages(), model.gradient_groups())
    gathers = step_gathers(model, 4)
    groups = [tuple(g.names) for g in model.gradient_groups()]
    blocks = [groups.index(tuple(n)) for n in model._layer_names]
    fwd = [g for ph, _, g in gathers if ph == FORWARD]
    bwd = [g for ph, _, g in gathers if ph == BACKWARD]
    emb, lnf = len(groups) - 1, 0
    # forward: embedding, each block, then the head's groups (the tied embedding again,
    # ln_f), in flat order
    assert fwd == [emb, *blocks, emb, lnf]
    # backward: the head and the last block are still in the two windows; the other
    # blocks are gathered again, last to first; the embedding's backward reads no weights
    assert bwd == list(reversed(blocks[:-1]))
    # the window is the largest stage: a block or the head (ln_f + the embedding group)
    assert plan.window == max(plan.size((blocks[0],)), plan.size((lnf, emb)))
    # each gather is the group's range cut at the ZeRO slice boundaries
    a, b = plan.ranges[blocks[0]]
    assert (
        plan.block_bounds(blocks[0]).tolist() == np.clip(plan.layout.bounds - a, 0, b - a).tolist()
    )


def test_prefetch_never_evicts_the_computing_stage():
    """Two windows: the stage that computes keeps its window while the next is gathered."""
    model = FCMNIST(FCMNISTConfig("fc_mnist", [64, 32, 16], 784, 10))
    plan = GatherPlan(Layout(model.parameter_specs(), 2), model.stages(), model.gradient_groups())
    cache = WindowCache(plan)
    n = len(plan.stages)
    for phase, order in ((FORWARD, range(n)), (BACKWARD, range(n - 1, -1, -1))):
        for k in order:
            groups = plan.uses(k, phase)
            if groups:
                w, _ = cache.acquire(groups)
                assert all(g in cache.held[w] for g in groups)
            prefetched = cache.prefetch(plan.next_use(k, phase, True))
            if groups:
                assert all(g.window != w for g in prefetched)
                assert all(g in cache.held[w] for g in groups)  # still there to compute
    # forward: fc1 (+ fc2 prefetched), fc3, fc4; backward: fc4 and fc3 are still in the
    # windows, fc2 is gathered again, fc1's backward reads no weights
    assert [(ph, g) for ph, _, g in step_gathers(model, 2)] == [
        (FORWARD, 3), (FORWARD, 2), (FORWARD, 1), (FORWARD, 0), (BACKWARD, 2)
    ]  # fmt: skip
    # a second micro-batch: fc2 is still in a window when fc1's forward prefetches it
    assert len(step_gathers(model, 2, micro_batches=2)) == 5 + 4


@pytest.mark.parametrize("world", [2, 4])
def test_memory_plan_is_16_psi_over_n_plus_the_gathered_working_set(world):
    model = gpt2_mini(n_layer=12)  # windows are two stages: small beside 12 blocks
    setup = RankSetup(
        numel_specs=tuple((s.name, s.numel) for s in model.parameter_specs()),
        groups=tuple((tuple(g.names), g.held) for g in model.gradient_groups()),
        world=world,
        rank=0,
        zero_level=3,
        accum=1,
        optimizer_type="adamw",
        micro_batch=2,
        algorithm="ring",
        activation_bytes=model.activation_bytes,
        input_bytes_per_sample=0,
        window_elements=window_elements(model, world),
    )
    layout = Layout(model.parameter_specs(), world)
    shard = layout.shard_size  # padded psi / N
    entries = {e.name: e.nbytes for e in rank_entries(setup)}
    assert entries["param_slice"] == 4 * shard
    assert entries["grad_slice"] == 4 * shard
    assert entries["exp_avg"] + entries["exp_avg_sq"] == 8 * shard
    assert entries["param_window"] == 2 * 4 * setup.window_elements
    assert "params" not in entries and "grads" not in entries
    cat = by_category(rank_entries(setup))
    z2 = by_category(rank_entries(setup, zero_level=2))
    assert cat["gradients"] == z2["gradients"] and cat["buckets"] == z2["buckets"]
    assert cat["optimizer_state"] == z2["optimizer_state"]
    assert cat["parameters"] == 4 * shard + 8 * setup.window_elements < z2["parameters"]
    # the simulated OOM's hint computes ZeRO-3 with the same entries
    need = total_bytes(rank_entries(setup))
    assert need < total_bytes(rank_entries(setup, zero_level=2))
    tip = suggestions(dataclasses.replace(setup, zero_level=0), need)
    assert "runconfig.zero_opt_level=3 would fit" in tip, tip


# ----------------------------------------------------------------------------- runs
def train(n: int, d: Path, *args: str, check: bool = True, timeout: int = 300):
    small = SMALL if not any(a.startswith("--params=") for a in args) else SMALL[1:]
    cmd = ["-m", "simdist.train", *small, f"--runconfig.model_dir={d}", *args]
    r = run_mpi(n, cmd, timeout=timeout)
    if check:
        assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def losses(stdout: str) -> list[str]:
    return re.findall(r"global_step = \d+, loss = \S+", stdout)


def assert_same_state(a, b, what: str) -> None:
    for which in (0, 1):  # parameters, optimizer state
        assert a[which].keys() == b[which].keys()
        for k in a[which]:
            assert np.array_equal(a[which][k], b[which][k]), f"{what}: {k}"


@pytest.mark.parametrize(
    ("n", "algorithm", "per_node"),
    [(2, "auto", None), (4, "auto", None), (3, "ring", None), (4, "rhd", None), (4, "auto", 2)],
)
def test_zero3_is_bit_identical_to_zero_0_1_2_fc_mnist(tmp_path, n, algorithm, per_node):
    """Loss lines, final parameters, optimizer state and eval.json: identical bits (on one
    node "auto" runs shm on the shared gather windows; 2 virtual nodes: hierarchical).
    np 3 with 333-sample eval batches: the ranks score different numbers of batches, so
    the ones that finish first join the others' gathers."""
    args = [
        "--runconfig.max_steps=20",
        "--optimizer.max_gradient_norm=0.5",
        "--optimizer.weight_decay=0.01",
        f"--runconfig.collective_algorithm={algorithm}",
        "--eval_input.batch_size=333",
    ]
    if per_node:
        args.append(f"--runconfig.ranks_per_node={per_node}")
    runs = {}
    for level in (0, 1, 2, 3):
        d = tmp_path / f"z{level}"
        r = train(n, d, *args, f"--zero_opt_level={level}")
        runs[level] = (losses(r.stdout), final_state(d), (d / "eval.json").read_text())
    assert runs[3][0] and "ZeRO-3" in r.stdout
    for level in (0, 1, 2):
        assert runs[3][0] == runs[level][0], f"loss lines differ from ZeRO-{level}"
        assert_same_state(runs[3][1], runs[level][1], f"ZeRO-3 vs ZeRO-{level}")
        assert runs[3][2] == runs[level][2], "eval.json"
    perf = json.loads((tmp_path / "z3" / "performance.json").read_text())
    assert perf["zero_opt_level"] == 3
    assert perf["simulation"]["memory_plan_matches"]


def test_zero3_with_accumulation_matches_zero2(tmp_path):
    """With grad_accum_steps > 1 ZeRO-2 and 3 both reduce every micro-batch: same bits."""
    args = ["--runconfig.max_steps=10", "--runconfig.mode=train", "--optimizer.grad_accum_steps=2"]
    for level in (2, 3):
        train(2, tmp_path / f"z{level}", *args, f"--zero_opt_level={level}")
    assert_same_state(final_state(tmp_path / "z3"), final_state(tmp_path / "z2"), "accum")


@pytest.mark.parametrize("n", [2, 4])
def test_zero3_is_bit_identical_gpt2_mini(tmp_path, n):
    args = [
        "--params=gpt2_mini",
        "--runconfig.max_steps=4",
        "--runconfig.save_summary_steps=1",
        "--runconfig.mode=train",
        "--train_input.batch_size=2",
        "--optimizer.max_gradient_norm=1.0",
    ]
    runs = {}
    for level in (0, 1, 2, 3):
        d = tmp_path / f"z{level}"
        r = train(n, d, *args, f"--zero_opt_level={level}", timeout=600)
        runs[level] = (losses(r.stdout), final_state(d))
    assert len(runs[3][0]) == 4
    for level in (0, 1, 2):
        assert runs[3][0] == runs[level][0], f"loss lines differ from ZeRO-{level}"
        assert_same_state(runs[3][1], runs[level][1], f"ZeRO-3 vs ZeRO-{level}")


def test_zero3_resume_is_bitwise_identical(tmp_path):
    args = ["--runconfig.mode=train", "--runconfig.save_checkpoints_steps=5", "--zero_opt_level=3"]
    train(2, tmp_path / "full", *args, "--runconfig.max_steps=10")
    train(2, tmp_path / "res", *args, "--runconfig.max_steps=5")
    out = train(2, tmp_path / "res", *args, "--runconfig.max_steps=10")
    assert "resumed from" in out.stdout and "ZeRO-3" in out.stdout
    assert_same_state(final_state(tmp_path / "full"), final_state(tmp_path / "res"), "resume")
    shards = sorted(p.name for p in (tmp_path / "full").glob("checkpoint_10.optim-*"))
    assert shards == ["checkpoint_10.optim-0-of-2.h5", "checkpoint_10.optim-1-of-2.h5"]


@pytest.mark.parametrize(
    ("old", "old_level", "new", "new_level"),
    [(2, 3, 4, 3), (2, 0, 4, 3), (4, 3, 2, 0), (4, 3, 3, 3)],
)
def test_zero3_checkpoints_reshard(tmp_path, old, old_level, new, new_level):
    """A checkpoint written at ``old`` ranks and one ZeRO level resumes at ``new`` ranks
    and another exactly as a run started from its consolidated export does."""
    from simdist.checkpoint import consolidate

    g = ["--train_input.batch_size=null", "--train_input.global_batch_size=60"]
    args = ["--runconfig.mode=train", *g]
    src = tmp_path / "src"
    train(old, src, *args, "--runconfig.max_steps=6", f"--zero_opt_level={old_level}")
    a = tmp_path / "resharded"
    shutil.copytree(src, a)
    out = train(new, a, *args, "--runconfig.max_steps=10", f"--zero_opt_level={new_level}")
    assert f"world size {old}, ZeRO-{old_level}" in out.stdout
    cons = consolidate(src / "checkpoint_6.h5", tmp_path / "consolidated.h5")
    b = tmp_path / "from_consolidated"
    train(
        new,
        b,
        *args,
        "--runconfig.max_steps=10",
        f"--zero_opt_level={new_level}",
        f"--runconfig.checkpoint_path={cons}",
    )
    assert_same_state(final_state(a), final_state(b), "reshard")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--runconfig.enable_data_parallel=false"], "needs runconfig.enable_data_parallel"),
        (["--execution_mode=weight_streaming"], "applies to pipelined"),
    ],
)
def test_bad_combinations_exit_2_naming_the_key(tmp_path, extra, message):
    d = tmp_path / "run"
    r = train(2, d, "--zero_opt_level=3", "--runconfig.max_steps=2", *extra, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    text = r.stdout + r.stderr
    assert message in text and "zero_opt_level" in text, text


def test_non_finite_gradients_stop_zero3_without_a_corrupt_checkpoint(tmp_path):
    """The per-step agreement sees the NaN through ZeRO-3's reduce-scattered slices: the
    update is not applied and the last checkpoint (streamed to rank 0) is finite."""
    import h5py
    from test_faults import latest_step
    from test_faults import train as train_with_fault

    from simdist import checkpoint
    from simdist.faults import EXIT_NONFINITE

    d = tmp_path / "run"
    rc, out = train_with_fault(
        2, d, "--runconfig.max_steps=1000", "--runconfig.save_checkpoints_steps=2",
        "--zero_opt_level=3", fault="nan:rank=1:step=5:value=nan",
    )  # fmt: skip
    assert rc == EXIT_NONFINITE, out
    assert "first non-finite tensor in layout order: gradient of 'fc1.weight'" in out
    assert latest_step(d) == 4
    with h5py.File(checkpoint.latest_checkpoint(d)) as f:
        assert all(np.isfinite(f["model"][k][...]).all() for k in f["model"])
