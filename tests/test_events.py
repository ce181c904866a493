"""TensorBoard event files: CRC-32C, record framing, round trip, and tensorboard's own reader."""

import simdist  # noqa: F401  (first: pins threads before numpy loads)

# isort: split

import socket
import struct
import time

import numpy as np
import pytest

from simdist.events import EventFileError, EventWriter, crc32c, masked_crc32c, read_events


@pytest.mark.parametrize(
    "data,expected",
    [
        (b"", 0x00000000),
        (b"a", 0xC1D04330),
        (b"123456789", 0xE3069283),
        # iSCSI test vectors, RFC 3720 appendix B.4
        (bytes(32), 0x8A9136AA),
        (b"\xff" * 32, 0x62A8AB43),
        (bytes(range(32)), 0x46DD794E),
        (bytes(range(31, -1, -1)), 0x113FDB5C),
    ],
)
def test_crc32c_known_vectors(data, expected):
    assert crc32c(data) == expected


def test_crc32c_continues_and_mask():
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283
    crc = 0xE3069283
    assert masked_crc32c(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) % 2**32


def _write(tmp_path, suffix="rank0"):
    with EventWriter(tmp_path, rank_suffix=suffix) as w:
        w.scalar("train/loss", 2.5, 0)
        w.scalar("train/loss", 1.25, 1)
        w.scalar("lr", 3e-4, 1)
        w.scalar("neg_step", -1.0, -7)
        w.scalar("big_step", np.float64(0.1), 2**40)
        w.scalar("ünïcode", 1.0, 3)
    return w.path


def test_round_trip(tmp_path):
    path = _write(tmp_path)
    assert read_events(path) == [
        (0, "train/loss", 2.5),
        (1, "train/loss", 1.25),
        (1, "lr", float(np.float32(3e-4))),
        (-7, "neg_step", -1.0),
        (2**40, "big_step", float(np.float32(0.1))),
        (3, "ünïcode", 1.0),
    ]


def test_file_name_and_first_record(tmp_path):
    path = _write(tmp_path, suffix="rank3")
    name = path.name
    assert name.startswith("events.out.tfevents.")
    assert name.endswith(f".{socket.gethostname()}.rank3")
    stamp = name.split(".")[3]
    assert stamp.isdigit() and abs(int(stamp) - time.time()) < 600
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    first = raw[12 : 12 + length]
    assert first[0] == 0x09  # wall_time, field 1, fixed64
    assert first[9:] == b"\x1a\x0dbrain.Event:2"  # file_version, field 3


# Produced by tensorboard 2.21.0 (its protobuf Event and RecordWriter) for
# Event(wall_time=1.5, step=3, summary=[Value(tag="loss", simple_value=0.25)]): pins the
# encoding and the masked CRCs byte for byte without needing tensorboard installed.
GOLDEN_SCALAR_RECORD = bytes.fromhex(
    "1a00000000000000129bd82d09000000000000f83f10032a0d0a0b0a046c6f7373150000803ed054b255"
)


def test_scalar_record_matches_tensorboard_bytes(tmp_path):
    with EventWriter(tmp_path) as w:
        w.scalar("loss", 0.25, 3, wall_time=1.5)
    raw = w.path.read_bytes()
    (first_len,) = struct.unpack("<Q", raw[:8])
    assert raw[12 + first_len + 4 :] == GOLDEN_SCALAR_RECORD


def test_writers_never_share_a_file(tmp_path):
    paths = {_write(tmp_path, suffix="r") for _ in range(3)}
    assert len(paths) == 3 and all(len(read_events(p)) == 6 for p in paths)


def test_closed_writer_rejects_scalars(tmp_path):
    w = EventWriter(tmp_path)
    w.close()
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.scalar("x", 1.0, 0)


def test_flush_makes_records_visible(tmp_path):
    w = EventWriter(tmp_path)
    w.scalar("x", 4.0, 5)
    w.flush()
    assert read_events(w.path) == [(5, "x", 4.0)]
    w.close()


@pytest.mark.parametrize("where", [3, 10, 30, -2])
def test_corrupt_byte_is_detected(tmp_path, where):
    path = _write(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(EventFileError, match="CRC mismatch"):
        read_events(path)


def test_truncated_file_is_detected(tmp_path):
    path = _write(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(EventFileError, match="truncated"):
        read_events(path)


def test_tensorboard_reads_our_files(tmp_path):
    """TensorBoard's own loader (the `test` extra installs tensorboard, so this runs in CI)."""
    from tensorboard.backend.event_processing import event_accumulator as accumulator
    from tensorboard.backend.event_processing import event_file_loader as loader_mod

    path = _write(tmp_path)

    # Raw protobuf as written, parsed by tensorboard's copy of the Event proto.
    from tensorboard.compat.proto import event_pb2

    events = [
        event_pb2.Event.FromString(r) for r in loader_mod.RawEventFileLoader(str(path)).Load()
    ]
    assert events[0].file_version == "brain.Event:2"
    got = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
    assert got == read_events(path)

    # TensorBoard's scalar pipeline (what the dashboard shows).
    acc = accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "lr", "neg_step", "big_step", "ünïcode"}
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(0, 2.5), (1, 1.25)]


def test_float32_overflow_and_non_finite_values(tmp_path):
    with EventWriter(tmp_path) as w:
        w.scalar("big", 1e39, 0)
        w.scalar("small", -1e39, 1)
        w.scalar("nan", float("nan"), 2)
        w.scalar("zero", 0.0, 3)
    got = read_events(w.path)
    assert got[:2] == [(0, "big", float("inf")), (1, "small", float("-inf"))]
    assert got[2][:2] == (2, "nan") and np.isnan(got[2][2])
    assert got[3] == (3, "zero", 0.0)
