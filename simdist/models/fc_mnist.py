"""FC-MNIST: a multi-layer perceptron (784 -> hidden... -> 10) with ReLU and softmax CE.

Weights are stored (in, out) like every simdist linear layer, so ``fc1.weight`` has shape
[784, 512]. Initialisation follows PyTorch's nn.Linear default (uniform in +-1/sqrt(fan_in)
for weight and bias), so results are comparable with a PyTorch reference.
"""

from __future__ import annotations

import numpy as np

from simdist.kernels.linear import (
    linear_backward_params,
    linear_forward,
    linear_relu_backward,
    linear_relu_forward,
)
from simdist.kernels.loss import (
    mean_loss,
    softmax_cross_entropy_backward,
    softmax_cross_entropy_forward,
)
from simdist.model_config import FCMNISTConfig
from simdist.precision import no_store, precision_store

from .base import GradientGroup, KernelCost, ParamSpec, gemm, vector
from .stages import Stage


class _Workspace:
    """Activations for one micro-batch size, allocated once."""

    def __init__(self, sizes: list[int], batch: int):
        # acts[i] is the output of layer i (post-ReLU for hidden layers, logits for the last)
        self.acts = [np.zeros((batch, n), np.float32) for n in sizes[1:]]
        self.dacts = [np.zeros((batch, n), np.float32) for n in sizes[1:-1]]
        self.probs = np.zeros((batch, sizes[-1]), np.float32)
        self.losses = np.zeros(batch, np.float32)
        self.nbytes = (
            sum(a.nbytes for a in self.acts + self.dacts) + self.probs.nbytes + self.losses.nbytes
        )


class FCMNIST:
    # simdist.kernels modules it calls (warmed before training; tests/test_imports.py)
    kernel_modules = ("gelu", "linear", "loss", "rowops")  # gelu: linear imports gelu_grad

    def __init__(self, config: FCMNISTConfig):
        if not config.hidden_sizes or any(h < 1 for h in config.hidden_sizes):
            raise ValueError(
                f"model.hidden_sizes must be a non-empty list of positive sizes, "
                f"got {config.hidden_sizes}"
            )
        self.name = "fc_mnist"
        self.sizes = [config.input_size, *config.hidden_sizes, config.num_classes]
        self.n_layers = len(self.sizes) - 1
        self._ws: dict[int, _Workspace] = {}
        self._train: _Workspace | None = None
        self._inputs: np.ndarray | None = None
        self._ws_now: _Workspace | None = None
        self._store = no_store  # set_precision: round what the kernels store
        self._half = False
        self._half_inputs: dict[int, np.ndarray] = {}  # mixed precision: inputs stored half

    def set_precision(self, precision) -> None:
        """Train in ``precision`` (``simdist.precision.Precision``): the input batch, every
        activation and activation gradient are stored in its half format."""
        self._store = precision_store(precision)
        self._half = precision.half is not None

    def parameter_specs(self) -> list[ParamSpec]:
        specs = []
        for i in range(self.n_layers):
            fan_in, fan_out = self.sizes[i], self.sizes[i + 1]
            specs.append(ParamSpec(f"fc{i + 1}.weight", (fan_in, fan_out), True))
            specs.append(ParamSpec(f"fc{i + 1}.bias", (fan_out,), False))
        return specs

    def init_parameters(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        for i in range(self.n_layers):
            bound = 1.0 / np.sqrt(self.sizes[i])
            for name in (f"fc{i + 1}.weight", f"fc{i + 1}.bias"):
                p = params[name]
                p[...] = rng.uniform(-bound, bound, size=p.shape).astype(np.float32)

    def allocate(self, batch_size: int) -> None:
        self._train = self._workspace(batch_size)

    def _workspace(self, batch: int) -> _Workspace:
        if batch not in self._ws:
            self._ws[batch] = _Workspace(self.sizes, batch)
        return self._ws[batch]

    # ---------------------------------------------------------------- stages (ZeRO-3)
    def stages(self) -> list[Stage]:
        """One stage per layer: fc{i+1}'s forward reads its weight and bias, its backward
        the weight (the first layer's backward reads none: its input needs no gradient)."""
        out = []
        for i in range(self.n_layers):
            w, b = f"fc{i + 1}.weight", f"fc{i + 1}.bias"
            out.append(Stage(f"fc{i + 1}", (w, b), (w,) if i > 0 else ()))
        return out

    def begin(self, inputs: np.ndarray, targets: np.ndarray, training: bool = True) -> None:
        """Load a micro-batch for ``forward_stage`` (the training workspace when its size
        matches, else an evaluation workspace of this batch size; no dropout, so
        ``training`` changes nothing)."""
        n = inputs.shape[0]
        train = self._train
        self._ws_now = train if train is not None and train.losses.shape[0] == n else None
        if self._ws_now is None:
            self._ws_now = self._workspace(n)
        if self._half:  # the device holds the batch in half precision
            buf = self._half_inputs.get(n)
            if buf is None or buf.shape != inputs.shape:
                buf = self._half_inputs[n] = np.empty(inputs.shape, np.float32)
            np.copyto(buf, inputs)
            self._store(buf)
            inputs = buf
        self._inputs, self._targets = inputs, targets

    def forward_stage(self, k: int, params) -> float | None:
        ws = self._ws_now
        x = self._inputs if k == 0 else ws.acts[k - 1]
        w, b = params[f"fc{k + 1}.weight"], params[f"fc{k + 1}.bias"]
        if k < self.n_layers - 1:  # hidden layer: bias and ReLU in one pass
            linear_relu_forward(ws.acts[k], x, w, b)
            self._store(ws.acts[k])
            return None
        linear_forward(ws.acts[k], x, w, b)
        self._store(ws.acts[k])  # the loss reads the logits in float32
        softmax_cross_entropy_forward(ws.losses, ws.probs, ws.acts[-1], self._targets)
        return mean_loss(ws.losses)  # losses.mean(dtype=np.float64)'s bits

    def backward_stage(self, k: int, params, grads, dloss: float) -> None:
        ws = self._ws_now
        if k == self.n_layers - 1:  # dlogits overwrite the saved probabilities in place
            softmax_cross_entropy_backward(ws.probs, ws.probs, self._targets, np.float32(dloss))
            self._store(ws.probs)
        dout = ws.probs if k == self.n_layers - 1 else ws.dacts[k]
        names = (f"fc{k + 1}.weight", f"fc{k + 1}.bias")
        if k > 0:
            # dx comes out masked by the ReLU that produced x (fused, same bits)
            x, dx = ws.acts[k - 1], ws.dacts[k - 1]
            linear_relu_backward(dx, grads[names[0]], grads[names[1]], dout, x, params[names[0]])
            self._store(dx)
        else:
            linear_backward_params(grads[names[0]], grads[names[1]], dout, self._inputs)
        grads.done(names)

    # ---------------------------------------------------------------- pipeline boundaries
    def stage_input(self, k: int) -> list[np.ndarray]:
        """What layer ``k`` (>= 1) reads from the layers before it: layer k - 1's output."""
        return [self._ws_now.acts[k - 1]]

    def stage_input_grad(self, k: int) -> np.ndarray:
        """The gradient of layer ``k``'s input after ``backward_stage(k)`` (ReLU-masked),
        which ``backward_stage(k - 1)`` reads as its output's gradient."""
        return self._ws_now.dacts[k - 1]

    def stage_flops(self) -> list[int]:
        """Forward + backward FLOPs of each layer per sample, as ``flops_per_sample``
        counts them (the first layer computes no input gradient): a pipeline's balance."""
        macs = [self.sizes[i] * self.sizes[i + 1] for i in range(self.n_layers)]
        return [(4 if i == 0 else 6) * m for i, m in enumerate(macs)]

    def hold_for_backward(self) -> None:
        """Nothing to do: the workspace ``begin`` chose holds the activations."""

    def eval_stats(self) -> tuple[float, int]:
        ws = self._ws_now
        correct = int((ws.probs.argmax(axis=1) == self._targets).sum())
        return float(ws.losses.sum(dtype=np.float64)), correct

    # ---------------------------------------------------------------- protocol: compute
    def forward(self, params, inputs: np.ndarray, targets: np.ndarray) -> float:
        ws = self._train
        if ws is None or ws.losses.shape[0] != inputs.shape[0]:
            raise ValueError(f"allocate({inputs.shape[0]}) before forward with that batch")
        self.begin(inputs, targets)
        loss = 0.0
        for k in range(self.n_layers):
            loss = self.forward_stage(k, params)
        return loss

    def backward(self, params, grads, dloss: float) -> None:
        for k in range(self.n_layers - 1, -1, -1):
            self.backward_stage(k, params, grads, dloss)

    def gradient_groups(self) -> list[GradientGroup]:
        return [
            GradientGroup((f"fc{i + 1}.weight", f"fc{i + 1}.bias"))
            for i in range(self.n_layers - 1, -1, -1)
        ]

    def evaluate(self, params, inputs: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
        self.begin(inputs, targets)
        for k in range(self.n_layers):
            self.forward_stage(k, params)
        return self.eval_stats()

    def activation_bytes(self, batch_size: int) -> int:
        sizes = self.sizes
        return 4 * batch_size * (sum(sizes[1:]) + sum(sizes[1:-1]) + sizes[-1] + 1)

    def flops_per_sample(self) -> int:
        macs = sum(self.sizes[i] * self.sizes[i + 1] for i in range(self.n_layers))
        # forward 2*macs; backward 4*macs except the first layer's input gradient (2*macs_1)
        return 6 * macs - 2 * self.sizes[0] * self.sizes[1]

    def kernel_costs(self, batch: int, seq: int | None = None) -> list[KernelCost]:
        """The kernel calls of ``forward`` + ``backward`` on ``batch`` samples (no sequence
        axis: ``seq`` is ignored). Softmax-CE: max, subtract, exp (rowops.exp_f32), add, divide per
        logit, counted as 28 FLOPs with exp as ~24 (its polynomial evaluation)."""
        B, sizes, L = batch, self.sizes, self.n_layers
        out: list[KernelCost] = []
        for i in range(L):
            n_in, n_out = sizes[i], sizes[i + 1]
            out.append(gemm(f"fc{i + 1}.matmul", B, n_in, n_out, "forward"))
            if i < L - 1:  # bias add and ReLU fused: one pass, 2 FLOPs per element
                bias_relu = vector(
                    f"fc{i + 1}.bias_relu", 2 * B * n_out, 2 * B * n_out + n_out, "forward"
                )
                out.append(bias_relu)
            else:
                out.append(vector(f"fc{i + 1}.bias", B * n_out, 2 * B * n_out + n_out, "forward"))
        K = sizes[-1]
        # exp (rowops.exp_f32) and the division vectorise; the max and the sum are
        # reductions (rowops), priced at the reduction rate
        out.append(vector("softmax_ce", 28 * B * K, 2 * B * K + 2 * B, "forward", 1, 2 * B * K))
        out.append(vector("softmax_ce.bwd", B * K, 2 * B * K + B, "backward"))
        for i in range(L - 1, -1, -1):
            n_in, n_out = sizes[i], sizes[i + 1]
            names = (f"fc{i + 1}.weight", f"fc{i + 1}.bias")
            if i > 0:  # the first layer's input needs no gradient
                out.append(gemm(f"fc{i + 1}.dinput", B, n_out, n_in, "backward", layout="nt"))
            out.append(gemm(f"fc{i + 1}.dweight", n_in, B, n_out, "backward", layout="tn"))
            dbias = vector(f"fc{i + 1}.dbias", B * n_out, B * n_out + n_out, "backward")
            out.append(dbias._replace(done=names))
            if i > 0:
                out.append(vector(f"fc{i}.relu.bwd", B * n_in, 3 * B * n_in, "backward"))
        return out
