"""Data sets stored as tensorstore arrays (zarr) for random-access, sharded reading.

A store is a folder with ``train_x``, ``train_y``, ``test_x``, ``test_y`` zarr
arrays and ``info.json``. Reading a batch reads only the chunks holding those
examples, so each worker can read just its share of a global batch
(``worker_share`` of the indices) from a store far larger than memory.

Convert any registered data set::

    python -m refdl.data convert --dataset mnist --data-dir ~/mnist --out ~/mnist.zarr
    python -m refdl.train --dataset zarr --data-dir ~/mnist.zarr
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tensorstore as ts

from refdl.config.files import load_json, printable
from refdl.data.base import DataInfo, Dataset, DatasetDef, check_labels, register
from refdl.errors import DataError

_ARRAYS = ("train_x", "train_y", "test_x", "test_y")


def _spec(path: Path) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}


def _create(path: Path, shape: tuple[int, ...], dtype: np.dtype, chunk: int) -> ts.TensorStore:
    return ts.open(
        _spec(path),
        create=True,
        delete_existing=True,
        dtype=ts.dtype(np.dtype(dtype).name),
        shape=shape,
        chunk_layout=ts.ChunkLayout(chunk_shape=(min(chunk, max(shape[0], 1)), *shape[1:])),
    ).result()


def _only_files(root: Path) -> None:
    """Every entry of the store is a folder or a regular file (no FIFO to block on, no
    device, no link leading out of it)."""
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            mode = p.lstat().st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise DataError(f"{p}: not a regular file; a zarr store holds only files")


_INFO_TYPES = {"name": str, "kind": str, "input_shape": list, "input_dtype": str,
               "num_classes": int, "train_size": int, "test_size": int}  # fmt: skip


def _info(raw: object, meta: Path) -> DataInfo:
    """``info.json`` held to its schema: each key of its type, sizes positive."""
    if not isinstance(raw, dict):
        raise DataError(f"{meta}: malformed (not a table)")
    for key, kind in _INFO_TYPES.items():
        v = raw.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise DataError(f"{meta}: malformed ({key} must be a {kind.__name__})")
    if raw["kind"] not in ("image", "tokens") or raw["input_dtype"] not in ("float32", "int32"):
        raise DataError(f"{meta}: malformed (kind image or tokens, input_dtype float32 or int32)")
    shape = raw["input_shape"]
    if (
        not shape
        or len(shape) > 8
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 1 << 20 for d in shape
        )
    ):
        raise DataError(f"{meta}: malformed (input_shape must be 1 to 8 positive integers)")
    for key in ("num_classes", "train_size", "test_size"):
        if not 1 <= raw[key] <= 1 << 40:
            raise DataError(f"{meta}: malformed ({key} must be a positive integer)")
    vocab, baselines = raw.get("vocab", []), raw.get("baselines", {})
    if not isinstance(vocab, list) or not all(isinstance(w, str) for w in vocab):
        raise DataError(f"{meta}: malformed (vocab must be a list of words)")
    if not isinstance(baselines, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in baselines.values()
    ):
        raise DataError(f"{meta}: malformed (baselines must map names to numbers)")
    return DataInfo(printable(raw["name"]), raw["kind"], tuple(shape), raw["input_dtype"],
                    raw["num_classes"], raw["train_size"], raw["test_size"],
                    {str(k): float(v) for k, v in baselines.items()}, tuple(vocab))  # fmt: skip


def write_zarr(dataset: Dataset, out: str | Path, chunk: int = 256) -> Path:
    """Write ``dataset`` (train and test) as a zarr store at ``out``; returns the path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    info = dataset.info
    n = info.train_size
    parts = {"train": [], "test": list(dataset.test_batches(chunk))}
    first = dataset.train_batch(np.arange(min(n, 1)))
    arrays = {}
    for split, size in (("train", n), ("test", info.test_size)):
        sample = first if split == "train" else parts["test"][0]
        for key in ("x", "y"):
            a = sample[key]
            arrays[f"{split}_{key}"] = _create(
                out / f"{split}_{key}", (size, *a.shape[1:]), a.dtype, chunk
            )
    for start in range(0, n, chunk):
        batch = dataset.train_batch(np.arange(start, min(start + chunk, n)))
        for key in ("x", "y"):
            arrays[f"train_{key}"][start : start + len(batch[key])].write(batch[key]).result()
    start = 0
    for batch in parts["test"]:
        for key in ("x", "y"):
            arrays[f"test_{key}"][start : start + len(batch[key])].write(batch[key]).result()
        start += len(batch["x"])
    (out / "info.json").write_text(json.dumps(dataclasses.asdict(info), indent=1))
    return out


class ZarrDataset(Dataset):
    """A data set read lazily from a zarr store written by ``write_zarr``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta = self.path / "info.json"
        if not meta.exists():
            raise DataError(
                f"{meta}: missing; is {self.path} a store written by refdl.data convert?"
            )
        _only_files(self.path)
        self.info = _info(load_json(meta, "zarr store's", limit=64 << 20, error=DataError), meta)
        self.arrays = {}
        for name in _ARRAYS:
            try:
                self.arrays[name] = ts.open(_spec(self.path / name), open=True).result()
            except Exception as e:  # tensorstore raises ValueError with its own text
                raise DataError(f"{self.path / name}: cannot open zarr array ({e})") from None
        if self.arrays["train_x"].shape[0] != self.info.train_size:
            raise DataError(f"{self.path / 'train_x'}: size disagrees with info.json")
        if self.arrays["test_x"].shape[0] != self.info.test_size:
            raise DataError(f"{self.path / 'test_x'}: size disagrees with info.json")
        for name in ("train_y", "test_y"):  # labels are small: all checked once, here
            labels = np.asarray(self.arrays[name].read().result())
            check_labels(self.path / name, labels, self.info.num_classes)

    def train_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        idx = np.asarray(indices, np.int64)
        uniq, inverse = np.unique(idx, return_inverse=True)  # read each chunk once, in order
        out = {}
        for key in ("x", "y"):
            arr = self.arrays[f"train_{key}"]
            out[key] = np.asarray(arr[uniq].read().result())[inverse]
        return out

    def test_batches(self, chunk: int = 512) -> Iterator[dict[str, np.ndarray]]:
        n = self.info.test_size
        for i in range(0, n, chunk):
            yield {
                key: np.asarray(self.arrays[f"test_{key}"][i : min(i + chunk, n)].read().result())
                for key in ("x", "y")
            }


register(
    DatasetDef(
        "zarr",
        ZarrDataset,
        "image",
        {},
        needs_dir=True,
        doc="a store written by refdl.data convert",
    )
)
