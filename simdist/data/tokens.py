"""Token data for GPT-2: non-overlapping windows of block_size tokens (+1 for targets)."""

from __future__ import annotations

import numpy as np

from simdist.config import ConfigError, Params

from .text import gather_windows, load_text_tokens


class TokenData:
    """Train/validation token streams; sample i is the window tokens[i*T : (i+1)*T + 1]."""

    def __init__(
        self, train: np.ndarray, val: np.ndarray, T: int, vocab: int, micro_batch: int, source: str
    ):
        top = int(max(train.max(initial=0), val.max(initial=0)))
        if top >= vocab:
            raise ConfigError(
                f"train_input.data_dir: token id {top} does not fit model.vocab_size {vocab}"
            )
        self.train, self.val, self.T = train, val, T
        self.num_train, self.num_eval = (len(train) - 1) // T, (len(val) - 1) // T
        if self.num_eval < 1:
            raise ConfigError(f"the validation split has fewer than {T + 1} tokens")
        self.targets_per_sample = T
        self.source = source
        self._x = np.zeros((micro_batch, T), np.int32)
        self._y = np.zeros((micro_batch, T), np.int32)

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        gather_windows(self.train, indices, self.T, self._x, self._y)
        return self._x, self._y

    def eval_batch(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.zeros((hi - lo, self.T), np.int32)
        y = np.zeros((hi - lo, self.T), np.int32)
        gather_windows(self.val, np.arange(lo, hi), self.T, x, y)
        return x, y


def build_token_data(params: Params, micro_batch: int) -> TokenData:
    from simdist.models.gpt2 import build_gpt2

    cfg = build_gpt2(params.model).config
    spec = params.train_input.data_dir
    try:
        train, val = load_text_tokens(spec)
    except (OSError, ValueError) as e:
        raise ConfigError(f"train_input.data_dir: {e}") from None
    source = spec or "simdist text corpus (Jane Austen, Emma; byte tokens)"
    return TokenData(train, val, cfg.block_size, cfg.vocab_size, micro_batch, source)
