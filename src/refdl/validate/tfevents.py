"""Scalars from TensorBoard event files, read as data (no TensorFlow, nothing executed).

An event file is a TFRecord stream: each record is a little-endian ``uint64`` length,
the masked CRC-32C of those 8 bytes, the payload, and the masked CRC-32C of the
payload; the payload is an ``Event`` protocol buffer (parsed with tensorboardX's
generated classes). Scalars arrive in two forms: ``simple_value`` (tensorboardX,
``torch.utils.tensorboard``, TF1) and a rank-0 ``tensor`` (TF2's ``tf.summary.scalar``).
Each is returned with its step and wall time, the wall time being what a steady-state
throughput can be computed from.

A damaged file is one clear error: a length whose CRC does not match, a payload whose
CRC does not match (checked for the records that give scalars), or a truncated record
other than the last (a run still writing leaves a partial last record, which is dropped
and counted).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError
from tensorboardX.crc32c import crc32c
from tensorboardX.proto import event_pb2

from refdl.config.files import read_bytes
from refdl.errors import UsageError

MAX_RECORD = 64 << 20  # a scalar event is ~100 bytes; a length beyond this is damage
MAX_FILE = 1 << 30  # an event file of a very long run
# TensorProto dtypes a scalar may carry, with their NumPy types
DTYPES = {1: np.float32, 2: np.float64, 3: np.int32, 9: np.int64, 19: np.float16}


@dataclasses.dataclass
class Scalar:
    """One logged scalar: its step, value and the wall time it was written at."""

    step: int
    value: float
    wall_time: float


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _value(v) -> float | None:
    """The number a summary value holds, or None when it is not a scalar."""
    if v.HasField("simple_value"):
        return float(v.simple_value)
    if not v.HasField("tensor"):
        return None
    t = v.tensor
    if t.tensor_shape.dim and any(d.size != 1 for d in t.tensor_shape.dim):
        return None
    kind = DTYPES.get(t.dtype)
    if kind is None:
        return None
    if t.tensor_content:
        arr = np.frombuffer(t.tensor_content, dtype=np.dtype(kind).newbyteorder("<"))
        return float(arr[0]) if arr.size == 1 else None
    for field in (t.float_val, t.double_val, t.int_val, t.int64_val, t.half_val):
        if len(field) == 1:
            return (
                float(field[0])
                if field is not t.half_val
                else float(np.array([field[0]], np.uint16).view(np.float16)[0])
            )
    return None


def read_scalars(path: Path) -> tuple[dict[str, list[Scalar]], int]:
    """``({tag: [Scalar, ...]}, dropped)`` from one event file; ``dropped`` counts a partial
    last record. Raises UsageError naming the file and the offset of any damage."""
    data = read_bytes(path, "TensorBoard event file", limit=MAX_FILE)
    out: dict[str, list[Scalar]] = {}
    pos, dropped = 0, 0
    while pos < len(data):
        if len(data) - pos < 12:
            dropped += 1
            break
        head = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", head)
        (head_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if head_crc != _masked(head) or length > MAX_RECORD:
            raise UsageError(
                f"{path}: not a TensorBoard event file, or damaged at byte {pos} "
                "(a record's length fails its checksum)"
            )
        end = pos + 12 + length + 4
        if end > len(data):
            dropped += 1
            break
        payload = data[pos + 12 : pos + 12 + length]
        pos = end
        try:
            event = event_pb2.Event.FromString(payload)
        except DecodeError:
            raise UsageError(f"{path}: damaged record at byte {pos - length - 16}") from None
        if not event.HasField("summary"):
            continue
        found = [(v.tag, x) for v in event.summary.value if (x := _value(v)) is not None]
        if not found:
            continue
        (crc,) = struct.unpack("<I", data[end - 4 : end])
        if crc != _masked(payload):
            raise UsageError(
                f"{path}: damaged record at byte {end - length - 16} "
                "(its payload fails its checksum)"
            )
        for tag, x in found:
            out.setdefault(tag, []).append(Scalar(int(event.step), x, float(event.wall_time)))
    return out, dropped


def event_files(path: Path) -> list[Path]:
    """The event files of ``path``: the file itself, or every ``*tfevents*`` file directly
    in the folder (a run folder), in name order (the names start with the time)."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.glob("*tfevents*") if p.is_file())
    if not files:
        raise UsageError(
            f"--results {path}: a folder with no TensorBoard event file "
            "(events.out.tfevents.*) in it"
        )
    return files


def read_event_scalars(path: Path) -> tuple[dict[str, list[Scalar]], int]:
    """Every scalar of an event file or of the event files in a folder, by tag, by step
    (a step written twice keeps its last value, as TensorBoard shows it)."""
    merged: dict[str, dict[int, Scalar]] = {}
    dropped = 0
    for f in event_files(path):
        scalars, d = read_scalars(f)
        dropped += d
        for tag, rows in scalars.items():
            for r in rows:
                merged.setdefault(tag, {})[r.step] = r
    return {tag: [rows[s] for s in sorted(rows)] for tag, rows in merged.items()}, dropped
