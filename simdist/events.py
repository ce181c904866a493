"""TensorBoard event files: written with tensorboardX, read back with a CRC check.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, a serialised
``tensorflow.Event`` protobuf, masked CRC-32C of the data). tensorboardX supplies the
protobuf classes, the record framing and the checksums; this module only chooses the file
name (one per writer, never reusing another writer's file) and writes scalars.

The first record carries ``file_version = "brain.Event:2"``, which TensorBoard expects.
tensorboardX's ``SummaryWriter`` is not used as is: it writes from a background thread and
opens its file with "wb", so two writers in one directory within the same second (a restart,
or ranks sharing a suffix) would clobber each other's files.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from types import TracebackType

from tensorboardX.crc32c import crc_update
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import RecordWriter, masked_crc32c

__all__ = ["crc32c", "masked_crc32c", "EventWriter", "read_events", "EventFileError"]

FILE_VERSION = "brain.Event:2"


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data``; pass a previous result as ``crc`` to continue a running checksum."""
    return crc_update(crc, data)


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
        # until one is free; tensorboardX's RecordWriter then opens the file we own.
        candidates = itertools.chain(
            [name], (f"{name}.{os.getpid()}.{n}" for n in itertools.count())
        )
        for candidate in candidates:
            self.path = self.logdir / candidate
            try:
                with open(self.path, "xb"):
                    break
            except FileExistsError:
                continue
        self._writer: RecordWriter | None = RecordWriter(str(self.path))
        self._write(Event(wall_time=time.time(), file_version=FILE_VERSION))
        self.flush()

    def _write(self, event: Event) -> None:
        if self._writer is None:
            raise ValueError(f"{self.path}: writer is closed")
        self._writer.write(event.SerializeToString())

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """Record ``value`` (stored as float32, like TensorBoard's simple_value) for ``tag``."""
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        wall = time.time() if wall_time is None else wall_time
        self._write(Event(wall_time=wall, step=int(step), summary=summary))

    def flush(self) -> None:
        """Push buffered records to disk so TensorBoard sees them while training runs."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

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


def read_events(path: str | os.PathLike[str]) -> list[tuple[int, str, float]]:
    """All scalar summaries in an event file as (step, tag, value), in file order.

    Every record's CRCs are checked; a corrupt or truncated file raises ``EventFileError``.
    """
    out: list[tuple[int, str, float]] = []
    for payload in _records(Path(path).read_bytes(), str(path)):
        try:
            event = Event.FromString(payload)
        except Exception as e:  # protobuf's DecodeError; its module path varies by version
            raise EventFileError(f"{path}: undecodable event: {e}") from None
        for v in event.summary.value:
            if v.WhichOneof("value") == "simple_value":
                out.append((event.step, v.tag, v.simple_value))
    return out
