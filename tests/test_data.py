"""Datasets: IDX/MNIST loading, the shipped MNIST subset and text corpus, token shards, windows."""

import simdist  # noqa: F401  (first: pins threads before numpy loads)

# isort: split

import gzip
import struct

import numpy as np
import pytest

from simdist.data.mnist import MNIST_FILES, IDXError, load_mnist, read_idx, write_idx
from simdist.data.text import (
    SHARD_MAGIC,
    ShardError,
    TokenWindows,
    gather_windows,
    load_corpus_bytes,
    load_text_tokens,
    read_token_shard,
    unigram_entropy,
    write_token_shard,
)

# ---------------------------------------------------------------------------- IDX / MNIST


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize(
    "dtype,shape",
    [("u1", (7, 5, 3)), ("i1", (4,)), ("i2", (2, 3)), ("i4", (3, 2)), ("f4", (5,)), ("f8", (2, 2))],
)
def test_idx_round_trip(tmp_path, suffix, dtype, shape):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal(shape) * 100).astype(dtype)
    path = tmp_path / f"a.idx{suffix}"
    write_idx(path, arr)
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    np.testing.assert_array_equal(back, arr)
    back[...] = 0  # a writable, native-order array


def test_idx_layout_matches_mnist_spec(tmp_path):
    write_idx(tmp_path / "l", np.array([3, 1, 4], dtype=np.uint8))
    assert (tmp_path / "l").read_bytes() == b"\x00\x00\x08\x01\x00\x00\x00\x03\x03\x01\x04"
    write_idx(tmp_path / "s", np.array([[1, -2]], dtype=np.int16))
    assert (tmp_path / "s").read_bytes()[8:] == b"\x00\x00\x00\x02\x00\x01\xff\xfe"


def _valid_idx_bytes() -> bytes:
    return struct.pack(">BBBBII", 0, 0, 8, 2, 2, 3) + bytes(range(6))


@pytest.mark.parametrize(
    "data,message",
    [
        (_valid_idx_bytes()[:-1], "truncated"),
        (_valid_idx_bytes() + b"\x00", "trailing"),
        (_valid_idx_bytes()[:10], "truncated header"),
        (b"\x00\x00", "too short"),
        (b"\x01" + _valid_idx_bytes()[1:], "bad magic"),
        (b"\x00\x00\x07" + _valid_idx_bytes()[3:], "dtype code"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
    ],
)
def test_idx_rejects_malformed(tmp_path, data, message):
    path = tmp_path / "bad-idx"
    path.write_bytes(data)
    with pytest.raises(IDXError, match=message) as err:
        read_idx(path)
    assert "bad-idx" in str(err.value)


def test_idx_rejects_truncated_and_corrupt_gzip(tmp_path):
    good = gzip.compress(_valid_idx_bytes(), mtime=0)
    (tmp_path / "t.gz").write_bytes(good[:-6])
    with pytest.raises(IDXError, match="t.gz.*gzip"):
        read_idx(tmp_path / "t.gz")
    corrupt = bytearray(good)
    corrupt[-5] ^= 0xFF  # inside the stored CRC/size trailer
    (tmp_path / "c.gz").write_bytes(bytes(corrupt))
    with pytest.raises(IDXError, match="c.gz.*gzip"):
        read_idx(tmp_path / "c.gz")


def test_shipped_mnist_subset():
    m = load_mnist()
    assert m.x_train.shape == (4000, 784) and m.x_test.shape == (1000, 784)
    assert m.x_train.dtype == np.float32 and m.y_train.dtype == np.int32
    assert m.y_test.dtype == np.int32
    for x in (m.x_train, m.x_test):
        assert 0.0 <= x.min() and x.max() == 1.0
    # Class-balanced splits (the source csv is sorted by label; a naive split is not).
    assert np.bincount(m.y_train, minlength=10).tolist() == [400] * 10
    assert np.bincount(m.y_test, minlength=10).tolist() == [100] * 10
    # Shuffled: no long runs of one digit, so contiguous shards mix classes.
    assert len(np.unique(m.y_train[:100])) == 10
    # Real MNIST statistics: mean pixel ~0.13, ~19% of pixels lit.
    assert 0.11 < m.x_train.mean() < 0.15
    assert 0.15 < (m.x_train > 0).mean() < 0.23
    assert "mnist5k" in m.source
    # Train and test images are disjoint.
    train_rows = {r.tobytes() for r in m.x_train}
    assert not any(r.tobytes() in train_rows for r in m.x_test)


def _write_mnist_dir(directory, gz: bool, n_train: int = 6, n_test: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    arrays = [
        rng.integers(0, 256, size=(n_train, 4, 5), dtype=np.uint8),
        rng.integers(0, 10, size=n_train, dtype=np.uint8),
        rng.integers(0, 256, size=(n_test, 4, 5), dtype=np.uint8),
        rng.integers(0, 10, size=n_test, dtype=np.uint8),
    ]
    for i, (stem, arr) in enumerate(zip(MNIST_FILES, arrays, strict=True)):
        # Mix plain and gzipped files to check either is found.
        write_idx(directory / (stem + (".gz" if gz or i % 2 else "")), arr)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_directory(tmp_path, gz):
    arrays = _write_mnist_dir(tmp_path, gz)
    m = load_mnist(tmp_path)
    np.testing.assert_allclose(m.x_train, arrays[0].reshape(6, 20) / 255.0, rtol=1e-6)
    np.testing.assert_allclose(m.x_test, arrays[2].reshape(3, 20) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(m.y_train, arrays[1])
    np.testing.assert_array_equal(m.y_test, arrays[3])
    assert m.x_train.dtype == np.float32 and m.y_train.dtype == np.int32
    assert m.source == str(tmp_path)


def test_load_mnist_missing_files_lists_expected_names(tmp_path):
    _write_mnist_dir(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_mnist(tmp_path)
    msg = str(err.value)
    assert "missing t10k-labels-idx1-ubyte" in msg
    assert all(stem in msg for stem in MNIST_FILES)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_mnist(tmp_path / "nope")


def test_load_mnist_label_count_mismatch(tmp_path):
    _write_mnist_dir(tmp_path, gz=True)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(5, dtype=np.uint8))
    with pytest.raises(IDXError, match="does not match 6 images"):
        load_mnist(tmp_path)


# ---------------------------------------------------------------------------- token shards


def test_token_shard_round_trip_and_layout(tmp_path):
    tokens = np.array([0, 1, 50256, 65535, 7], dtype=np.int64)
    path = tmp_path / "x_train.bin"
    write_token_shard(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == 1024 + 2 * 5
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[:3].tolist() == [SHARD_MAGIC, 1, 5] and not header[3:].any()
    back = read_token_shard(path)
    assert back.dtype == np.uint16
    np.testing.assert_array_equal(back, tokens)


def _shard_bytes(magic=SHARD_MAGIC, version=1, count=3, n_tokens=3) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    return header.tobytes() + np.arange(n_tokens, dtype="<u2").tobytes()


@pytest.mark.parametrize(
    "data,message",
    [
        (_shard_bytes(magic=20240801), "bad magic"),
        (_shard_bytes(version=2), "version 2"),
        (_shard_bytes(n_tokens=2), "truncated"),
        (_shard_bytes(n_tokens=4), "trailing"),
        (_shard_bytes(count=-1, n_tokens=0), "truncated|trailing"),
        (_shard_bytes()[:100], "shorter than"),
    ],
)
def test_token_shard_rejects_malformed(tmp_path, data, message):
    path = tmp_path / "bad_val.bin"
    path.write_bytes(data)
    with pytest.raises(ShardError, match=message) as err:
        read_token_shard(path)
    assert "bad_val.bin" in str(err.value)


def test_write_token_shard_rejects_out_of_range(tmp_path):
    with pytest.raises(ValueError, match="0..65535"):
        write_token_shard(tmp_path / "a.bin", np.array([1, 70000]))
    with pytest.raises(ValueError, match="0..65535"):
        write_token_shard(tmp_path / "a.bin", np.array([-1]))


# ---------------------------------------------------------------------------- text loading


def test_shipped_corpus():
    text = load_corpus_bytes()
    assert text.startswith(b"EMMA\n\nBy Jane Austen")
    assert len(text) == 883_028
    train, val = load_text_tokens()
    assert train.dtype == np.uint16 and val.dtype == np.uint16
    assert len(val) == round(0.1 * len(text)) and len(train) + len(val) == len(text)
    np.testing.assert_array_equal(np.concatenate([train, val]), np.frombuffer(text, np.uint8))
    assert int(max(train.max(), val.max())) < 256
    # English prose: ~4.5 bits per byte of unigram entropy, and both splits agree.
    h_train, h_val = unigram_entropy(train, "bits"), unigram_entropy(val, "bits")
    assert 4.3 < h_train < 4.7 and abs(h_train - h_val) < 0.1


def test_load_text_file(tmp_path):
    data = bytes(range(256)) * 4  # 1024 bytes
    (tmp_path / "a.txt").write_bytes(data)
    train, val = load_text_tokens(str(tmp_path / "a.txt"))
    assert len(train) == 922 and len(val) == 102
    np.testing.assert_array_equal(val, np.frombuffer(data[-102:], np.uint8))
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(data))
    train_gz, _ = load_text_tokens(str(tmp_path / "b.txt.gz"))
    np.testing.assert_array_equal(train_gz, train)
    with pytest.raises(FileNotFoundError, match="no such text file"):
        load_text_tokens(str(tmp_path / "missing.txt"))


def test_load_llmc_shards(tmp_path):
    write_token_shard(tmp_path / "tinyshakespeare_train.bin", np.arange(10))
    write_token_shard(tmp_path / "tinyshakespeare_val.bin", np.arange(100, 104))
    for spec in (str(tmp_path / "tinyshakespeare_*.bin"), str(tmp_path)):
        train, val = load_text_tokens(spec)
        assert train.tolist() == list(range(10)) and val.tolist() == [100, 101, 102, 103]
    # Several shards per split are concatenated in name order (fineweb-style naming).
    write_token_shard(tmp_path / "fw_train_000002.bin", [7, 8])
    write_token_shard(tmp_path / "fw_train_000001.bin", [5, 6])
    write_token_shard(tmp_path / "fw_val_000000.bin", [9])
    train, val = load_text_tokens(str(tmp_path / "fw_*.bin"))
    assert train.tolist() == [5, 6, 7, 8] and val.tolist() == [9]


def test_load_llmc_shards_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no files"):
        load_text_tokens(str(tmp_path / "*.bin"))
    write_token_shard(tmp_path / "only_train.bin", [1, 2, 3])
    with pytest.raises(FileNotFoundError, match=r"\*val\*\.bin"):
        load_text_tokens(str(tmp_path / "*.bin"))


def test_unigram_entropy():
    uniform = np.arange(256, dtype=np.uint16).repeat(3)
    assert unigram_entropy(uniform, "bits") == pytest.approx(8.0)
    assert unigram_entropy(uniform) == pytest.approx(np.log(256))
    assert unigram_entropy(np.full(10, 65535, dtype=np.uint16)) == 0.0
    two = np.array([1, 1, 1, 2])  # p = 3/4, 1/4
    expected = -(0.75 * np.log2(0.75) + 0.25 * np.log2(0.25))
    assert unigram_entropy(two, "bits") == pytest.approx(expected)
    with pytest.raises(ValueError):
        unigram_entropy(two, "bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        unigram_entropy(np.array([], dtype=np.uint16))


# ---------------------------------------------------------------------------- windows


@pytest.mark.parametrize("n,T,expected", [(10, 3, 3), (10, 9, 1), (10, 10, 0), (11, 5, 2)])
def test_token_windows_count(n, T, expected):
    assert len(TokenWindows(np.arange(n, dtype=np.uint16), T)) == expected


def test_token_windows_samples_are_shifted_non_overlapping():
    tokens = (np.arange(23) * 7 % 256).astype(np.uint16)
    w = TokenWindows(tokens, 5)
    assert len(w) == 4
    for i in range(len(w)):
        x, y = w[i]
        np.testing.assert_array_equal(x, tokens[5 * i : 5 * i + 5])
        np.testing.assert_array_equal(y, tokens[5 * i + 1 : 5 * i + 6])


def test_gather_windows_fills_caller_buffers():
    tokens = np.arange(41, dtype=np.uint16)
    T, idx = 4, np.array([9, 0, 3, 3])
    out_x = np.full((4, T), -1, dtype=np.int32)
    out_y = np.full((4, T), -1, dtype=np.int32)
    x_ptr, y_ptr = out_x.ctypes.data, out_y.ctypes.data
    assert gather_windows(tokens, idx, T, out_x, out_y) is None
    assert out_x.ctypes.data == x_ptr and out_y.ctypes.data == y_ptr
    expected_x = np.stack([np.arange(i * T, i * T + T) for i in idx])
    np.testing.assert_array_equal(out_x, expected_x)
    np.testing.assert_array_equal(out_y, expected_x + 1)
    # The method form agrees and allocates int32 buffers when none are given.
    x2, y2 = TokenWindows(tokens, T).gather(idx)
    assert x2.dtype == np.int32
    np.testing.assert_array_equal(x2, out_x)
    np.testing.assert_array_equal(y2, out_y)


def test_gather_windows_validates():
    tokens = np.arange(41, dtype=np.uint16)  # 10 windows of 4
    out = np.zeros((1, 4), dtype=np.int64)
    with pytest.raises(IndexError, match="out of range"):
        gather_windows(tokens, np.array([10]), 4, out, out.copy())
    with pytest.raises(IndexError):
        gather_windows(tokens, np.array([-1]), 4, out, out.copy())
    with pytest.raises(ValueError, match="shape"):
        gather_windows(tokens, np.array([1, 2]), 4, out, out.copy())


@pytest.mark.parametrize(
    "preset", ["fc_mnist", "gpt2_mini", "bert_mini", "t5_mini", "transformer_mini"]
)
def test_a_training_batch_fills_its_buffers_without_allocating(preset):
    """train_batch copies into buffers allocated once: no batch-sized temporary per step
    (numpy's ``take`` buffers ``out`` unless told ``mode="clip"``: tracemalloc sees numpy's
    data allocations)."""
    import tracemalloc

    from simdist.config import load_params
    from simdist.data.datasets import build_dataset

    data = build_dataset(load_params(["--params", preset]), 16)
    rng = np.random.default_rng(0)
    first = data.train_batch(rng.permutation(data.num_train)[:16])
    indices = rng.permutation(data.num_train)[:16]
    tracing = tracemalloc.is_tracing()  # pytest may run under -X tracemalloc: leave it on
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        x, y = data.train_batch(indices)
        transient = tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()
    # the same buffers, refilled (views of them, where a dataset serves shorter batches)
    assert np.shares_memory(x, first[0]) and np.shares_memory(y, first[1])
    assert transient < min(x.nbytes, 4096), (transient, x.nbytes)  # not even an input copy
