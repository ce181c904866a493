"""T5 span-corruption data from a text corpus: byte tokens plus sentinels.

Vocabulary (359 ids): 0 pad (also the decoder's start token), 1 EOS, 2 unk (unused), byte b
is id b + 3, and 100 sentinels ``<extra_id_k>`` = 358 - k counting down from the top, as
T5's SentencePiece vocabulary puts them. Text is the shipped corpus (Jane Austen's *Emma*)
or a user's ``.txt`` file, runs of whitespace collapsed to one space; the last 10 % of it
is the validation split.

Span corruption (Raffel et al. 2020, section 3.1.4; T5's ``random_spans_noise_mask``):
sample i is the i-th run of R raw tokens, R the longest whose corrupted form fits the
encoder's ``max_seq_length`` (``simdist.models.t5_shapes.span_lengths``: 141 tokens for 128
inputs). Of them round(0.15 R) are noise, in round(noise / 3) spans; the noise and the
kept tokens are each cut into that many non-empty spans at uniformly random points and
interleaved, kept first. The encoder sees the kept spans with ``<extra_id_k>`` in place
of the k-th noise span, then EOS (padded to max_seq_length when one short); the decoder's
targets are ``<extra_id_k>`` followed by the k-th noise span, for every k, then EOS.
Every sample is a pure function of (corpus, max_seq_length, sample index), so any rank
builds the same one. Batches are (inputs (B, Te + 1): ids then the sample's index, targets
(B, Td)) as ``simdist.models.t5`` reads them.
"""

from __future__ import annotations

import numpy as np

from simdist.config import ConfigError, Params
from simdist.models.t5_shapes import span_lengths

from .bert import normalise
from .text import VAL_FRACTION, load_corpus_bytes, read_text_bytes

PAD, EOS, UNK = 0, 1, 2
NUM_SPECIAL = 3
NUM_SENTINELS = 100
VOCAB_SIZE = NUM_SPECIAL + 256 + NUM_SENTINELS
SALT_TRAIN, SALT_EVAL = 0x75, 0xE75


def sentinel(k: int) -> int:
    return VOCAB_SIZE - 1 - k


def _cut(n: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """``parts`` positive lengths summing to n, cut at uniformly random distinct points."""
    cuts = np.sort(rng.choice(np.arange(1, n), parts - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [n]]))


def make_examples(text: bytes, Te: int, salt: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs (n, Te + 1), targets (n, Td)) int32 for every whole run of raw tokens."""
    raw, noise, spans, Td = span_lengths(Te)
    if spans > NUM_SENTINELS:
        raise ConfigError(
            f"model.max_seq_length ({Te}) needs {spans} noise spans per sample, more than "
            f"the {NUM_SENTINELS} sentinels of the vocabulary",
            "model.max_seq_length",
        )
    ids = np.frombuffer(text, np.uint8).astype(np.int32) + NUM_SPECIAL
    n = len(ids) // raw
    if n < 2:
        raise ValueError(f"text of {len(text)} bytes holds fewer than 2 samples of {raw} bytes")
    x = np.full((n, Te + 1), PAD, np.int32)
    y = np.zeros((n, Td), np.int32)
    for i in range(n):
        rng = np.random.Generator(np.random.Philox(key=[salt, i]))
        toks = ids[i * raw : (i + 1) * raw]
        noise_len = _cut(noise, spans, rng)
        keep_len = _cut(raw - noise, spans, rng)
        src, dst, pos = [], [], 0
        for k in range(spans):
            src += [toks[pos : pos + keep_len[k]], [sentinel(k)]]
            pos += keep_len[k]
            dst += [[sentinel(k)], toks[pos : pos + noise_len[k]]]
            pos += noise_len[k]
        inp = np.concatenate([*src, [EOS]])
        x[i, : len(inp)] = inp
        x[i, Te] = i
        y[i] = np.concatenate([*dst, [EOS]])
    return x, y


class T5Data:
    """Span-corruption examples for the train and validation splits."""

    def __init__(self, text: bytes, Te: int, micro_batch: int, source: str):
        text = normalise(text)
        n_val = int(round(len(text) * VAL_FRACTION))
        try:
            self.x_train, self.y_train = make_examples(text[:-n_val], Te, SALT_TRAIN)
            self.x_val, self.y_val = make_examples(text[-n_val:], Te, SALT_EVAL)
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"train_input.data_dir: {e} at max_seq_length {Te}") from None
        self.x_val[:, Te] += len(self.x_train)  # distinct sample indices
        self.num_train, self.num_eval = len(self.x_train), len(self.x_val)
        self.targets_per_sample = self.y_train.shape[1]  # eval is per target token
        self.source = source
        self._x = np.zeros((micro_batch, Te + 1), np.int32)
        self._y = np.zeros((micro_batch, self.targets_per_sample), np.int32)

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x, y = self._x[: len(indices)], self._y[: len(indices)]
        np.take(self.x_train, indices, axis=0, out=x, mode="clip")
        np.take(self.y_train, indices, axis=0, out=y, mode="clip")
        return x, y

    def eval_batch(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x_val[lo:hi], self.y_val[lo:hi]

    def unigram_baseline(self) -> tuple[float, float]:
        """The trivial baselines: the validation targets' cross-entropy (nats) under the
        training targets' token frequencies, and the accuracy of always predicting the most
        frequent training target."""
        counts = np.bincount(self.y_train.ravel(), minlength=VOCAB_SIZE).astype(np.float64)
        logp = np.log((counts + 1e-9) / counts.sum())
        return float(-logp[self.y_val].mean()), float(np.mean(self.y_val == counts.argmax()))


def build_t5_data(params: Params, micro_batch: int) -> T5Data:
    from simdist.models.t5 import build_t5

    cfg = build_t5(params.model).config
    if cfg.vocab_size < VOCAB_SIZE:
        raise ConfigError(
            f"model.vocab_size ({cfg.vocab_size}) is smaller than the vocabulary the data "
            f"uses ({VOCAB_SIZE}: 3 special tokens + 256 bytes + {NUM_SENTINELS} sentinels)",
            "model.vocab_size",
        )
    text, source = read_text_bytes(params.train_input.data_dir, "T5")
    return T5Data(text, cfg.max_seq_length, micro_batch, source)


def main(argv: list[str] | None = None) -> int:
    """``python -m simdist.data.t5 [--max_seq_length 128]``: example counts and the
    trivial denoising baselines on the shipped corpus."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m simdist.data.t5")
    ap.add_argument("--max_seq_length", type=int, default=128)
    args = ap.parse_args(argv)
    d = T5Data(load_corpus_bytes(), args.max_seq_length, 1, "")
    loss, acc = d.unigram_baseline()
    raw, noise, spans, Td = span_lengths(args.max_seq_length)
    print(f"examples: {d.num_train} train, {d.num_eval} validation")
    print(f"per sample: {raw} raw bytes, {noise} noise in {spans} spans, {Td} targets")
    print(f"unigram baseline (training target frequencies): loss {loss:.4f} nats")
    print(f"majority baseline (always the most frequent target): accuracy {acc:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
