"""Sequence-to-sequence pairs for the AIAYN Transformer: byte tokens plus pad, BOS, EOS.

Vocabulary (259 ids): 0 pad, 1 BOS (the decoder's start token), 2 EOS, byte b is id b + 3.

Two sources (``train_input.data_dir``):

- null: a task derived from the shipped corpus (Jane Austen's *Emma*, whitespace runs
  collapsed): sample i is the i-th run of W = min(max_seq_length, target_length) - 1
  bytes, and its target is the same run with its space-separated words in reverse order
  ("she had been" -> "been had she"; a word cut by the run's edge stays a word). The
  target is a permutation of the source's words, so the decoder cannot produce it without
  reading the encoder: a decoder-only guess is a language model of reversed English,
  which cannot know which W bytes to reproduce; and the alignment moves with every word
  length, so cross-attention must locate, not copy, each position. The last 10 % of the
  corpus is the validation split. Every pair has W bytes and EOS: no target padding.
- a ``.tsv`` file of ``source<TAB>target`` lines (the user's parallel text, bytes as-is;
  blank lines skipped): the last 10 % of the pairs are held out. A line without exactly
  one tab, with an empty side, or longer than the model's sequences is an error naming
  FILE:LINE (exit 2, nothing written).

Batches are (inputs (B, Te + 2): source ids with EOS then padding, the sample's global
index, and 1 for the first ``greedy_eval_samples`` held-out pairs (evaluation decodes
them greedily); targets (B, Td): target ids, EOS, padding) as ``simdist.models.transformer``
reads them. Every sample is a pure function of (data, lengths, index).
"""

from __future__ import annotations

import numpy as np

from simdist.config import ConfigError, Params

from .bert import normalise
from .text import VAL_FRACTION, load_corpus_bytes

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
VOCAB_SIZE = NUM_SPECIAL + 256
KEY = "train_input.data_dir"


def reverse_words(run: bytes) -> bytes:
    """The run's space-separated words in reverse order (same bytes, same length)."""
    return b" ".join(reversed(run.split(b" ")))


def corpus_pairs(text: bytes, width: int) -> list[tuple[bytes, bytes]]:
    """(run, reversed run) for every whole run of ``width`` bytes of the text."""
    runs = [text[i : i + width] for i in range(0, len(text) - width + 1, width)]
    return [(r, reverse_words(r)) for r in runs]


def read_tsv(path: str, Te: int, Td: int) -> list[tuple[bytes, bytes]]:
    """The (source, target) pairs of a TSV file; ConfigError naming FILE:LINE on a bad line."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"{KEY}: {e}", KEY) from None
    pairs = []
    for n, line in enumerate(data.split(b"\n"), start=1):
        line = line.removesuffix(b"\r")
        if not line.strip():
            continue
        fields = line.split(b"\t")
        where = f"{KEY}: {path}:{n}"
        if len(fields) != 2:
            raise ConfigError(
                f"{where}: expected source<TAB>target, found {len(fields) - 1} tabs", KEY
            )
        src, tgt = fields
        if not src or not tgt:
            side = "source" if not src else "target"
            raise ConfigError(f"{where}: empty {side}", KEY)
        for side, s, limit, key in (("source", src, Te, "max_seq_length"),
                                    ("target", tgt, Td, "target_length")):  # fmt: skip
            if len(s) + 1 > limit:
                raise ConfigError(
                    f"{where}: {side} of {len(s)} bytes does not fit model.{key} = {limit} "
                    f"(bytes + EOS)",
                    KEY,
                )
        pairs.append((src, tgt))
    if len(pairs) < 2:
        raise ConfigError(f"{KEY}: {path} holds {len(pairs)} pairs; at least 2 needed", KEY)
    return pairs


def encode(pairs, Te: int, Td: int, first: int, greedy: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs (n, Te + 2), targets (n, Td)) int32; sample indices from ``first``, the first
    ``greedy`` samples flagged for greedy decoding."""
    x = np.full((len(pairs), Te + 2), PAD, np.int32)
    y = np.full((len(pairs), Td), PAD, np.int32)
    for i, (src, tgt) in enumerate(pairs):
        x[i, : len(src)] = np.frombuffer(src, np.uint8) + NUM_SPECIAL
        x[i, len(src)] = EOS
        y[i, : len(tgt)] = np.frombuffer(tgt, np.uint8) + NUM_SPECIAL
        y[i, len(tgt)] = EOS
    x[:, Te] = first + np.arange(len(pairs))
    x[:greedy, Te + 1] = 1
    return x, y


class TransformerData:
    """Encoded train and validation pairs, batches copied into fixed buffers."""

    def __init__(self, pairs_train, pairs_val, Te: int, Td: int, micro_batch: int, greedy: int,
                 source: str):  # fmt: skip
        self.x_train, self.y_train = encode(pairs_train, Te, Td, 0, 0)
        self.x_val, self.y_val = encode(pairs_val, Te, Td, len(pairs_train), greedy)
        self.num_train, self.num_eval = len(self.x_train), len(self.x_val)
        # the run divides eval sums by eval samples x targets_per_sample: the mean number
        # of real (not padding) targets makes that the count of scored tokens
        self.targets_per_sample = self.eval_targets_per_sample(self.num_eval)
        self.source = source
        self._x = np.zeros((micro_batch, Te + 2), np.int32)
        self._y = np.zeros((micro_batch, Td), np.int32)

    def eval_targets_per_sample(self, n: int) -> float:
        """The mean number of real targets among the first ``n`` held-out pairs (eval with
        ``runconfig.eval_steps`` scores only those)."""
        return float(np.count_nonzero(self.y_val[:n] != PAD)) / n

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x, y = self._x[: len(indices)], self._y[: len(indices)]
        np.take(self.x_train, indices, axis=0, out=x, mode="clip")
        np.take(self.y_train, indices, axis=0, out=y, mode="clip")
        return x, y

    def eval_batch(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x_val[lo:hi], self.y_val[lo:hi]

    def baselines(self) -> dict[str, float]:
        """Trivial baselines on the validation targets: the unigram cross-entropy (nats)
        of the training targets' byte frequencies, the token accuracy of always predicting
        the most frequent one, and the exact match of echoing the source unchanged."""
        real = self.y_val != PAD
        counts = np.bincount(self.y_train[self.y_train != PAD], minlength=VOCAB_SIZE)
        logp = np.log((counts + 1e-9) / counts.sum())
        Te = self.x_val.shape[1] - 2
        src = np.full_like(self.y_val, PAD)
        w = min(Te, src.shape[1])
        src[:, :w] = self.x_val[:, :w]
        return {
            "unigram_loss": float(-logp[self.y_val[real]].mean()),
            "majority_accuracy": float(np.mean(self.y_val[real] == counts.argmax())),
            "copy_exact_match": float(np.mean(np.all(src == self.y_val, axis=1))),
        }


def split(pairs: list) -> tuple[list, list]:
    n_val = max(1, int(round(len(pairs) * VAL_FRACTION)))
    return pairs[:-n_val], pairs[-n_val:]


def build_transformer_data(params: Params, micro_batch: int) -> TransformerData:
    from simdist.models.transformer import build_transformer

    cfg = build_transformer(params.model).config
    if cfg.vocab_size < VOCAB_SIZE:
        raise ConfigError(
            f"model.vocab_size ({cfg.vocab_size}) is smaller than the vocabulary the data "
            f"uses ({VOCAB_SIZE}: pad, bos, eos + 256 bytes)",
            "model.vocab_size",
        )
    Te, Td, path = cfg.max_seq_length, cfg.target_length, params.train_input.data_dir
    if path is None:
        text = normalise(load_corpus_bytes())
        n_val = int(round(len(text) * VAL_FRACTION))
        W = min(Te, Td) - 1
        train, val = corpus_pairs(text[:-n_val], W), corpus_pairs(text[-n_val:], W)
        source = f"shipped corpus, word reversal of {W}-byte runs"
    elif path.endswith(".tsv"):
        train, val = split(read_tsv(path, Te, Td))
        source = path
    else:
        raise ConfigError(
            f"{KEY}: the transformer reads a .tsv file of source<TAB>target lines (or null "
            f"for the shipped corpus's word-reversal task), got {path!r}",
            KEY,
        )
    return TransformerData(train, val, Te, Td, micro_batch, cfg.greedy_eval_samples, source)


def main(argv: list[str] | None = None) -> int:
    """``python -m simdist.data.transformer [--length 64]``: pair counts and the trivial
    baselines of the shipped word-reversal task."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m simdist.data.transformer")
    ap.add_argument("--length", type=int, default=64, help="max_seq_length = target_length")
    args = ap.parse_args(argv)
    text = normalise(load_corpus_bytes())
    n_val = int(round(len(text) * VAL_FRACTION))
    W = args.length - 1
    d = TransformerData(corpus_pairs(text[:-n_val], W), corpus_pairs(text[-n_val:], W),
                        args.length, args.length, 1, 0, "")  # fmt: skip
    print(f"pairs: {d.num_train} train, {d.num_eval} validation ({W} bytes + EOS each)")
    for key, value in d.baselines().items():
        print(f"{key}: {value:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
