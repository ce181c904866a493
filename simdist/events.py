"""TensorBoard event files: written and read here, every record's CRCs checked on reading.

An event file is a sequence of TFRecords: the data's length (uint64, little-endian), the
masked CRC-32C of those 8 bytes, the data (a serialised ``tensorflow.Event`` protobuf), the
masked CRC-32C of the data. Scalars need only a few fields of two messages, so this module
encodes and decodes them itself (no tensorboardX or protobuf at run time: tensorboardX's
package import pulls in PyTorch when it is installed, seconds on every rank of every run):

    Event:         wall_time = 1 (double)   step = 2 (int64)   file_version = 3 (string)
                   summary = 5 (Summary)
    Summary:       value = 1 (repeated Value)
    Summary.Value: tag = 1 (string)   simple_value = 2 (float, in a oneof)

The writer emits what protobuf's own serialiser does (fields in number order, proto3 zero
scalars left out, the oneof's simple_value always present); tests/test_events.py pins a
record byte for byte against tensorboard's and reads our files with tensorboard's loader.
The first record carries ``file_version = "brain.Event:2"``, which TensorBoard expects.
Each writer claims its own file (exclusive create), so two writers in one directory within
the same second (a restart, ranks sharing a suffix) never clobber each other.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from pathlib import Path
from types import TracebackType

__all__ = ["crc32c", "masked_crc32c", "EventWriter", "read_events", "EventFileError"]

FILE_VERSION = "brain.Event:2"
_FLOAT32_MAX = 3.4028234663852886e38


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data``; pass a previous result as ``crc`` to continue a running checksum."""
    crc ^= 0xFFFFFFFF
    table = _CRC_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum: CRC-32C rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --- protobuf wire format, the little of it scalars need --------------------------------------


def _varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # int64: negatives as 10-byte two's complement, as protobuf
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int = 0, file_version: str = "", summary: bytes = b"") -> bytes:
    out = b""
    if wall_time != 0.0:
        out += b"\x09" + struct.pack("<d", wall_time)
    if step != 0:
        out += b"\x10" + _varint(step)
    if file_version:
        out += _length_delimited(3, file_version.encode())
    if summary:
        out += _length_delimited(5, summary)
    return out


def _scalar_summary(tag: str, value: float) -> bytes:
    if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
        value = math.copysign(math.inf, value)  # float32 overflows to inf, as protobuf stores it
    entry = _length_delimited(1, tag.encode()) if tag else b""
    return _length_delimited(1, entry + b"\x15" + struct.pack("<f", value))


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of every field: varints as int, fixed64/fixed32 and
    length-delimited fields as their bytes. Malformed input raises ValueError."""
    out, pos = [], 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= len(data) or shift > 63:
                raise ValueError(f"bad varint at byte {pos}")
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while pos < len(data):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            out.append((field, varint()))
            continue
        size = {1: 8, 5: 4}.get(wire)
        if wire == 2:
            size = varint()
        if size is None or pos + size > len(data):
            raise ValueError(f"bad field {field} (wire type {wire}) at byte {pos}")
        out.append((field, data[pos : pos + size]))
        pos += size
    return out


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
        # Claim a name no other writer has (a restart, or a second writer with the same
        # suffix, within the same second) by creating it exclusively, adding ".<pid>.<n>"
        # until one is free.
        candidates = itertools.chain(
            [name], (f"{name}.{os.getpid()}.{n}" for n in itertools.count())
        )
        for candidate in candidates:
            self.path = self.logdir / candidate
            try:
                self._file = open(self.path, "xb")  # noqa: SIM115 (closed by close())
                break
            except FileExistsError:
                continue
        self._closed = False
        self._write(_event(time.time(), file_version=FILE_VERSION))
        self.flush()

    def _write(self, event: bytes) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: writer is closed")
        header = struct.pack("<Q", len(event))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)))
        self._file.write(event + struct.pack("<I", masked_crc32c(event)))

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """Record ``value`` (stored as float32, like TensorBoard's simple_value) for ``tag``."""
        wall = time.time() if wall_time is None else wall_time
        self._write(_event(wall, step=int(step), summary=_scalar_summary(tag, float(value))))

    def flush(self) -> None:
        """Push buffered records to disk so TensorBoard sees them while training runs."""
        if not self._closed:
            self._file.flush()

    def close(self) -> None:
        if not self._closed:
            self._file.close()
            self._closed = True

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


def _records(data: bytes, name: str) -> list[bytes]:
    # TFRecord framing with both CRCs checked: TensorBoard's own loader stops quietly at a
    # bad record (it expects files still being written), which would hide corruption here.
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


def _scalars(event: bytes) -> list[tuple[int, str, float]]:
    step, values = 0, []
    for field, value in _fields(event):
        if field == 2 and isinstance(value, int):
            step = value - (1 << 64) if value >= 1 << 63 else value  # int64
        elif field == 5 and isinstance(value, bytes):
            for number, entry in _fields(value):
                if number != 1 or not isinstance(entry, bytes):
                    continue
                tag, simple = "", None
                for f, v in _fields(entry):
                    if f == 1 and isinstance(v, bytes):
                        tag = v.decode()
                    elif f == 2 and isinstance(v, bytes) and len(v) == 4:
                        (simple,) = struct.unpack("<f", v)
                    elif f in (3, 4, 5, 6, 8):  # another member of the value oneof
                        simple = None
                if simple is not None:
                    values.append((tag, simple))
    return [(step, tag, value) for tag, value in values]


def read_events(path: str | os.PathLike[str]) -> list[tuple[int, str, float]]:
    """All scalar summaries in an event file as (step, tag, value), in file order.

    Every record's CRCs are checked; a corrupt or truncated file raises ``EventFileError``.
    """
    out: list[tuple[int, str, float]] = []
    for payload in _records(Path(path).read_bytes(), str(path)):
        try:
            out.extend(_scalars(payload))
        except ValueError as e:  # (UnicodeDecodeError too)
            raise EventFileError(f"{path}: undecodable event: {e}") from None
    return out
