"""Token streams for language-model training: the shipped corpus, llm.c shards, text files.

The shipped corpus is Jane Austen's *Emma* (public domain, ~0.88 MB; see
``simdist/data/text/README.md``) as byte-level tokens (vocabulary 256). llm.c's token shards are
read and written as-is, so data prepared by llm.c's ``dev/data/*.py`` scripts (e.g.
``tinyshakespeare_train.bin``, GPT-2 tokens) trains here unchanged.
"""

from __future__ import annotations

import glob
import gzip
import os
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np

__all__ = [
    "SHARD_MAGIC",
    "SHARD_VERSION",
    "ShardError",
    "read_token_shard",
    "write_token_shard",
    "load_corpus_bytes",
    "load_text_tokens",
    "unigram_entropy",
    "TokenWindows",
    "gather_windows",
]

SHARD_MAGIC = 20240520  # llm.c's data-file magic
SHARD_VERSION = 1  # version 1: uint16 tokens (GPT-2 vocabulary fits in 16 bits)
_HEADER_INTS = 256
_HEADER_BYTES = _HEADER_INTS * 4
VAL_FRACTION = 0.1
CORPUS_FILE = "emma.txt.gz"


class ShardError(ValueError):
    """A token shard is malformed (bad magic, unsupported version, wrong size)."""


def read_token_shard(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an llm.c token shard: 256 little-endian int32 header, then uint16 tokens."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < _HEADER_BYTES:
        raise ShardError(f"{path}: {len(data)} bytes, shorter than the {_HEADER_BYTES}-byte header")
    header = np.frombuffer(data, dtype="<i4", count=_HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic != SHARD_MAGIC:
        raise ShardError(f"{path}: bad magic {magic} (llm.c token shards start with {SHARD_MAGIC})")
    if version != SHARD_VERSION:
        raise ShardError(
            f"{path}: unsupported shard version {version} (only version {SHARD_VERSION}, "
            "uint16 tokens, is supported)"
        )
    expected = _HEADER_BYTES + 2 * count
    if count < 0 or len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise ShardError(
            f"{path}: {what}: header says {count} tokens ({expected} bytes), file holds "
            f"{len(data)} bytes"
        )
    return np.frombuffer(data, dtype="<u2", offset=_HEADER_BYTES).astype(np.uint16)


def write_token_shard(path: str | os.PathLike[str], tokens: np.ndarray) -> None:
    """Write ``tokens`` (integers in 0..65535) as an llm.c version-1 token shard."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
        raise ValueError("tokens must lie in 0..65535 to fit a uint16 shard")
    if tokens.size >= 2**31:
        raise ValueError("a shard holds fewer than 2**31 tokens (int32 count in the header)")
    header = np.zeros(_HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def load_corpus_bytes() -> bytes:
    """The shipped corpus as raw bytes (ASCII English text)."""
    resource = resources.files("simdist.data") / "text" / CORPUS_FILE
    return gzip.decompress(resource.read_bytes())


def read_text_bytes(data_dir: str | None, model: str) -> tuple[bytes, str]:
    """(text, where from) for the byte-level encoder models: ``train_input.data_dir`` null
    is the shipped corpus, else a .txt file; anything else is a ConfigError naming it."""
    from simdist.typed_yaml import ConfigError

    if data_dir is None:
        return load_corpus_bytes(), "simdist text corpus (Jane Austen, Emma; bytes)"
    if not data_dir.endswith(".txt"):
        raise ConfigError(
            f"train_input.data_dir: {model} reads a .txt file (or null for the shipped corpus), "
            f"got {data_dir!r}"
        )
    try:
        with open(data_dir, "rb") as f:
            return f.read(), data_dir
    except OSError as e:
        raise ConfigError(f"train_input.data_dir: {e}") from None


def _split_bytes(data: bytes, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
    n_val = int(round(len(tokens) * val_fraction))
    if len(tokens) - n_val < 2 or n_val < 2:
        raise ValueError(f"text of {len(tokens)} bytes is too short to split for training")
    return tokens[:-n_val], tokens[-n_val:]


def _concat_shards(paths: list[str]) -> np.ndarray:
    parts = [read_token_shard(p) for p in paths]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def load_text_tokens(
    spec: str | None = None, val_fraction: float = VAL_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    """Return (train_tokens, val_tokens) as 1-D uint16 arrays.

    ``spec`` is one of:
      * ``None``: the shipped corpus, byte tokens (0..255); the last ``val_fraction`` of its
        bytes is the validation split;
      * a ``.txt`` (or ``.txt.gz``) file: its bytes as tokens, split the same way;
      * a glob (or directory) of llm.c shards: files whose name contains ``train`` form the
        training stream and those containing ``val`` the validation stream, each concatenated
        in sorted name order (``tinyshakespeare_train.bin``, ``fineweb_val_000000.bin``...).
    """
    if spec is None:
        return _split_bytes(load_corpus_bytes(), val_fraction)
    if spec.endswith((".txt", ".txt.gz")):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"{spec}: no such text file")
        data = path.read_bytes()
        return _split_bytes(gzip.decompress(data) if spec.endswith(".gz") else data, val_fraction)
    pattern = os.path.join(spec, "*.bin") if os.path.isdir(spec) else spec
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"{spec}: matches no files (expected llm.c *.bin shards)")
    train = [p for p in paths if "train" in os.path.basename(p)]
    val = [p for p in paths if "val" in os.path.basename(p)]
    if not train or not val:
        raise FileNotFoundError(
            f"{spec}: need shards named *train*.bin and *val*.bin (as llm.c writes them); "
            f"matched {[os.path.basename(p) for p in paths]}"
        )
    return _concat_shards(train), _concat_shards(val)


def unigram_entropy(tokens: np.ndarray, unit: Literal["nats", "bits"] = "nats") -> float:
    """Entropy of the tokens' empirical unigram distribution.

    A language model that learned only token frequencies reaches this cross-entropy, so a
    training loss well below it shows the model uses context. Nats match the usual loss.
    """
    tokens = np.asarray(tokens)
    if tokens.size == 0:
        raise ValueError("entropy of an empty token array is undefined")
    counts = np.bincount(tokens.ravel().astype(np.int64))
    p = counts[counts > 0] / tokens.size
    h = float(-(p * np.log(p)).sum())
    if unit == "bits":
        return h / float(np.log(2.0))
    if unit != "nats":
        raise ValueError(f"unit must be 'nats' or 'bits', got {unit!r}")
    return h


def _window_views(tokens: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if T < 1:
        raise ValueError(f"window length T must be >= 1, got {T}")
    n = (tokens.size - 1) // T
    # Both are views (no copy): sample i's inputs are tokens[i*T : i*T+T], its targets the
    # same window shifted by one token.
    return tokens[: n * T].reshape(n, T), tokens[1 : n * T + 1].reshape(n, T)


def gather_windows(
    tokens: np.ndarray,
    sample_indices: np.ndarray,
    T: int,
    out_x: np.ndarray,
    out_y: np.ndarray,
) -> None:
    """Fill ``out_x[b]``/``out_y[b]`` with inputs/targets of sample ``sample_indices[b]``.

    Sample i is the non-overlapping window ``tokens[i*T : (i+1)*T]`` and its targets
    ``tokens[i*T+1 : (i+1)*T+1]``. Writes into the caller's [B, T] buffers (any integer dtype),
    so a training loop allocates nothing per step.
    """
    x_all, y_all = _window_views(tokens, T)
    _gather(x_all, y_all, sample_indices, out_x, out_y)


def _gather(
    x_all: np.ndarray,
    y_all: np.ndarray,
    sample_indices: np.ndarray,
    out_x: np.ndarray,
    out_y: np.ndarray,
) -> None:
    B, T = len(sample_indices), x_all.shape[1]
    if out_x.shape != (B, T) or out_y.shape != (B, T):
        raise ValueError(f"out_x/out_y must have shape {(B, T)}, got {out_x.shape}/{out_y.shape}")
    n = x_all.shape[0]
    for b in range(B):
        i = int(sample_indices[b])
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} windows of length {T}")
        # Row-slice assignment copies (and casts) in place; fancy indexing would allocate.
        out_x[b] = x_all[i]
        out_y[b] = y_all[i]


class TokenWindows:
    """A 1-D token stream seen as ``(len(tokens) - 1) // T`` non-overlapping training samples."""

    def __init__(self, tokens: np.ndarray, T: int) -> None:
        self.tokens = np.asarray(tokens)
        self.T = int(T)
        self._x, self._y = _window_views(self.tokens, self.T)

    def __len__(self) -> int:
        return self._x.shape[0]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Views (inputs [T], targets [T]) of sample ``i``."""
        return self._x[i], self._y[i]

    def gather(
        self,
        sample_indices: np.ndarray,
        out_x: np.ndarray | None = None,
        out_y: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets [B, T] of the given samples, written into out_x/out_y if given."""
        shape = (len(sample_indices), self.T)
        if out_x is None:
            out_x = np.empty(shape, dtype=np.int32)
        if out_y is None:
            out_y = np.empty(shape, dtype=np.int32)
        _gather(self._x, self._y, sample_indices, out_x, out_y)
        return out_x, out_y
