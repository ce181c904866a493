"""Failing clearly and losing nothing: exit codes, stop signals, stall watchdog, run
fingerprint, non-finite detection, and test-only fault injection (issue #7).

Exit codes of ``mpirun -np N python -m simdist.train`` (Hydra exits with the bitwise OR of
the ranks' codes, so every rank of an agreed stop returns the same one):

====  =====================================================================================
0     success
1     an exception on some rank: it prints the traceback, MPI_Abort ends every rank
2     bad input (params, data, checkpoint, model_dir, world size); nothing written
3     non-finite loss or gradients: the step was not applied, no checkpoint written for it
4     stall: a phase of a step did not finish within ``runconfig.stall_timeout_s``
75    stopped by SIGTERM/SIGINT (preemption, Ctrl-C) after a checkpoint at a step boundary;
      run the same command again to resume (75 is EX_TEMPFAIL: "try again later")
9     (from Hydra) a rank was killed by SIGKILL; Hydra kills the others at once
====  =====================================================================================

How ranks agree. Every step ends its gradient sync with one ``allreduce_scalars`` of three
float64 numbers: this rank's sum of squares of its reduced-gradient slice, its local loss
and a "stop requested" flag. Every rank gets the same sums, so all see a non-finite value
or a stop request at the same step. With gradient clipping on, the sum of squares IS the
clipping norm's collective (bitwise the same value), so the check costs no extra message;
without clipping it is one 24-byte collective per step.

Watchdog: ``simdist.watchdog`` (stalls, exit code 4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import os
import signal
import threading
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

import simdist
from simdist.comm.world import abort_job
from simdist.config import ConfigError, Params, dump_yaml
from simdist.watchdog import EXIT_STALL as EXIT_STALL  # exit codes are listed here
from simdist.watchdog import PHASES as PHASES
from simdist.watchdog import Watchdog, _write_stderr

EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75


class AgreedStop(Exception):
    """Raised on every rank at the same step: the job ends cleanly with ``exit_code``."""

    exit_code = EXIT_ERROR
    is_error = True


class NonFiniteError(AgreedStop):
    exit_code = EXIT_NONFINITE


class Preempted(AgreedStop):
    exit_code = EXIT_PREEMPTED
    is_error = False


# ---------------------------------------------------------------------------- test hooks

ENV = "SIMDIST_FAULT"
_KINDS = ("raise", "sleep", "nan", "signal", "pidfile", "mismatch", "setup_error")


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind[:rank=R][:step=S][:key=value...]``.

    ``step`` S is the step that produces global_step S; ``rank`` None means every rank.
    """

    kind: str
    rank: int | None = None
    step: int | None = None
    args: tuple[tuple[str, str], ...] = ()

    def arg(self, key: str, default: str) -> str:
        return dict(self.args).get(key, default)


def parse_faults(text: str) -> list[Fault]:
    """``SIMDIST_FAULT`` syntax: faults separated by ``;``, e.g. ``raise:rank=1:step=5``.

    Kinds (``step`` S: in the step producing global_step S, before its first forward pass):
    ``raise`` a RuntimeError; ``sleep:seconds=X``; ``nan:value=nan|inf`` into the input
    batch; ``signal:sig=TERM|INT`` to this process; ``pidfile:dir=D`` writes D/rank-R at
    training start; ``mismatch:what=params|source|version`` perturbs the run fingerprint;
    ``setup_error:wait=X`` a set-up ConfigError on this rank (gate wait X s).
    """
    faults = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        kind, *fields = spec.split(":")
        if kind not in _KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r} in {spec!r}; kinds: {_KINDS}")
        values = {}
        for f in fields:
            key, eq, value = f.partition("=")
            if not eq:
                raise ValueError(f"{ENV}: expected key=value, got {f!r} in {spec!r}")
            values[key] = value
        rank = values.pop("rank", None)
        step = values.pop("step", None)
        faults.append(
            Fault(
                kind,
                None if rank is None else int(rank),
                None if step is None else int(step),
                tuple(sorted(values.items())),
            )
        )
    return faults


class FaultHooks:
    """Test-only fault injection, built only when ``SIMDIST_FAULT`` is set (else None, so
    the training loop pays one ``if`` per micro-batch)."""

    def __init__(self, faults: list[Fault], rank: int):
        self.rank = rank
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]

    def on(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind]

    def at_start(self) -> None:
        """``pidfile:dir=D``: write D/rank-R (this rank's pid) so a test can signal it."""
        for f in self.on("pidfile"):
            d = Path(f.arg("dir", "."))
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".rank-{self.rank}.tmp"
            tmp.write_text(str(os.getpid()))
            tmp.replace(d / f"rank-{self.rank}")

    def at_batch(self, step: int, micro: int, x: np.ndarray) -> None:
        """Before the forward pass of ``step``'s first micro-batch (x: its input batch)."""
        if micro:
            return
        for f in self.faults:
            if f.step != step:
                continue
            if f.kind == "raise":
                raise RuntimeError(f"injected fault ({ENV}) on rank {self.rank} at step {step}")
            if f.kind == "sleep":
                time.sleep(float(f.arg("seconds", "3600")))
            elif f.kind == "nan":
                x.flat[0] = float(f.arg("value", "nan"))
            elif f.kind == "signal":
                os.kill(os.getpid(), signal.Signals["SIG" + f.arg("sig", "TERM")])

    def perturb(self, params: Params, fingerprint: dict[str, str]) -> Params:
        """``mismatch:what=params|code|version``: make this rank's run differ."""
        for f in self.on("mismatch"):
            what = f.arg("what", "params")
            if what == "params":
                r = params.runconfig
                params = dataclasses.replace(
                    params, runconfig=dataclasses.replace(r, seed=r.seed + 1)
                )
                fingerprint["params"] = _sha(dump_yaml(params).encode())
            elif what == "source":
                fingerprint["source"] = _sha(b"other " + fingerprint["source"].encode())
            elif what == "version":
                fingerprint["version"] += "+fault"
        return params


def hooks_from_env(rank: int) -> FaultHooks | None:
    text = os.environ.get(ENV)
    return FaultHooks(parse_faults(text), rank) if text else None


# ---------------------------------------------------------------------------- fingerprint


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_digest() -> str:
    """SHA-256 over the simdist sources (the package and its kernels), path + bytes each."""
    roots = [Path(simdist.__file__).parent]
    spec = importlib.util.find_spec("simdist.kernels")
    if spec and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    h = hashlib.sha256()
    for root in dict.fromkeys(r.resolve() for r in roots):
        for path in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{path.relative_to(root)}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_same_run(comm: MPI.Comm, params: Params) -> Params:
    """Before any other collective: every rank must have resolved the same params and run
    the same simdist (version and source files); otherwise a ConfigError naming the ranks
    that differ from rank 0 and how. Returns params (changed only by a test hook)."""
    fingerprint = {
        "params": _sha(dump_yaml(params).encode()),
        "version": simdist.__version__,
        "source": source_digest(),
    }
    hooks = hooks_from_env(comm.Get_rank())
    if hooks:
        if hooks.on("setup_error"):  # bad input seen by this rank only
            raise ConfigError(f"injected set-up error ({ENV}) on rank {comm.Get_rank()}")
        params = hooks.perturb(params, fingerprint)
    prints = comm.allgather(fingerprint)  # a few short strings: a small control message
    if all(p == prints[0] for p in prints):
        return params
    # Rare path: also gather the resolved params to name the keys that differ.
    flats = comm.allgather(_flatten(params.to_dict()))
    lines = []
    for rank in range(1, len(prints)):
        a, b = prints[0], prints[rank]
        if a["params"] != b["params"]:
            keys = sorted(
                k
                for k in flats[0].keys() | flats[rank].keys()
                if flats[0].get(k) != flats[rank].get(k)
            )
            shown = (
                "; ".join(
                    f"{k}: {flats[0].get(k)!r} on rank 0, {flats[rank].get(k)!r} on rank {rank}"
                    for k in keys[:3]
                )
                or "the resolved params text differs"
            )
            lines.append(f"rank {rank} resolved different params ({shown})")
        if a["version"] != b["version"]:
            lines.append(f"rank {rank} runs simdist {b['version']}, rank 0 runs {a['version']}")
        if a["source"] != b["source"]:
            lines.append(
                f"rank {rank} runs different simdist source files (sha256 {b['source'][:12]} "
                f"vs {a['source'][:12]} on rank 0)"
            )
    raise ConfigError(
        "the ranks of this job do not run the same configuration: "
        + "; ".join(lines)
        + ". Start every rank with the same --params file and flags, and install the same "
        "simdist on every host."
    )


# ---------------------------------------------------------------------------- set-up errors


class SetupGate:
    """Bad input during set-up ends the job with exit code 2 and one message, even when only
    some ranks hit it (a file missing on one node): the others would otherwise wait forever
    in the next collective. A private communicator (made before any other collective) lets
    the failing ranks find out, within ``wait_s``, whether every rank failed."""

    def __init__(self, comm: MPI.Comm, wait_s: float = 10.0):
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        hooks = hooks_from_env(self.rank)
        for f in hooks.on("setup_error") if hooks else ():
            wait_s = float(f.arg("wait", str(wait_s)))  # tests: a shorter wait
        self.wait_s = wait_s
        self.comm = comm.Dup() if self.world > 1 else comm

    def fail(self, error: Exception) -> int:
        """Report ``error`` once and return EXIT_CONFIG, or MPI_Abort if others carry on."""
        if self.world == 1:
            _write_stderr(f"simdist: error: {error}\n")
            return EXIT_CONFIG
        req = self.comm.Ibarrier()
        deadline = time.monotonic() + self.wait_s
        while not req.Test():
            if time.monotonic() > deadline:
                # The others are still working (or waiting in a collective): end the job.
                _write_stderr(
                    f"simdist: error: rank {self.rank}: {error} (the other ranks did not hit "
                    "this error; ending the job)\n"
                )
                abort_job(EXIT_CONFIG)
            time.sleep(0.005)
        messages = self.comm.allgather(str(error))
        if self.rank == 0:
            distinct = list(dict.fromkeys(messages))
            if len(distinct) == 1:
                _write_stderr(f"simdist: error: {distinct[0]}\n")
            for m in distinct if len(distinct) > 1 else ():
                ranks = ", ".join(str(r) for r, x in enumerate(messages) if x == m)
                _write_stderr(f"simdist: error: rank(s) {ranks}: {m}\n")
        self.comm.Barrier()  # nobody exits (under -m mpi4py: aborts) before rank 0 printed
        return EXIT_CONFIG

    def close(self) -> None:
        if self.world > 1:
            self.comm.Free()


# ---------------------------------------------------------------------------- signals


class StopSignals:
    """SIGTERM/SIGINT set a flag that the next step boundary acts on; a second one stops at
    once (KeyboardInterrupt: the job is aborted without a checkpoint)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.restore()
            raise KeyboardInterrupt(f"second stop signal ({name}): stopping without a checkpoint")
        self.received = name


# ---------------------------------------------------------------------------- the step guard


class StepGuard:
    """What a schedule's step uses: phases for the watchdog, the per-step agreement
    (non-finite check + stop flag), stop signals and the test hooks. A context manager:
    signal handlers and the watchdog live exactly as long as the loop. ``run``: a
    ``simdist.run.Run`` (its schedule's ``comm`` and ``coll`` are the agreeing ranks)."""

    def __init__(self, run):
        self.run = run
        sched = run.schedule
        self.comm, self.coll = sched.comm, sched.coll
        self.hook = hooks_from_env(run.rank)
        self.signals = StopSignals()
        timeout = run.params.runconfig.stall_timeout_s if sched.watched else 0
        coll = self.coll
        self.watchdog = Watchdog(self.comm, timeout, lambda: coll.calls) if timeout > 0 else None
        self._vals = np.zeros(3, np.float64)

    def __enter__(self) -> StepGuard:
        self.signals.install()
        if self.hook:
            self.hook.at_start()
        if self.watchdog:
            self.watchdog.enter("training_start", self.run.step + 1)
            self.watchdog.start()
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.signals.restore()
        if self.watchdog:
            # Free the side channel only when every rank gets here together.
            self.watchdog.stop(free=kind is None or issubclass(kind, AgreedStop))

    def enter(self, phase: str, step: int) -> None:
        """The loop entered ``phase`` of the step that produces global_step ``step``."""
        if self.watchdog:
            self.watchdog.enter(phase, step)

    def check(
        self, step: int, own_sumsq: float, loss: float, explain: Callable[[], str]
    ) -> tuple[float, float, bool]:
        """The per-step agreement over the schedule's ranks; returns (global sum of squares
        of the averaged gradient, summed loss, stop requested). ``own_sumsq``: this rank's
        share of the sum of squares, ``loss`` its share of the loss. Raises NonFiniteError
        on every rank when either sum is NaN or Inf, before the optimizer touches the
        parameters; ``explain()`` (collective) gives its message."""
        sumsq, total_loss, stops = self._agree(step, own_sumsq, loss)
        if not (math.isfinite(sumsq) and math.isfinite(total_loss)):
            raise NonFiniteError(explain())
        return sumsq, total_loss, stops > 0

    def check_overflow(
        self, step: int, own_sumsq: float, loss: float
    ) -> tuple[float, float, bool, bool]:
        """``check`` under loss scaling: an Inf or NaN on any rank is not an error but an
        overflow, the same on every rank (the sums carry it everywhere), which skips the
        step; returns (sum of squares, summed loss, stop requested, overflow)."""
        sumsq, total_loss, stops = self._agree(step, own_sumsq, loss)
        overflow = not (math.isfinite(sumsq) and math.isfinite(total_loss))
        return sumsq, total_loss, stops > 0, overflow

    def _agree(self, step: int, own_sumsq: float, loss: float) -> list[float]:
        """(sum of squares, loss, stop requests) summed over the ranks, as Python floats
        (math.isfinite on them, not NumPy's scalar calls: this runs every step)."""
        self.enter("step_check", step)
        v = self._vals
        v[0] = own_sumsq
        v[1] = loss
        v[2] = 1.0 if self.signals.received else 0.0
        return self.coll.allreduce_scalars(v).tolist()

    def preempted(self) -> Preempted:
        """Collective (every rank stops at the same step): name who received what."""
        run = self.run
        got = self.comm.allgather(self.signals.received)
        by_signal: dict[str, list[int]] = {}
        for r, name in enumerate(got):
            if name:
                by_signal.setdefault(name, []).append(r)
        what = ", ".join(
            f"{name} on rank(s) {', '.join(map(str, ranks))}" for name, ranks in by_signal.items()
        )
        return Preempted(
            f"stopped at global_step {run.step} ({what}); checkpoint saved "
            f"({_latest_checkpoint_text(run.model_dir)}). Run the same command again to "
            f"resume; exit code {EXIT_PREEMPTED}."
        )


def describe_nonfinite(
    comm: MPI.Comm,
    step: int,
    loss: float,
    grads: np.ndarray,
    params: np.ndarray,
    lo: int,
    layout,
    model_dir,
) -> str:
    """NonFiniteError's message (collective over ``comm``): the first non-finite gradient
    and parameter in layout order and the ranks whose loss is. ``grads`` and ``params``:
    this rank's pieces of the flat buffers, starting at flat index ``lo``."""
    found = comm.allgather((_first_nonfinite(grads, lo), _first_nonfinite(params, lo), float(loss)))
    names = [s.name for s in layout.specs]
    offsets = [layout.offsets[n] for n in names]

    def where(kind: str, index: int) -> str:
        i = bisect_right(offsets, index) - 1
        return f"{kind} of {names[i]!r} (flat element {index})"

    parts = []
    grad_idx = [g for g, _, _ in found if g >= 0]
    param_idx = [p for _, p, _ in found if p >= 0]
    if grad_idx:
        first = where("gradient", min(grad_idx))
        parts.append(f"first non-finite tensor in layout order: {first}")
    if param_idx:
        parts.append("first non-finite parameter: " + where("parameter", min(param_idx)))
    bad_loss = [r for r, (_, _, x) in enumerate(found) if not np.isfinite(x)]
    if bad_loss:
        parts.append(f"local loss non-finite on rank(s) {', '.join(map(str, bad_loss))}")
    return nonfinite_text(step, "; ".join(parts), _latest_checkpoint_text(model_dir))


def nonfinite_text(step: int, where: str = "", checkpoint: str = "") -> str:
    where = f": {where}" if where else ""
    checkpoint = f" ({checkpoint})" if checkpoint else ""
    return (
        f"non-finite loss or gradients in step {step}{where}. The update of step {step} was "
        f"not applied and no checkpoint was written for it{checkpoint}. Lower "
        "optimizer.learning_rate, set optimizer.max_gradient_norm, or check the input data."
    )


def _first_nonfinite(a: np.ndarray, base: int) -> int:
    bad = np.flatnonzero(~np.isfinite(a))
    return base + int(bad[0]) if bad.size else -1


def _latest_checkpoint_text(model_dir) -> str:
    from simdist.checkpoint import read_index

    model_dir = Path(model_dir)
    try:
        entries = read_index(model_dir)
    except Exception:  # noqa: BLE001 - only for the message
        entries = []
    if not entries:
        return "no checkpoint in model_dir yet"
    last = entries[-1]
    return f"latest checkpoint: {model_dir / last['file']}, global_step {last['step']}"


def finish_agreed_stop(run, stop: AgreedStop) -> int:
    """Every rank raised ``stop`` at the same step: rank 0 reports, all exit with its code."""
    if run.is_main:
        text = f"simdist: {'error: ' if stop.is_error else ''}{stop}"
        if stop.is_error:
            _write_stderr(text + "\n")
        else:
            print(text, flush=True)
        log = run.model_dir / "run.log"
        if log.exists():
            with open(log, "a") as f:
                f.write(text + "\n")
    run.close()
    run.comm.Barrier()  # nobody exits (under -m mpi4py: aborts) before rank 0 printed
    return stop.exit_code
