"""Issue #7: fail clearly and lose nothing.

Real faults in real MPI jobs (FC-MNIST, hidden [64, 32], 2 ranks): an exception on one rank,
SIGKILL of one rank, SIGTERM/SIGINT, a rank that stalls before a collective, NaN in one
rank's batch, ranks that disagree on params or code, and a table of bad inputs. Faults
inside a running job come from the test-only ``SIMDIST_FAULT`` hook (simdist/faults.py).
Jobs run as users run them (``mpiexec -n 2 python -m simdist.train``, no ``-m mpi4py``), so
nothing here relies on mpi4py's abort-on-exception.

Resumed runs are compared bit for bit with one uninterrupted reference run to step 45.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi_launch import REPO, mpiexec

from simdist import checkpoint
from simdist.faults import (
    EXIT_CONFIG,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    EXIT_STALL,
    StopSignals,
    parse_faults,
)

SMALL = [
    "--model.hidden_sizes=[64, 32]",
    "--runconfig.progress_bar=false",
    "--runconfig.mode=train",
    "--runconfig.save_summary_steps=10",
    "--zero_opt_level=1",  # every rank writes an optimizer shard: a kill can hit any writer
]
RESUME_TO = 45
BRAKE = 40  # step at which fault runs are held (sleep) so they stop before RESUME_TO


# ---------------------------------------------------------------------------- helpers


def start(np_: int, args: list[str], fault: str | None = None) -> subprocess.Popen:
    """``mpiexec -n NP python -m simdist.train ARGS`` in its own session (killable as a group)."""
    env = {k: v for k, v in os.environ.items() if k != "SIMDIST_FAULT"}
    if fault:
        env["SIMDIST_FAULT"] = fault
    cmd = [mpiexec(), "-n", str(np_), sys.executable, "-m", "simdist.train", *args]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """Wait for the job; on timeout kill its process group and fail with the output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"job did not end within {timeout} s:\n{out}")
    return proc.returncode, out


def train(np_: int, model_dir: Path, *args: str, fault: str | None = None) -> tuple[int, str]:
    return finish(start(np_, [*SMALL, f"--runconfig.model_dir={model_dir}", *args], fault))


def wait_for(cond: Callable[[], bool], proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll ``cond`` until true; fail early if the job ends first."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"job ended (rc {proc.returncode}) before {what}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out waiting for {what}:\n{proc.communicate()[0]}")
        time.sleep(0.02)


def latest_step(model_dir: Path) -> int:
    entries = checkpoint.read_index(model_dir)
    return entries[-1]["step"] if entries else -1


def assert_no_process_left(model_dir: Path) -> None:
    """No rank (nor anything else) whose command line names this model_dir survives."""
    deadline = time.monotonic() + 10
    while True:
        found = subprocess.run(["pgrep", "-af", str(model_dir)], capture_output=True, text=True)
        if found.returncode == 1:
            return
        assert time.monotonic() < deadline, f"processes left behind:\n{found.stdout}"
        time.sleep(0.05)


def state(model_dir: Path, out: Path) -> dict[str, np.ndarray]:
    """Parameters and optimizer state of the latest checkpoint (ZeRO shards merged)."""
    merged = checkpoint.consolidate(checkpoint.latest_checkpoint(model_dir), out)
    with h5py.File(merged) as f:
        tensors = {f"model/{k}": f["model"][k][...] for k in f["model"]}
        for s in f["optimizer"]:
            tensors.update({f"{s}/{k}": f["optimizer"][s][k][...] for k in f["optimizer"][s]})
    return tensors


def assert_bitwise(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory below ``path`` (itself included): size and mtime in ns."""
    if not path.exists():
        return {}
    entries = [path, *sorted(path.rglob("*"))]
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in entries}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """One uninterrupted run to RESUME_TO: (model_dir, final state)."""
    d = tmp_path_factory.mktemp("reference") / "run"
    rc, out = train(2, d, f"--runconfig.max_steps={RESUME_TO}")
    assert rc == 0, out
    return d, state(d, d.parent / "merged.h5")


def resume_and_compare(model_dir: Path, reference_state: dict[str, np.ndarray], step: int) -> None:
    rc, out = train(2, model_dir, f"--runconfig.max_steps={RESUME_TO}")
    assert rc == 0, out
    assert f"at global_step = {step} " in out, out
    assert_bitwise(state(model_dir, model_dir.parent / "merged.h5"), reference_state)


# ---------------------------------------------------------------------------- 1. exceptions


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    d = tmp_path / "run"
    t0 = time.monotonic()
    rc, out = train(2, d, "--runconfig.max_steps=1000", fault="raise:rank=1:step=5")
    assert rc == 1, out
    assert out.count("Traceback") == 1, out  # printed once, by the failing rank
    assert "[simdist rank 1/2] Traceback" in out
    assert "RuntimeError: injected fault (SIMDIST_FAULT) on rank 1 at step 5" in out
    assert time.monotonic() - t0 < 60
    assert_no_process_left(d)


# ---------------------------------------------------------------------------- 2. SIGKILL


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_one_rank_ends_the_job_and_the_last_checkpoint_survives(
    tmp_path, reference, victim
):
    """Checkpoints every step, so the kill usually lands inside a save; rank 0 writes the
    main file and the index, rank 1 an optimizer shard."""
    d, pids = tmp_path / "run", tmp_path / "pids"
    proc = start(
        2,
        [*SMALL, f"--runconfig.model_dir={d}", "--runconfig.max_steps=1000",
         "--runconfig.save_checkpoints_steps=1", "--runconfig.keep_checkpoint_max=2"],
        fault=f"pidfile:dir={pids};sleep:step={BRAKE}:seconds=60",
    )  # fmt: skip
    wait_for(lambda: (pids / "rank-1").exists() and latest_step(d) >= 10, proc, 90, "step 10")
    os.kill(int((pids / f"rank-{victim}").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    rc, out = finish(proc, 60)
    ended = time.monotonic() - killed
    assert rc == signal.SIGKILL, out  # Hydra reports the killed rank's signal
    assert "Killed (signal 9)" in out
    assert ended < 60, ended
    assert_no_process_left(d)
    path = checkpoint.latest_checkpoint(d)
    attrs = checkpoint.verify(path)  # every file against the SHA-256 in the index
    step = int(attrs["global_step"])
    assert 10 <= step <= BRAKE
    print(f"victim rank {victim}: job ended {ended:.2f} s after SIGKILL; latest step {step}")
    resume_and_compare(d, reference[1], step)


# ---------------------------------------------------------------------------- 3. SIGTERM / SIGINT


def test_sigterm_to_mpiexec_checkpoints_at_a_step_boundary_and_resumes_bitwise(tmp_path, reference):
    """Hydra forwards SIGTERM (and SIGINT) to every rank; they may see it at different
    steps, and must still stop together."""
    d = tmp_path / "run"
    proc = start(
        2,
        [*SMALL, f"--runconfig.model_dir={d}", "--runconfig.max_steps=1000",
         "--runconfig.save_checkpoints_steps=5"],
        fault=f"sleep:step={BRAKE}:seconds=5",
    )  # fmt: skip
    wait_for(lambda: latest_step(d) >= 5, proc, 90, "the first checkpoint")
    proc.send_signal(signal.SIGTERM)  # to mpiexec, as Slurm and Ctrl-C do
    rc, out = finish(proc, 60)
    assert rc == EXIT_PREEMPTED, out
    m = re.findall(r"simdist: stopped at global_step (\d+) \(SIGTERM on rank\(s\) 0, 1\)", out)
    assert len(m) == 1, out  # reported once
    step = int(m[0])
    assert latest_step(d) == step and step <= BRAKE  # the checkpoint is of the stop step
    checkpoint.verify(checkpoint.latest_checkpoint(d))
    assert "stopped at global_step" in (d / "run.log").read_text()
    assert_no_process_left(d)
    resume_and_compare(d, reference[1], step)


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, reference):
    """SIGINT reaches rank 1 only (at step 12): the per-step agreement stops rank 0 too."""
    d = tmp_path / "run"
    rc, out = train(
        2, d, "--runconfig.max_steps=1000", "--runconfig.save_checkpoints_steps=0",
        fault="signal:rank=1:step=12:sig=INT",
    )  # fmt: skip
    assert rc == EXIT_PREEMPTED, out
    assert out.count("simdist: stopped at global_step 12 (SIGINT on rank(s) 1)") == 1, out
    assert latest_step(d) == 12  # checkpointed although save_checkpoints_steps=0
    resume_and_compare(d, reference[1], 12)


def test_stop_signals_flag_first_and_interrupt_on_second():
    signals = StopSignals()
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == "SIGTERM"  # handlers run before the next bytecode
        with pytest.raises(KeyboardInterrupt, match="second stop signal"):
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored on the second
    finally:
        signals.restore()


# ---------------------------------------------------------------------------- 4. watchdog


@pytest.mark.parametrize(
    "np_,level,phase", [(2, 0, "reduce_gradients"), (3, 2, "forward_backward")]
)
def test_stall_watchdog_names_the_rank_that_has_not_arrived(tmp_path, np_, level, phase):
    """Rank 1 sleeps before step 5's forward pass; the others wait in the gradient
    collective (ZeRO-2: the reduce-scatters inside backward)."""
    d = tmp_path / "run"
    t0 = time.monotonic()
    rc, out = train(
        np_, d, "--runconfig.max_steps=1000", "--runconfig.stall_timeout_s=2",
        f"--zero_opt_level={level}", fault="sleep:rank=1:step=5:seconds=120",
    )  # fmt: skip
    assert rc == EXIT_STALL, out
    assert out.count("simdist: stall: rank") == 1, out  # one report
    assert f"  rank 0: {phase} of step 5 for" in out
    assert "  rank 1: forward_backward of step 5 for" in out
    assert "simdist: ranks not arrived (the others wait for them): 1\n" in out
    assert time.monotonic() - t0 < 60  # not the 120 s sleep
    assert_no_process_left(d)


def test_stall_report_names_the_ranks_furthest_behind_and_the_silent_ones():
    from mpi4py import MPI

    from simdist.faults import PHASES, Watchdog

    wd = Watchdog(MPI.COMM_SELF, 2.0)
    wd.enter("reduce_gradients", 5)
    fwd, red = PHASES.index("forward_backward"), PHASES.index("reduce_gradients")
    states = {  # rank: (step, phase, seconds in it, fired, collectives entered)
        0: np.array([5, red, 2.1, 1, 10]),
        1: np.array([5, fwd, 2.3, 0, 9]),
        2: np.array([5, red, 2.0, 0, 11]),  # one ahead: finished a collective early
    }
    text = wd._report(states, silent=[3])
    assert "  rank 1: forward_backward of step 5 for 2.3 s, 9 collectives entered  <-" in text
    assert "  rank 3: no answer within" in text
    assert "ranks not arrived (the others wait for them): 1, 3\n" in text
    same = wd._report({0: states[0], 1: states[0]}, silent=[])
    assert "every rank reports the same phase and collective count" in same
    wd.stop()


# ---------------------------------------------------------------------------- 5. same run


def test_ranks_with_different_params_or_code_refuse_to_start(tmp_path):
    d = tmp_path / "run"
    rc, out = train(
        2, d, "--runconfig.max_steps=10",
        fault=";".join(f"mismatch:rank=1:what={w}" for w in ("params", "source", "version")),
    )  # fmt: skip
    assert rc == EXIT_CONFIG, out
    assert out.count("simdist: error: the ranks of this job do not run the same") == 1, out
    assert "rank 1 resolved different params (runconfig.seed: 1 on rank 0, 2 on rank 1)" in out
    assert "rank 1 runs different simdist source files" in out
    assert "rank 1 runs simdist 0.1.0+fault, rank 0 runs 0.1.0" in out
    assert not d.exists()  # nothing written


def test_a_setup_error_on_one_rank_only_ends_the_job(tmp_path):
    """Rank 0 goes on into the next collective; rank 1's error must not leave it hanging."""
    d = tmp_path / "run"
    t0 = time.monotonic()
    rc, out = train(2, d, "--runconfig.max_steps=10", fault="setup_error:rank=1:wait=2")
    assert rc == EXIT_CONFIG, out
    assert "simdist: error: rank 1: injected set-up error (SIMDIST_FAULT) on rank 1" in out
    assert "(the other ranks did not hit this error; ending the job)" in out
    assert time.monotonic() - t0 < 60
    assert not d.exists()
    assert_no_process_left(d)


# ---------------------------------------------------------------------------- 6. bad input


def _bad_input_cases(tmp: Path, existing: Path) -> dict[str, tuple[list[str], str, Path | None]]:
    """name -> (argv, expected message, model_dir that must stay untouched or None)."""
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("model:\n  name: fc_mnist\n  hidden_sizes: [64, 32\n")
    garbage = tmp / "garbage"
    garbage.mkdir()
    for kind in ("train", "t10k"):
        (garbage / f"{kind}-images-idx3-ubyte").write_bytes(bytes(range(7, 107)))
        (garbage / f"{kind}-labels-idx1-ubyte").write_bytes(bytes(range(7, 107)))
    corrupt = tmp / "corrupt_ckpt"
    shutil.copytree(existing, corrupt)
    ckpt = checkpoint.latest_checkpoint(corrupt)
    data = bytearray(ckpt.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside the HDF5 file
    ckpt.write_bytes(bytes(data))
    bad_index = tmp / "bad_index"
    shutil.copytree(existing, bad_index)
    (bad_index / "checkpoints.json").write_text('{"checkpoints": [')
    a_file = tmp / "a_file"
    a_file.write_text("not a directory")
    never = tmp / "never"  # a model_dir that must not come into existence
    run = [*SMALL, f"--runconfig.max_steps={RESUME_TO + 5}"]  # would train if accepted
    base = [*run, f"--runconfig.model_dir={existing}"]
    nope = tmp / "nope.yaml"
    table = [
        ("malformed YAML", ["--params", str(bad_yaml), f"--runconfig.model_dir={existing}"],
         f"{bad_yaml}: malformed YAML: while parsing a flow sequence", existing),
        ("params file missing", ["--params", str(nope), f"--runconfig.model_dir={never}"],
         f"params file '{nope}' does not exist", None),
        ("unknown preset", ["--params", "gpt3", f"--runconfig.model_dir={never}"],
         "--params 'gpt3' is neither a file nor a preset", None),
        ("unknown key", [*base, "--runconfig.max_stepz=3"],
         "unknown key runconfig.max_stepz; valid keys in runconfig:", existing),
        ("wrong type", [*base, "--runconfig.max_steps=ten"],
         "runconfig.max_steps: expected an integer, got 'ten'", existing),
        ("wrong type (list)", [*base, "--model.hidden_sizes=64"],
         "model.hidden_sizes: expected a list of int, got 64", existing),
        ("not a choice", [*base, "--runconfig.mode=fit"],
         "runconfig.mode: 'fit' is not one of train, eval, train_and_eval", existing),
        ("n_embd % n_head", ["--params", "gpt2_mini", "--model.n_embd=100", "--model.n_head=3",
                             f"--runconfig.model_dir={existing}"],
         "model.n_embd (100) must be divisible by model.n_head (3)", existing),
        ("global batch % (ranks x accum)",
         [*base, "--train_input.batch_size=null", "--train_input.global_batch_size=63",
          "--optimizer.grad_accum_steps=2"],
         "train_input.global_batch_size=63 is not divisible by replicas x grad_accum_steps = "
         "2 x 2", existing),
        ("both batch sizes", [*base, "--train_input.global_batch_size=64"],
         "train_input: give exactly one of batch_size", existing),
        ("zero_opt_level 4", [*base, "--zero_opt_level=4"],
         "runconfig.zero_opt_level must be 0, 1, 2 or 3, got 4", existing),
        ("negative stall timeout", [*base, "--runconfig.stall_timeout_s=-1"],
         "runconfig.stall_timeout_s must be >= 0", existing),
        ("missing data files", [*base, "--train_input.data_dir=/nonexistent/mnist"],
         "train_input.data_dir: /nonexistent/mnist: not a directory", existing),
        ("corrupt data files", [*base, f"--train_input.data_dir={garbage}"],
         "bad magic number", existing),
        ("corrupt checkpoint", [*run, f"--runconfig.model_dir={corrupt}"],
         "does not match the SHA-256 recorded in checkpoints.json", corrupt),
        ("corrupt checkpoint index", [*run, f"--runconfig.model_dir={bad_index}"],
         "checkpoints.json is corrupt", bad_index),
        ("checkpoint of another model", [*base, "--model.hidden_sizes=[128, 32]"],
         "parameter 'fc1.weight' has shape (784, 64), the model needs (784, 128)", existing),
        ("missing checkpoint_path", [*base, "--runconfig.checkpoint_path=/nonexistent/c.h5"],
         "runconfig.checkpoint_path: /nonexistent/c.h5 does not exist; give an existing", existing),
        ("unwritable model_dir", [*run, f"--runconfig.model_dir={a_file}/sub"],
         "is not writable: [Errno 20] Not a directory: ", None),
        ("fewer ranks than min_world_size", [*base, "--runconfig.min_world_size=4"],
         "this run needs at least runconfig.min_world_size = 4 ranks, but was started with 2",
         existing),
        ("unknown device profile", [*base, "--runconfig.device_profile=nosuch-gpu"],
         "runconfig.device_profile: device profile 'nosuch-gpu' does not exist", existing),
    ]  # fmt: skip
    return {name: (argv, needle, d) for name, argv, needle, d in table}


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory, reference) -> dict[str, dict]:
    """Every case in one 2-rank job (tests/mpi/bad_inputs.py); model_dirs snapshotted around."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    existing = tmp / "existing"
    shutil.copytree(reference[0], existing)
    cases = _bad_input_cases(tmp, existing)
    dirs = {p for _, _, p in cases.values() if p} | {tmp / "a_file"}
    before = {p: snapshot(p) for p in dirs}
    names = list(cases)
    assert sorted(names) == sorted(BAD_INPUT_NAMES)
    (tmp / "cases.json").write_text(json.dumps([cases[n][0] for n in names]))
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "tests/mpi/bad_inputs.py",
           str(tmp / "cases.json"), str(tmp / "results.json")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp / "results.json").read_text())
    after = {p: snapshot(p) for p in dirs}
    out = {}
    for name, result in zip(names, results, strict=True):
        argv, needle, model_dir = cases[name]
        result.update(needle=needle, untouched=all(before[p] == after[p] for p in dirs))
        out[name] = result
    assert not (tmp / "a_file" / "sub").exists() and not (tmp / "never").exists()
    return out


BAD_INPUT_NAMES = [
    "malformed YAML", "params file missing", "unknown preset", "unknown key", "wrong type",
    "wrong type (list)", "not a choice", "n_embd % n_head", "global batch % (ranks x accum)",
    "both batch sizes", "zero_opt_level 4", "negative stall timeout", "missing data files",
    "corrupt data files", "corrupt checkpoint", "corrupt checkpoint index",
    "checkpoint of another model", "missing checkpoint_path", "unwritable model_dir",
    "fewer ranks than min_world_size", "unknown device profile",
]  # fmt: skip


@pytest.mark.parametrize("name", BAD_INPUT_NAMES)
def test_bad_input_exits_2_with_one_clear_message_and_writes_nothing(bad_input_results, name):
    r = bad_input_results[name]
    assert r["rc"] == EXIT_CONFIG, r
    assert r["stderr"].startswith("simdist: error: "), r["stderr"]
    assert r["stderr"].count("simdist: error: ") == 1, r["stderr"]  # once, from rank 0
    assert r["needle"] in r["stderr"], r["stderr"]
    assert r["untouched"], f"{name}: a model_dir was modified"


# ---------------------------------------------------------------------------- 7. NaN / Inf


@pytest.mark.parametrize("level,value", [(0, "nan"), (2, "inf")])
def test_non_finite_loss_stops_without_a_corrupt_checkpoint(tmp_path, level, value):
    d = tmp_path / "run"
    rc, out = train(
        2, d, "--runconfig.max_steps=1000", "--runconfig.save_checkpoints_steps=2",
        f"--zero_opt_level={level}", fault=f"nan:rank=1:step=5:value={value}",
    )  # fmt: skip
    assert rc == EXIT_NONFINITE, out
    assert out.count("simdist: error: non-finite loss or gradients in step 5") == 1, out
    assert "first non-finite tensor in layout order: gradient of 'fc1.weight'" in out
    assert "local loss non-finite on rank(s) 1" in out
    assert "The update of step 5 was not applied and no checkpoint was written" in out
    assert latest_step(d) == 4
    assert not list(d.glob("checkpoint_5*")) and not list(d.glob("checkpoint_6*"))
    path = checkpoint.latest_checkpoint(d)
    checkpoint.verify(path)
    with h5py.File(path) as f:
        assert all(np.isfinite(f["model"][k][...]).all() for k in f["model"])
    assert_no_process_left(d)


# ---------------------------------------------------------------------------- 8. no unpickling

FORBIDDEN = re.compile(
    r"\bc?pickle\b|\byaml\.(?:load|unsafe_load|full_load|load_all)\s*\("
    r"|\byaml\.(?:Unsafe|Full)?Loader\b|allow_pickle\s*=\s*True|\btorch\.load\s*\("
    r"|\bjoblib\.load\b|\bmarshal\.loads?\b|\bshelve\b|\bdill\b"
)


def test_forbidden_pattern_catches_unpickling():
    unsafe = ("import pickle", "pickle.loads(b)", "yaml.load(text)", "yaml.full_load(t)",
           "np.load(p, allow_pickle=True)", "torch.load(path)", "Loader=yaml.Loader")  # fmt: skip
    for bad in unsafe:
        assert FORBIDDEN.search(bad), bad
    for ok in ("yaml.safe_load(text)", "never pickled objects", "np.load(p)", "yaml.SafeLoader"):
        assert not FORBIDDEN.search(ok), ok


def test_nothing_read_from_disk_is_unpickled():
    """yaml.safe_load, HDF5 via h5py, safetensors; MPI object messages only inside the job."""
    skip = {"tests", "scripts", ".venv", "build", "dist"}
    hits = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if skip & set(rel.parts[:-1]) or any(p.startswith(".") for p in rel.parts):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_fault_spec_parsing():
    (f,) = parse_faults("sleep:rank=1:step=5:seconds=2")
    assert (f.kind, f.rank, f.step, f.arg("seconds", "0")) == ("sleep", 1, 5, "2")
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults("explode:rank=1")
