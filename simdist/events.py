"""TensorBoard event files, written and read without TensorFlow or tensorboard.

An event file is a sequence of TFRecords::

    uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)

(all little-endian), each ``data`` a serialised ``tensorflow.Event`` protobuf. Only the fields
needed for scalars are encoded, by hand:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The first record carries ``file_version = "brain.Event:2"``, which TensorBoard expects.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from types import TracebackType

__all__ = ["crc32c", "masked_crc32c", "EventWriter", "read_events", "EventFileError"]

FILE_VERSION = "brain.Event:2"


def _make_crc32c_table() -> list[int]:
    # CRC-32C (Castagnoli), reflected polynomial 0x82F63B78: the checksum TFRecord uses.
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _make_crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data``; pass a previous result as ``crc`` to continue a running checksum."""
    table = _CRC32C_TABLE
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant.

    The mask stops a CRC over data that itself contains CRCs from degenerating.
    """
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --- protobuf wire format (just what Event needs) -------------------------------------------


def _varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # negative int64 -> two's complement, 10 bytes, as protobuf does
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field_bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _event(
    wall_time: float, step: int = 0, *, file_version: str = "", summary: bytes = b""
) -> bytes:
    msg = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step:
        msg += _varint(2 << 3 | 0) + _varint(step)
    if file_version:
        msg += _field_bytes(3, file_version.encode("utf-8"))
    if summary:
        msg += _field_bytes(5, summary)
    return msg


def _scalar_summary(tag: str, value: float) -> bytes:
    val = _field_bytes(1, tag.encode("utf-8")) + _varint(2 << 3 | 5) + struct.pack("<f", value)
    return _field_bytes(1, val)


def _record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class EventWriter:
    """Appends scalar summaries to a TensorBoard event file in ``logdir``.

    The file is ``events.out.tfevents.<unix time>.<hostname>[.<rank_suffix>]``; give each
    rank writing into one directory its own suffix so their files do not collide.
    """

    def __init__(self, logdir: str | os.PathLike[str], rank_suffix: str = "") -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        if rank_suffix:
            name += "." + rank_suffix.lstrip(".")
        # Never append to or clobber another writer's file (a restart, or a second writer
        # with the same suffix, within the same second): add ".<pid>.<n>" until the name is free.
        candidates = itertools.chain(
            [name], (f"{name}.{os.getpid()}.{n}" for n in itertools.count())
        )
        for candidate in candidates:
            self.path = self.logdir / candidate
            try:
                self._file = open(self.path, "xb")  # closed by close()
                break
            except FileExistsError:
                continue
        self._file.write(_record(_event(time.time(), file_version=FILE_VERSION)))
        self.flush()

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """Record ``value`` (stored as float32, like TensorBoard's simple_value) for ``tag``."""
        if self._file.closed:
            raise ValueError(f"{self.path}: writer is closed")
        summary = _scalar_summary(tag, float(value))
        event = _event(time.time() if wall_time is None else wall_time, int(step), summary=summary)
        self._file.write(_record(event))

    def flush(self) -> None:
        """Push buffered records to the OS so TensorBoard sees them while training runs."""
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --- reading ---------------------------------------------------------------------------------


class EventFileError(ValueError):
    """An event file is truncated or fails a CRC check."""


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise EventFileError("truncated varint in protobuf message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, object]]:
    """Decode one protobuf message into its (field number, wire type, raw value) triples."""
    out: list[tuple[int, int, object]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        value: object
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise EventFileError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise EventFileError("truncated protobuf field")
        out.append((field, wire, value))
    return out


def _records(data: bytes, name: str) -> list[bytes]:
    records, pos = [], 0
    while pos < len(data):
        if pos + 12 > len(data):
            raise EventFileError(f"{name}: truncated record header at byte {pos}")
        length_bytes = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if masked_crc32c(length_bytes) != length_crc:
            raise EventFileError(f"{name}: length CRC mismatch in record at byte {pos}")
        end = pos + 12 + length + 4
        if end > len(data):
            raise EventFileError(f"{name}: truncated record at byte {pos}")
        payload = data[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack("<I", data[end - 4 : end])
        if masked_crc32c(payload) != data_crc:
            raise EventFileError(f"{name}: data CRC mismatch in record at byte {pos}")
        records.append(payload)
        pos = end
    return records


def read_events(path: str | os.PathLike[str]) -> list[tuple[int, str, float]]:
    """All scalar summaries in an event file as (step, tag, value), in file order.

    Every record's CRCs are checked; a corrupt or truncated file raises ``EventFileError``.
    """
    out: list[tuple[int, str, float]] = []
    for payload in _records(Path(path).read_bytes(), str(path)):
        step = 0
        summaries: list[bytes] = []
        for field, wire, value in _fields(payload):
            if field == 2 and wire == 0:
                step = value - (1 << 64) if value >= 1 << 63 else value  # type: ignore[operator]
            elif field == 5 and wire == 2:
                summaries.append(value)  # type: ignore[arg-type]
        for summary in summaries:
            for field, wire, value in _fields(summary):
                if field != 1 or wire != 2:
                    continue
                tag, simple = None, None
                for vfield, vwire, v in _fields(value):  # type: ignore[arg-type]
                    if vfield == 1 and vwire == 2:
                        tag = v.decode("utf-8")  # type: ignore[union-attr]
                    elif vfield == 2 and vwire == 5:
                        (simple,) = struct.unpack("<f", v)  # type: ignore[arg-type]
                if tag is not None and simple is not None:
                    out.append((step, tag, simple))
    return out
