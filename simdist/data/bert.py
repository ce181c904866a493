"""BERT pretraining data from a text corpus: byte tokens, sentence pairs, static masking.

Vocabulary (260 ids): 0 [PAD], 1 [CLS], 2 [SEP], 3 [MASK], then byte b is id b + 4. Text is
the shipped corpus (Jane Austen's *Emma*) or a user's ``.txt`` file, runs of whitespace
collapsed to one space; the last 10 % of it is the validation split.

Sentence pairs for next-sentence prediction: sentence boundaries are ``. ! ?`` (optionally
closed by a quote) followed by a space. Sample i is built around the i-th boundary that
has room on both sides: segment A is the ``a`` bytes ending at that boundary, segment B
the ``T - 3 - a`` bytes starting right after it (IsNext, label 0) or, with probability
1/2, starting at another boundary at least T bytes away (NotNext, label 1); ``a`` is
uniform in [T/4, 3T/4). So every sequence is ``[CLS] A [SEP] B [SEP]`` filling exactly T
positions (no padding), A's sentence ends where B's starts for IsNext pairs, and the task
needs the content of both segments, not their lengths.

Masking (Devlin et al.): P = ``max_predictions_per_seq`` (15 % of T) positions, never [CLS]
or [SEP], are chosen; 80 % become [MASK], 10 % a uniformly random byte, 10 % stay. Masks
are static (fixed per sample, as the original ``create_pretraining_data.py`` with one
duplicate): every sample is a pure function of (corpus, T, P, sample index), so any rank
builds the same one. Batches are (inputs (B, 3, T), targets (B, 2P + 1)) as
``simdist.models.bert`` reads them.
"""

from __future__ import annotations

import re

import numpy as np

from simdist.config import ConfigError, Params

from .text import VAL_FRACTION, load_corpus_bytes, read_text_bytes

PAD, CLS, SEP, MASK = 0, 1, 2, 3
NUM_SPECIAL = 4
VOCAB_SIZE = NUM_SPECIAL + 256
_BOUNDARY = re.compile(rb"[.!?][\"']? ")
SALT_TRAIN, SALT_EVAL = 0x5EED, 0xE7A1


def byte_ids(text: bytes) -> np.ndarray:
    return np.frombuffer(text, np.uint8).astype(np.int32) + NUM_SPECIAL


def normalise(text: bytes) -> bytes:
    return re.sub(rb"\s+", b" ", text).strip()


def make_examples(text: bytes, T: int, P: int, salt: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs (n, 3, T), targets (n, 2P + 1)) int32 for every usable boundary of text."""
    ids = byte_ids(text)
    starts = np.array([m.end() for m in _BOUNDARY.finditer(text)], np.int64)
    room = T  # bytes needed on each side of a boundary
    ok = starts[(starts >= room) & (starts + room <= len(ids))]
    n = len(ok)
    if n < 2:
        raise ValueError(f"text of {len(text)} bytes has fewer than 2 usable sentence pairs")
    x = np.zeros((n, 3, T), np.int32)
    y = np.zeros((n, 2 * P + 1), np.int32)
    for i in range(n):
        rng = np.random.Generator(np.random.Philox(key=[salt, i]))
        s = int(ok[i])
        a = int(rng.integers(T // 4, 3 * T // 4))
        b = T - 3 - a
        seg_a = ids[s - 1 - a : s - 1]  # up to the boundary's space
        nsp = int(rng.random() < 0.5)
        if nsp:  # NotNext: a boundary at least T bytes away from this one
            while True:
                r = int(ok[rng.integers(n)])
                if abs(r - s) >= T:
                    break
            seg_b = ids[r : r + b]
        else:
            seg_b = ids[s : s + b]
        row = x[i, 0]
        row[0] = CLS
        row[1 : 1 + a] = seg_a
        row[1 + a] = SEP
        row[2 + a : 2 + a + b] = seg_b
        row[T - 1] = SEP
        x[i, 1, 2 + a :] = 1
        x[i, 2, 0] = i
        cand = np.concatenate([np.arange(1, 1 + a), np.arange(2 + a, T - 1)])
        pos = np.sort(rng.choice(cand, P, replace=False))
        y[i, :P] = pos
        y[i, P : 2 * P] = row[pos]
        u = rng.random(P)
        rand_tok = rng.integers(NUM_SPECIAL, VOCAB_SIZE, P)
        row[pos] = np.where(u < 0.8, MASK, np.where(u < 0.9, rand_tok, row[pos]))
        y[i, 2 * P] = nsp
    return x, y


class BertData:
    """Sentence-pair MLM + NSP examples for the train and validation splits."""

    def __init__(self, text: bytes, T: int, P: int, micro_batch: int, source: str):
        text = normalise(text)
        n_val = int(round(len(text) * VAL_FRACTION))
        try:
            self.x_train, self.y_train = make_examples(text[:-n_val], T, P, SALT_TRAIN)
            self.x_val, self.y_val = make_examples(text[-n_val:], T, P, SALT_EVAL)
        except ValueError as e:
            raise ConfigError(f"train_input.data_dir: {e} at max_seq_length {T}") from None
        self.x_val[:, 2, 0] += len(self.x_train)  # distinct sample indices
        self.num_train, self.num_eval = len(self.x_train), len(self.x_val)
        self.targets_per_sample = P  # eval accuracy and loss are per masked position
        self.source = source
        self._x = np.zeros((micro_batch, 3, T), np.int32)
        self._y = np.zeros((micro_batch, 2 * P + 1), np.int32)

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x, y = self._x[: len(indices)], self._y[: len(indices)]
        np.take(self.x_train, indices, axis=0, out=x, mode="clip")
        np.take(self.y_train, indices, axis=0, out=y, mode="clip")
        return x, y

    def eval_batch(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x_val[lo:hi], self.y_val[lo:hi]

    def most_frequent_baseline(self) -> tuple[int, float]:
        """The trivial MLM baseline: the byte id most frequent among the training labels,
        and the validation accuracy of always predicting it."""
        P = self.targets_per_sample
        top = int(np.bincount(self.y_train[:, P : 2 * P].ravel()).argmax())
        return top, float(np.mean(self.y_val[:, P : 2 * P] == top))


def segments(x: np.ndarray, y: np.ndarray) -> tuple[bytes, bytes]:
    """The text of one example's segments A and B (x (3, T), y (2P + 1,)), masked bytes
    restored."""
    P = (len(y) - 1) // 2
    row = x[0].copy()
    row[y[:P]] = y[P : 2 * P]
    seps = np.flatnonzero(row == SEP)
    body = (row - NUM_SPECIAL).clip(0, 255).astype(np.uint8)
    return bytes(body[1 : seps[0]]), bytes(body[seps[0] + 1 : seps[1]])


def nsp_overlap_probe(d: BertData) -> float:
    """How much next-sentence signal the pairs carry at the word level: the validation
    accuracy of "IsNext when A and B share enough words" (Jaccard overlap of their
    lower-cased words of 4+ letters), its threshold the best on the training pairs. About
    0.5 means a random B looks like a true one unless the model reads far more than
    shared vocabulary."""
    words = re.compile(rb"[A-Za-z]{4,}")

    def overlaps(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        out = np.zeros(len(x))
        for i in range(len(x)):
            a, b = (set(w.lower() for w in words.findall(s)) for s in segments(x[i], y[i]))
            out[i] = len(a & b) / max(1, len(a | b))
        return out

    n = min(len(d.x_train), 4000)
    ft, fv = overlaps(d.x_train[:n], d.y_train[:n]), overlaps(d.x_val, d.y_val)
    is_next_t, is_next_v = d.y_train[:n, -1] == 0, d.y_val[:, -1] == 0
    best = max(np.unique(ft), key=lambda th: np.mean((ft > th) == is_next_t))
    return float(np.mean((fv > best) == is_next_v))


def build_bert_data(params: Params, micro_batch: int) -> BertData:
    from simdist.models.bert import build_bert

    cfg = build_bert(params.model).config
    if cfg.vocab_size < VOCAB_SIZE:
        raise ConfigError(
            f"model.vocab_size ({cfg.vocab_size}) is smaller than the byte vocabulary the data "
            f"uses ({VOCAB_SIZE}: 4 special tokens + 256 bytes)"
        )
    text, source = read_text_bytes(params.train_input.data_dir, "BERT")
    return BertData(text, cfg.max_seq_length, cfg.max_predictions_per_seq, micro_batch, source)


def main(argv: list[str] | None = None) -> int:
    """``python -m simdist.data.bert [--max_seq_length 128] [--max_predictions_per_seq 19]``:
    the example counts and the trivial MLM baseline on the shipped corpus."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m simdist.data.bert")
    ap.add_argument("--max_seq_length", type=int, default=128)
    ap.add_argument("--max_predictions_per_seq", type=int, default=19)
    args = ap.parse_args(argv)
    d = BertData(load_corpus_bytes(), args.max_seq_length, args.max_predictions_per_seq, 1, "")
    top, acc = d.most_frequent_baseline()
    nsp = float(np.mean(d.y_val[:, -1] == np.bincount(d.y_train[:, -1]).argmax()))
    print(f"examples: {d.num_train} train, {d.num_eval} validation")
    print(f"MLM baseline (always byte {bytes([top - NUM_SPECIAL])!r}): accuracy {acc:.4f}")
    P = args.max_predictions_per_seq
    counts = np.bincount(d.y_train[:, P : 2 * P].ravel(), minlength=VOCAB_SIZE) + 1e-9
    unigram = float(-np.log(counts / counts.sum())[d.y_val[:, P : 2 * P]].mean())
    print(f"MLM unigram baseline (training label frequencies): loss {unigram:.4f} nats")
    print(f"NSP baseline (always the majority label): accuracy {nsp:.4f}")
    print(f"NSP word-overlap probe (shared words => IsNext): accuracy {nsp_overlap_probe(d):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
