"""MNIST-style data in the IDX format, and the 5,000-digit subset shipped with simdist.

The IDX format (as published for MNIST) is: two zero bytes, a dtype code, the number of
dimensions, one big-endian uint32 per dimension, then the values in big-endian C order. The
files are usually gzipped. Fashion-MNIST and KMNIST use the same format and file names, so
``load_mnist(directory)`` loads any of them.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

__all__ = ["IDXError", "MNIST", "read_idx", "write_idx", "load_mnist", "MNIST_FILES"]

# IDX dtype codes; all multi-byte types are stored big-endian.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dt.newbyteorder("="): code for code, dt in _IDX_DTYPES.items()}

# Standard file stems: (train images, train labels, test images, test labels).
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class IDXError(ValueError):
    """A file is not a well-formed IDX file (bad magic, unknown dtype, wrong size...)."""


def _read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    # Decide on the gzip magic, not the suffix: renamed files are common in the wild.
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as exc:
        # A truncated download raises EOFError; flipped bytes give a CRC or zlib error.
        raise IDXError(f"{path}: corrupt or truncated gzip stream ({exc})") from exc


def _parse_idx(data: bytes, name: str) -> np.ndarray:
    if len(data) < 4:
        raise IDXError(f"{name}: {len(data)} bytes, too short for an IDX header")
    zero0, zero1, code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0:
        raise IDXError(
            f"{name}: bad magic number 0x{data[:4].hex()} (IDX files start with two zero bytes)"
        )
    if code not in _IDX_DTYPES:
        raise IDXError(f"{name}: unknown IDX dtype code 0x{code:02x}")
    if ndim == 0:
        raise IDXError(f"{name}: IDX header declares 0 dimensions")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise IDXError(f"{name}: truncated header ({ndim} dimensions need {header_len} bytes)")
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = _IDX_DTYPES[code]
    expected = header_len + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise IDXError(
            f"{name}: {what}: shape {dims} of {dtype.name} needs {expected} bytes, "
            f"file holds {len(data)}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)
    # Native byte order and a writable copy: callers scale/convert it anyway.
    return arr.astype(dtype.newbyteorder("="))


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (plain or gzipped) into a native-endian numpy array.

    Raises ``IDXError`` naming the file when the magic number, dtype code, header or payload
    size is wrong, so a truncated or corrupt file never turns into garbage data.
    """
    path = Path(path)
    return _parse_idx(_read_bytes(path), str(path))


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write ``array`` as an IDX file; gzipped (reproducibly, mtime 0) if ``path`` ends in .gz."""
    arr = np.asarray(array)
    code = _IDX_CODES.get(arr.dtype.newbyteorder("="))
    if code is None:
        raise TypeError(f"dtype {arr.dtype} has no IDX code (use uint8/int8/int16/int32/f4/f8)")
    if not 1 <= arr.ndim <= 255:
        raise ValueError(f"IDX needs 1..255 dimensions, got {arr.ndim}")
    header = struct.pack(f">BBBB{arr.ndim}I", 0, 0, code, arr.ndim, *arr.shape)
    payload = header + arr.astype(_IDX_DTYPES[code], copy=False).tobytes(order="C")
    path = Path(path)
    if path.suffix == ".gz":
        # mtime=0 keeps regenerated files byte-identical, so re-running a converter is a no-op.
        payload = gzip.compress(payload, compresslevel=9, mtime=0)
    path.write_bytes(payload)


@dataclass
class MNIST:
    """An image-classification split: flattened images scaled to [0, 1] and int32 labels."""

    x_train: np.ndarray  # float32 [N_train, rows*cols] (784 for MNIST)
    y_train: np.ndarray  # int32 [N_train]
    x_test: np.ndarray  # float32 [N_test, rows*cols]
    y_test: np.ndarray  # int32 [N_test]
    source: str


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


def _images_labels(
    images: np.ndarray, labels: np.ndarray, what: str
) -> tuple[np.ndarray, np.ndarray]:
    if images.dtype != np.uint8 or images.ndim != 3:
        raise IDXError(
            f"{what} images: expected uint8 [N, rows, cols], got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise IDXError(
            f"{what} labels: shape {labels.shape} does not match {images.shape[0]} images"
        )
    x = images.reshape(images.shape[0], -1).astype(np.float32)
    x *= np.float32(1.0 / 255.0)
    return x, labels.astype(np.int32)


def _load_dir(directory: Path, source: str) -> MNIST:
    paths = [_find(directory, stem) for stem in MNIST_FILES]
    missing = [stem for stem, p in zip(MNIST_FILES, paths, strict=True) if p is None]
    if missing:
        raise FileNotFoundError(
            f"{directory}: missing {', '.join(missing)}; an MNIST directory holds the four "
            f"files {', '.join(MNIST_FILES)} (each optionally with a .gz suffix)"
        )
    arrays = [read_idx(p) for p in paths]  # type: ignore[arg-type]
    x_train, y_train = _images_labels(arrays[0], arrays[1], f"{directory} train")
    x_test, y_test = _images_labels(arrays[2], arrays[3], f"{directory} test")
    return MNIST(x_train, y_train, x_test, y_test, source)


def load_mnist(directory: str | os.PathLike[str] | None = None) -> MNIST:
    """Load MNIST-format data.

    ``directory=None`` loads the shipped 5,000-digit real MNIST subset (4,000 train / 1,000
    test, class-balanced; see ``simdist/data/mnist5k/README.md``). Otherwise ``directory``
    must hold the four standard files (plain or .gz): full MNIST, Fashion-MNIST, etc.
    """
    if directory is None:
        pkg = resources.files("simdist.data") / "mnist5k"
        # as_file gives a real path even if the package is imported from a zip.
        with resources.as_file(pkg) as path:
            return _load_dir(Path(path), "simdist mnist5k (real MNIST subset, 4000/1000)")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory (expected the four MNIST files)")
    return _load_dir(directory, str(directory))
