"""Input workers: CPU ranks that read and prepare training batches for the replicas.

This module is the protocol and the device side (what a replica reads its batches from);
the workers' own steps are the schedule ``simdist.schedules.input_workers``.

``runconfig.input_workers_per_replica`` = K adds K worker ranks per replica (after the
weight servers and the devices, see ``simdist.comm.groups``). As Cerebras assigns input
workers to systems, worker i feeds replica i mod R; a replica's workers take turns: its
j-th worker prepares the micro-batches b (counted over the whole run, b = step * accum +
micro) with b mod K = j. A worker runs the same ``DistributedSampler`` and dataset code a
device would run, so the batches are bit-for-bit the ones the device would have read
itself; the worker also sends the sample indices, and the device checks them.

Devices see an ``InputFeed`` in place of their dataset: ``train_batch`` returns the next
received batch, with up to ``depth`` batches received ahead of use. The time a device
waits for input is measured; ``input_report`` turns it into performance.json's
``suspected_input_bottleneck``: true when some device waited on input for more than
``BOTTLENECK_SHARE`` of its training time. Without workers the same wrapper
(``MeasuredInput``) measures the time the device spends preparing batches itself.

Messages per batch on the feed communicator: x, y and the indices, tag DATA, in that
order (MPI keeps the order between a pair of ranks). Shutdown: the device sends STOP to
each of its workers once it has consumed its last batch (or at close, after a stop), then
receives until the worker's END; a worker stops producing when it sees STOP. So no message
is left unmatched and no worker blocks forever in a send.

Test hook: ``SIMDIST_INPUT_DELAY_S=<seconds>`` makes every worker (or, with
``SIMDIST_INPUT_DELAY_WORKERS=0,2``, only those worker indices) sleep that long per batch:
a deliberately slow input pipeline.
"""

from __future__ import annotations

import os
import time

import numpy as np

from simdist.comm import groups as g
from simdist.comm.groups import DEVICE, Groups

DATA, STOP, END = 1, 2, 3
BOTTLENECK_SHARE = 0.10  # devices waiting on input > 10 % of training time: a bottleneck
DELAY_ENV = "SIMDIST_INPUT_DELAY_S"
DELAY_WORKERS_ENV = "SIMDIST_INPUT_DELAY_WORKERS"


def delay_for(worker: int) -> float:
    """Seconds the test hook adds per batch for this worker (0: no hook)."""
    text = os.environ.get(DELAY_ENV)
    if not text:
        return 0.0
    only = os.environ.get(DELAY_WORKERS_ENV)
    if only and worker not in {int(w) for w in only.split(",") if w.strip()}:
        return 0.0
    return float(text)


def batch_shapes(data, micro_batch: int) -> list[tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes of (x, y) as ``data.train_batch`` returns them."""
    x, y = data.train_batch(np.zeros(micro_batch, np.int64))
    return [(x.shape, x.dtype), (y.shape, y.dtype)]


class MeasuredInput:
    """The device reads its own batches (no workers): time spent preparing them counts as
    waiting on input, since the device computes nothing meanwhile."""

    def __init__(self, data):
        self.data = data
        self.wait_s = 0.0
        self.batches = 0

    def __getattr__(self, name: str):  # num_train, eval_batch, source, ...
        return getattr(self.data, name)

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        out = self.data.train_batch(indices)
        self.wait_s += time.perf_counter() - t0
        self.batches += 1
        return out

    def close(self) -> None:
        pass


class InputFeed(MeasuredInput):
    """A device's dataset when input workers feed it (see the module docstring)."""

    def __init__(self, data, groups: Groups, micro_batch: int, first: int, total: int):
        """``first``: the run-wide index of the first micro-batch to receive (resume);
        ``total``: how many this run receives."""
        super().__init__(data)
        roles = groups.roles
        self.comm = groups.feed
        replica = groups.index
        self.workers = [roles.worker_rank(w) for w in roles.workers_of(replica)]
        self.first, self.total = first, total
        self.depth = 2  # batches received ahead of use
        shapes = batch_shapes(data, micro_batch)
        self.slots = [
            [np.zeros(s, d) for s, d in shapes] + [np.zeros(micro_batch, np.int64)]
            for _ in range(self.depth + 1)
        ]
        self.pending: dict[int, list] = {}
        self.next = 0
        self._stopped = False
        for b in range(min(self.depth, total)):
            self._post(b)
        # with nothing to receive, STOP waits for close(): set-up must not block on workers

    def _source(self, b: int) -> int:
        return self.workers[(self.first + b) % len(self.workers)]

    def _post(self, b: int) -> None:
        slot = self.slots[b % (self.depth + 1)]
        src = self._source(b)
        self.pending[b] = [g.irecv(self.comm, buf, src, DATA) for buf in slot]

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = self.next
        if b >= self.total:
            raise RuntimeError(f"input feed: batch {b} requested, only {self.total} planned")
        t0 = time.perf_counter()
        g.wait_all(self.pending.pop(b))
        self.wait_s += time.perf_counter() - t0
        self.batches += 1
        self.next = b + 1
        x, y, idx = self.slots[b % (self.depth + 1)]
        if not np.array_equal(idx, np.asarray(indices).reshape(-1)):
            raise RuntimeError(
                f"input worker {self._source(b)} sent samples {idx[:4].tolist()}... for "
                f"micro-batch {self.first + b}, the device expected "
                f"{np.asarray(indices).reshape(-1)[:4].tolist()}..."
            )
        # the slot of batch b - 1 is free now (its forward and backward are done)
        if b + self.depth < self.total:
            self._post(b + self.depth)
        if b + 1 == self.total:
            self._stop()
        return x, y

    def _stop(self) -> None:
        """Tell every worker to stop, then receive until each one's END."""
        if self._stopped:
            return
        self._stopped = True
        for reqs in self.pending.values():
            for r in reqs:
                g.cancel(r)
        self.pending.clear()
        flag = np.zeros(1, np.int64)
        largest = max(a.nbytes for a in self.slots[0])
        sink = np.zeros(largest, np.uint8)
        for w in self.workers:
            g.send(self.comm, flag, w, STOP)
        for w in self.workers:
            while g.recv(self.comm, sink, w) != END:
                pass

    def close(self) -> None:
        self._stop()


def input_report(comm, wait_s: float, train_time: float, workers_per_replica: int) -> dict:
    """performance.json's input figures (collective over the devices' ``comm``): the worst
    device's share of training time spent waiting on input, and the bottleneck flag."""
    share = wait_s / train_time if train_time > 0 else 0.0
    shares = comm.allgather(share)
    waits = comm.allgather(wait_s)
    worst = max(shares)
    return {
        "input_workers_per_replica": workers_per_replica,
        "input_wait_s": max(waits),
        "input_wait_share": worst,
        "input_wait_share_per_device": shares,
        "input_bottleneck_threshold": BOTTLENECK_SHARE,
        "suspected_input_bottleneck": bool(worst > BOTTLENECK_SHARE),
    }


def device_input(data, groups: Groups | None, micro_batch: int, first_step: int, params):
    """What a device reads batches from: an ``InputFeed`` when workers feed it, else its
    own dataset wrapped in ``MeasuredInput``."""
    if groups is None or groups.roles.workers_per_replica == 0:
        return MeasuredInput(data)
    assert groups.role == DEVICE
    r, accum = params.runconfig, params.optimizer.grad_accum_steps
    train = r.mode in ("train", "train_and_eval")
    total = max(0, r.max_steps - first_step) * accum if train else 0
    return InputFeed(data, groups, micro_batch, first_step * accum, total)
