"""Distributed sampler: which samples each replica sees at each optimizer step.

Every epoch is a fresh permutation of the dataset drawn from (seed, epoch), so any step's
batch is a pure function of (seed, step): resuming needs no sampler state and stays bitwise
identical. The permutation is cut into global batches of ``global_batch`` samples; the
remainder (num_samples % global_batch) is dropped for that epoch, so every sample is seen at
most once per epoch across all replicas and every step has a full batch (a different
remainder is dropped each epoch when shuffling). Inside a global batch replica r takes the
r-th contiguous block, split into ``accum`` micro-batches; one process with the same
global batch therefore sees exactly the union of what the replicas see.
"""

from __future__ import annotations

import numpy as np


class DistributedSampler:
    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        replicas: int,
        rank: int,
        seed: int,
        shuffle: bool = True,
        accum: int = 1,
    ):
        if global_batch % (replicas * accum):
            raise ValueError(
                f"global batch {global_batch} is not divisible by replicas x accum "
                f"= {replicas} x {accum}"
            )
        if num_samples < global_batch:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of "
                f"{global_batch}; lower the batch size"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.replicas, self.rank, self.accum = replicas, rank, accum
        self.micro_batch = global_batch // (replicas * accum)
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = num_samples // global_batch
        self._epoch = -1
        self._perm = np.arange(num_samples)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return self._perm

    def indices(self, step: int) -> np.ndarray:
        """This replica's sample indices for optimizer step ``step``: [accum, micro_batch]."""
        perm = self.permutation(self.epoch_of(step))
        start = (step % self.steps_per_epoch) * self.global_batch
        share = self.global_batch // self.replicas
        mine = perm[start + self.rank * share : start + (self.rank + 1) * share]
        return mine.reshape(self.accum, self.micro_batch)
