"""Optimizers over a flat range of the parameter buffer.

An optimizer owns state only for the flat range [lo, hi) it is given: the whole padded
buffer in plain data parallelism, one rank's slice under ZeRO-1/2. Updates are element-wise
(AdamW, SGD with momentum), so updating a slice gives exactly the bits that updating the
whole buffer would give for those elements. Weight decay is skipped on tensors whose
ParamSpec says so (biases, norms); padding is never touched.

In mixed precision (``master=True``) the state also holds ``master``: the fp32 copy of the
parameters of [lo, hi) that the update runs on (``simdist.precision``), partitioned with
the moments under ZeRO-1/2 and checkpointed with them.
"""

from __future__ import annotations

import numpy as np

from simdist.config import OptimizerConfig
from simdist.kernels.optim import adamw_update_segments, sgd_update_segments

from .arena import Layout


def clip_coefficient(max_norm: float | None, norm: float | None) -> float:
    """Global-norm clipping's factor, as torch.nn.utils.clip_grad_norm_ computes it, 1.0
    where it clips nothing. The schedules hand it to ``Optimizer.step`` (``grad_scale``),
    which applies it in the update's own pass: nothing reads the gradient afterwards."""
    if max_norm is None or norm is None:
        return 1.0
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else 1.0


class Optimizer:
    def __init__(
        self, cfg: OptimizerConfig, layout: Layout, lo: int, hi: int, alloc, master: bool = False
    ):
        self.cfg, self.lo, self.hi = cfg, lo, hi
        # segments relative to lo, each with its weight-decay flag
        self.segments = [
            (s.lo - lo, s.hi - lo, cfg.weight_decay if s.weight_decay else 0.0)
            for s in layout.segments(lo, hi)
        ]
        # the same as an int64 table for the kernels: one call per step updates them all
        self._segs = np.array(
            [(a, b, int(wd != 0.0)) for a, b, wd in self.segments], np.int64
        ).reshape(-1, 3)
        n = hi - lo
        if cfg.optimizer_type == "adamw":
            self.state = {
                "exp_avg": alloc("optimizer_state", "exp_avg", n),
                "exp_avg_sq": alloc("optimizer_state", "exp_avg_sq", n),
            }
        else:
            self.state = {"momentum_buffer": alloc("optimizer_state", "momentum_buffer", n)}
        if master:
            self.state["master"] = alloc("optimizer_state", "master", n)

    def step(
        self, params: np.ndarray, grads: np.ndarray, step: int, lr: float, grad_scale: float = 1.0
    ) -> None:
        """Update params[lo:hi] given grads for the same range; ``step`` counts from 1.
        ``grad_scale``: the update takes fl(grads * float32(grad_scale)) (clipping's
        coefficient) in its own pass, bitwise scaling grads first; grads stay unscaled."""
        # Hyper-parameters go in as Python floats: the kernels derive torch's per-step
        # scalars (1 - beta1, bias corrections) in float64 and round each once, as torch does.
        c = self.cfg
        if c.optimizer_type == "adamw":
            adamw_update_segments(
                params,
                grads,
                self.state["exp_avg"],
                self.state["exp_avg_sq"],
                self._segs,
                lr,
                c.beta1,
                c.beta2,
                c.eps,
                c.weight_decay,
                step,
                grad_scale,
            )
        else:
            sgd_update_segments(
                params, grads, self.state["momentum_buffer"], self._segs, lr, c.momentum,
                c.weight_decay, step, grad_scale,
            )  # fmt: skip
