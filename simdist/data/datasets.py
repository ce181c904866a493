"""Datasets as the training loop sees them: fixed batch buffers filled from indices.

Each dataset keeps its arrays in host memory and copies a batch into buffers allocated
once (``np.take(..., out=..., mode="clip")``), so a step allocates nothing. The mode
matters: under numpy's default ``mode="raise"`` ``take`` fills a temporary and then copies
it into ``out`` (a hidden batch-sized allocation and a second pass every step). The
sampler's indices are a permutation of the dataset's, always in range, so clipping never
changes one.
"""

from __future__ import annotations

import numpy as np

from simdist.config import ConfigError, Params


class ClassificationData:
    """Images [N, features] float32 with int32 labels (MNIST and friends)."""

    targets_per_sample = 1

    def __init__(self, x_train, y_train, x_test, y_test, micro_batch: int, source: str):
        self.x_train, self.y_train, self.x_test, self.y_test = x_train, y_train, x_test, y_test
        self.num_train, self.num_eval = len(x_train), len(x_test)
        self.source = source
        self._x = np.zeros((micro_batch, x_train.shape[1]), np.float32)
        self._y = np.zeros(micro_batch, np.int32)

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        np.take(self.x_train, indices, axis=0, out=self._x, mode="clip")
        np.take(self.y_train, indices, out=self._y, mode="clip")
        return self._x, self._y

    def eval_batch(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x_test[lo:hi], self.y_test[lo:hi]


def build_dataset(params: Params, micro_batch: int):
    model = params.model.name
    data_dir = params.train_input.data_dir
    if model == "fc_mnist":
        from .mnist import load_mnist

        try:
            m = load_mnist(data_dir)
        except (OSError, ValueError) as e:
            raise ConfigError(f"train_input.data_dir: {e}") from None
        if m.x_train.shape[1] != params.model.input_size:
            raise ConfigError(
                f"train_input.data_dir: samples have {m.x_train.shape[1]} features but "
                f"model.input_size is {params.model.input_size}"
            )
        return ClassificationData(m.x_train, m.y_train, m.x_test, m.y_test, micro_batch, m.source)
    if model == "gpt2":
        from .tokens import build_token_data

        return build_token_data(params, micro_batch)
    if model == "bert":
        from .bert import build_bert_data

        return build_bert_data(params, micro_batch)
    if model == "t5":
        from .t5 import build_t5_data

        return build_t5_data(params, micro_batch)
    if model == "transformer":
        from .transformer import build_transformer_data

        return build_transformer_data(params, micro_batch)
    raise ConfigError(f"model.name: no dataset for model {model!r}")
