"""The stall watchdog: a phase of a training step that does not finish within
``runconfig.stall_timeout_s`` ends the job with exit code 4, naming who has not arrived.

Watchdog. A daemon thread per rank watches a (phase, step, entered-at) tuple that the loop
replaces at each phase change (one tuple store, no lock). When a phase lasts longer than
``stall_timeout_s``, the thread asks every other rank over a private duplicate of
COMM_WORLD (non-blocking sends/receives, bounded wait) where it is: phase, step and how
many simdist collectives it has entered. Ranks behind the most advanced one have not
arrived; ranks that do not answer are named as such. Then MPI_Abort(4). An MPI side channel
rather than heartbeat files: it needs no shared file system and writes nothing into
model_dir, and the bounded wait keeps a broken network from hanging the watchdog itself
(MPI_Abort goes through the process manager, not the data network).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from simdist.comm.world import abort_job

EXIT_STALL = 4

# Phases of a training step, in order (the watchdog compares ranks by this order).
PHASES = (
    "training_start",
    "forward_backward",
    "reduce_gradients",
    "step_check",
    "update",
    "gather_parameters",
    "after_step",
)
_PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}


def _write_stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


_TAG_QUERY, _TAG_REPLY = 7101, 7102


class Watchdog:
    """A daemon thread that aborts the job when one phase of a step lasts > ``timeout_s``,
    after finding out from the other ranks which of them have not arrived."""

    def __init__(self, comm: MPI.Comm, timeout_s: float, progress=lambda: 0):
        self.timeout = timeout_s
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.progress = progress  # () -> collectives entered so far on this rank
        self.comm = comm.Dup()  # collective: no training message can match the side channel
        self.poll = min(1.0, max(0.05, timeout_s / 10))
        self.reply_wait = min(10.0, max(2.0, timeout_s / 2))
        self.state = ("training_start", 0, time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="simdist-watchdog", daemon=True)
        self._fired = False
        self._peers_fired: set[int] = set()
        self._query_buf = np.zeros(1)
        self._sends: list[tuple[MPI.Request, np.ndarray]] = []

    def enter(self, phase: str, step: int) -> None:
        # One tuple store: the watchdog thread never sees a half-updated state.
        self.state = (phase, step, time.monotonic())

    def start(self) -> None:
        self._thread.start()

    def stop(self, free: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if free:
            self.comm.Free()

    # -- the thread
    def _run(self) -> None:
        query = self._post_query()
        while not self._stop.wait(self.poll):
            query = self._serve(query)
            phase, step, since = self.state
            if time.monotonic() - since > self.timeout and not self._fired:
                self._fired = True
                self._stall(query)
        query.Cancel()
        query.Wait()

    def _post_query(self) -> MPI.Request:
        return self.comm.Irecv([self._query_buf, MPI.DOUBLE], MPI.ANY_SOURCE, _TAG_QUERY)

    def _my_state(self) -> np.ndarray:
        phase, step, since = self.state
        try:
            calls = self.progress()
        except Exception:  # noqa: BLE001 - a report without the count beats a dead watchdog
            calls = -1
        return np.array(
            [
                step,
                _PHASE_INDEX.get(phase, -1),
                time.monotonic() - since,
                self._fired,
                calls,
            ],
            np.float64,
        )

    def _serve(self, query: MPI.Request) -> MPI.Request:
        """Answer every stall query that has arrived with this rank's state."""
        status = MPI.Status()
        while query.Test(status):
            src = status.Get_source()
            self._peers_fired.add(src)
            reply = self._my_state()
            self._sends.append((self.comm.Isend([reply, MPI.DOUBLE], src, _TAG_REPLY), reply))
            query = self._post_query()
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        return query

    def _stall(self, query: MPI.Request) -> None:
        others = [r for r in range(self.world) if r != self.rank]
        ask = np.zeros(1)
        for r in others:
            self._sends.append((self.comm.Isend([ask, MPI.DOUBLE], r, _TAG_QUERY), ask))
        replies = {r: np.full(5, np.nan) for r in others}
        pending = {r: self.comm.Irecv([replies[r], MPI.DOUBLE], r, _TAG_REPLY) for r in others}
        deadline = time.monotonic() + self.reply_wait
        while pending and time.monotonic() < deadline:
            query = self._serve(query)  # others may be asking us at the same moment
            pending = {r: q for r, q in pending.items() if not q.Test()}
            if pending:
                time.sleep(0.01)
        states = {r: s for r, s in replies.items() if r not in pending}
        states[self.rank] = self._my_state()
        fired = {self.rank, *self._peers_fired, *(r for r, s in states.items() if s[3])}
        if min(fired) != self.rank:
            # A lower rank has detected the stall too and reports it; if it has not ended
            # the job after its own reply window, this rank does.
            end = time.monotonic() + self.reply_wait + 5.0
            while time.monotonic() < end:
                query = self._serve(query)
                time.sleep(0.05)
        _write_stderr(self._report(states, sorted(pending)))
        abort_job(EXIT_STALL)

    def _report(self, states: dict[int, np.ndarray], silent: list[int]) -> str:
        def key(s: np.ndarray) -> tuple:
            return (s[0], s[1], s[4])

        # The ranks furthest behind (fewest collectives entered, earliest phase) are the ones
        # the others wait for: ranks in between may be waiting on them in an earlier
        # collective (the point-to-point algorithms let some ranks finish one early).
        front, last = max(key(s) for s in states.values()), min(key(s) for s in states.values())
        behind = sorted(r for r, s in states.items() if key(s) == last) if last < front else []
        phase, step, since = self.state
        lines = [
            f"simdist: stall: rank {self.rank} has been in {phase} of step {step} for "
            f"{time.monotonic() - since:.1f} s (runconfig.stall_timeout_s = {self.timeout:g})"
        ]
        for r in sorted(states):
            s = states[r]
            where = PHASES[int(s[1])] if 0 <= s[1] < len(PHASES) else "?"
            mark = "  <- has not arrived" if r in behind else ""
            lines.append(
                f"  rank {r}: {where} of step {int(s[0])} for {s[2]:.1f} s, "
                f"{int(s[4])} collectives entered{mark}"
            )
        for r in silent:
            lines.append(
                f"  rank {r}: no answer within {self.reply_wait:g} s (hung outside MPI, or "
                "its node is unreachable)"
            )
        late = sorted(behind + silent)
        if late:
            lines.append(
                "simdist: ranks not arrived (the others wait for them): "
                + ", ".join(map(str, late))
            )
        else:
            lines.append(
                "simdist: every rank reports the same phase and collective count: a collective "
                "in it is stuck (network or MPI problem), or one rank is slow inside it (e.g. "
                "rank 0 writing a large checkpoint)"
            )
        lines.append(
            f"simdist: aborting the job (exit code {EXIT_STALL}); if a step legitimately takes "
            "this long, raise runconfig.stall_timeout_s"
        )
        return "\n".join(lines) + "\n"
