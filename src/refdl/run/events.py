"""TensorBoard event files written in the calling thread, so a failed write is raised
where it happens.

tensorboardX's ``SummaryWriter`` writes from a background thread: on a full disk
that thread dies and the next ``add_scalar`` blocks forever on its full queue (seen
on a 64 KiB tmpfs, 2026-11-24). This writer frames the same ``Event`` protocol
buffers as TFRecords itself (length, masked CRC32C of it, data, masked CRC32C) into a
fresh file it creates (``O_EXCL``: never a link someone planted).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c


class EventFile:
    """One ``events.out.tfevents.*`` file of scalars; ``purge_step`` (a resumed run)
    tells TensorBoard to hide an earlier file's steps from there on."""

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for n in range(100):  # a name no earlier writer used
            try:
                self.path = str(Path(folder) / f"{name}.{n}")
                fd = os.open(self.path, flags, 0o644)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"{folder}: no free event file name {name}.*")
        self._f = os.fdopen(fd, "wb")
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._write(Event(step=purge_step,
                              session_log=SessionLog(status=SessionLog.START)))  # fmt: skip
        self._f.flush()

    def _write(self, event: Event) -> None:
        data = event.SerializeToString()
        head = struct.pack("<Q", len(data))
        self._f.write(head + struct.pack("<I", masked_crc32c(head)) + data
                      + struct.pack("<I", masked_crc32c(data)))  # fmt: skip

    def scalar(self, tag: str, value: float, step: int, walltime: float) -> None:
        """One scalar at ``step`` (buffered; ``flush`` writes it)."""
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        self._write(Event(wall_time=walltime, step=step, summary=summary))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()
