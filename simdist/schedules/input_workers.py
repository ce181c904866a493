"""The schedule of an input-worker rank: each step, prepare and send its share of one
replica's micro-batches (the protocol, and the device side that receives them, are
``simdist.input_workers``).

A worker holds no model and takes part in no collective of the training ranks: its
``comm`` holds this rank alone, so ``Run``'s barriers and agreements are trivial
here, and it neither checkpoints, evaluates nor writes performance.json. It stops sending
when its device says STOP (the device consumed its last batch, or the training ranks
agreed to stop); the remaining steps then cost nothing.
"""

from __future__ import annotations

import time

import numpy as np

from simdist.comm import groups as g
from simdist.comm.groups import WORKER, Groups, Roles
from simdist.data.datasets import build_dataset
from simdist.data.sampler import DistributedSampler
from simdist.input_workers import DATA, END, STOP, batch_shapes, delay_for
from simdist.schedules.base import Schedule, StepResult


class InputWorkers(Schedule):
    name = "input_worker"
    compiles = False  # runs no kernel
    watched = False  # waits on its device by design: the training ranks' watchdog covers it
    evaluates = False

    def __init__(self, groups: Groups, comm):
        roles: Roles = groups.roles
        assert groups.role == WORKER
        super().__init__(comm, roles.replicas, roles.world)
        self.groups, self.roles = groups, roles
        self.worker = groups.index
        self.replica = roles.replica_of_worker(self.worker)
        self.turn = roles.workers_of(self.replica).index(self.worker)
        self.dest = roles.device_rank(self.replica)
        self.delay = delay_for(self.worker)
        self.batches_sent = 0
        self.stopped = False
        self.in_flight: list[list] = [[], []]

    def prepare(self, run) -> None:
        p = run.params
        self.accum = p.optimizer.grad_accum_steps
        self.micro_batch = run.micro_batch
        self.data = build_dataset(p, self.micro_batch)
        self.sampler = DistributedSampler(
            self.data.num_train,
            run.global_batch,
            self.replicas,
            self.replica,
            p.runconfig.seed,
            p.train_input.shuffle,
            self.accum,
        )

    def start(self, run) -> None:
        # two sets of send buffers: one in flight while the next batch is prepared
        shapes = batch_shapes(self.data, self.micro_batch)
        self.sets = [
            [np.zeros(s, d) for s, d in shapes] + [np.zeros(self.micro_batch, np.int64)]
            for _ in range(2)
        ]

    def step(self, run, step: int, guard) -> StepResult:
        """Send this worker's micro-batches of ``step`` (micro-batch b of the run goes to
        worker b mod K of its replica)."""
        comm, K = self.groups.feed, self.roles.workers_per_replica
        if self.stopped:
            return StepResult(0.0)
        for micro, indices in enumerate(self.sampler.indices(step)):
            if (step * self.accum + micro) % K != self.turn:
                continue
            if g.probe(comm, self.dest, STOP):
                self.stopped = True
                break
            n = self.batches_sent
            bufs = self.sets[n % 2]
            g.wait_all(self.in_flight[n % 2])
            x, y = self.data.train_batch(indices)
            if self.delay:
                time.sleep(self.delay)
            np.copyto(bufs[0], x)
            np.copyto(bufs[1], y)
            bufs[2][...] = indices
            self.in_flight[n % 2] = [g.isend(comm, b, self.dest, DATA) for b in bufs]
            self.batches_sent = n + 1
        return StepResult(0.0)

    def close(self) -> None:
        """END, then the device's STOP: the device receives every batch sent (it drains
        after an early stop), so the pending sends complete."""
        comm = self.groups.feed
        g.wait_all(self.in_flight[0] + self.in_flight[1])
        self.in_flight = [[], []]
        flag = np.zeros(1, np.int64)
        g.send(comm, flag, self.dest, END)
        g.recv(comm, flag, self.dest, STOP)
