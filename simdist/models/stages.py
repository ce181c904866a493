"""Stages: a model's forward pass cut into units of weights, for weight streaming.

A model that supports weight-streaming execution (``simdist.streaming``) runs its forward
pass as a sequence of stages and its backward pass as the same stages in reverse. Each
stage names the parameters it reads, so the executor can ship exactly those weights to the
device just before the stage runs and drop them right after. The model's own
``forward``/``backward``/``evaluate`` (``StagedModel``'s loops) run the same stage
functions, so every execution mode computes the same bits.

What such a model provides (duck-typed; fc_mnist, GPT-2, BERT and T5 implement it)::

    stages() -> list[Stage]                       # forward order
    begin(inputs, targets, training=True) -> None # load a micro-batch into the arena
                                                  # (training: apply dropout, if any)
    forward_stage(k, params) -> float | None      # the last stage returns the mean loss
    backward_stage(k, params, grads, dloss)       # k from the last stage down to 0
    eval_stats() -> (loss_sum, correct)           # after the last forward stage (adds to
                                                  # the model's extra_eval, if any)

Pipeline parallelism (``simdist.schedules.pipeline``) runs a contiguous range of stages per
rank, so such a model also names its stage boundaries (views of the loaded micro-batch's
activations; fc_mnist, gpt2 and bert implement them)::

    stage_input(k) -> list[ndarray]    # what stage k reads from earlier stages (k >= 1)
    stage_input_grad(k) -> ndarray     # d(stage k's input) after backward_stage(k); the
                                       # gradient backward_stage(k - 1) starts from
    hold_for_backward() -> None        # a range ending before the last stage: keep the
                                       # activations for backward
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Stage:
    """One unit of weights: ``forward_params`` are read by the stage's forward,
    ``backward_params`` by its backward (empty: the backward reads no weights, e.g. an
    embedding's scatter-add). A name may appear in several stages (tied embeddings)."""

    name: str
    forward_params: tuple[str, ...]
    backward_params: tuple[str, ...]


class StagedModel:
    """The Model protocol's ``forward`` / ``backward`` / ``evaluate`` as loops over a model's
    stages (``self._stages``; GPT-2, BERT and T5 inherit them), so data parallelism, ZeRO-3's
    windows, 16-bit weights, weight streaming and pipelines all run the same stage
    functions and compute the same bits."""

    _stages: list[Stage]

    def forward(self, params, inputs, targets) -> float:
        self.begin(inputs, targets)
        return self._forward_pass(params)

    def _forward_pass(self, params) -> float:
        """Every stage's forward on the batch ``begin`` set; the last stage's loss."""
        loss = 0.0
        for k in range(len(self._stages)):
            loss = self.forward_stage(k, params)
        return loss

    def backward(self, params, grads, dloss: float) -> None:
        if self._saved is None:
            raise RuntimeError("backward without a preceding forward")
        for k in range(len(self._stages) - 1, -1, -1):
            self.backward_stage(k, params, grads, dloss)

    def evaluate(self, params, inputs, targets) -> tuple[float, int]:
        """The sums ``eval_stats`` defines (loss, correct predictions; a model's
        ``extra_eval`` too), without dropout, over chunks of the allocated micro-batch:
        evaluation needs no memory of its own."""
        if self._arena is None:
            self.allocate(inputs.shape[0])
        loss_sum, correct = 0.0, 0
        for lo in range(0, inputs.shape[0], self._batch):
            hi = min(lo + self._batch, inputs.shape[0])
            self.begin(inputs[lo:hi], targets[lo:hi], training=False)
            self._forward_pass(params)
            batch_loss, batch_correct = self.eval_stats()
            loss_sum, correct = loss_sum + batch_loss, correct + batch_correct
        self._saved = None  # the arena no longer holds a training forward
        return loss_sum, correct


class StagesByKind(StagedModel):
    """``forward_stage`` / ``backward_stage`` for a model whose stage k is the pair
    ``self._kinds[k] = (kind, i)``: its methods ``_{kind}_forward(views, params, i)`` and
    ``_{kind}_backward(views, params, grads, i, dloss)`` run it (T5 and the Transformer:
    embeddings, blocks i of each stack, final norms, head). The stage of kind "head" ends
    the forward; it returns the mean of ``_sample_losses``. ``begin`` sets ``_current``."""

    _kinds: list[tuple[str, int]]
    _current = None
    _saved = None

    def forward_stage(self, k: int, params) -> float | None:
        """Run stage ``k``'s forward; the head (last stage) returns the mean sample loss."""
        v = self._current
        if v is None:
            raise RuntimeError("forward_stage without begin(inputs, targets)")
        kind, i = self._kinds[k]
        if self._skips(kind):
            return None
        getattr(self, f"_{kind}_forward")(v, params, i)
        if kind == "head":
            self._saved = v
            return float(self._sample_losses(v).mean(dtype=np.float64))
        return None

    def backward_stage(self, k: int, params, grads, dloss: float) -> None:
        """Stage ``k``'s backward (from the last stage down to 0 after the forward); a stage
        that finishes a gradient group hands it over with ``grads.done``."""
        v = self._saved
        if v is None:
            raise RuntimeError("backward without a preceding forward")
        kind, i = self._kinds[k]
        getattr(self, f"_{kind}_backward")(v, params, grads, i, dloss)

    def _skips(self, kind: str) -> bool:
        """Whether this forward leaves stages of ``kind`` out (their outputs already in the
        arena); none by default."""
        return False
