"""Readers for the on-disk formats users have, and the data sets built on them.

- MNIST / Fashion-MNIST IDX files (optionally ``.gz``): ``mnist``, ``fashion_mnist``
  read ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` from ``--data-dir``.
- CIFAR-10 python batches: ``cifar10`` reads ``data_batch_1..5`` and
  ``test_batch`` (the ``cifar-10-batches-py`` folder).
- PTB-style text: ``ptb`` reads ``ptb.train.txt`` and ``ptb.test.txt`` (one
  sentence a line, words split on white space, ``<eos>`` after each line).

Every problem with a file raises ``DataError`` naming the file and what is wrong.
Writers for IDX and CIFAR batches exist so tests (and converters) can make small
real files.
"""

from __future__ import annotations

import collections
import gzip
import io
import math
import os
import pickle
import pickletools
import struct
import zlib
from pathlib import Path

import numpy as np

from refdl.config.files import open_regular, read_bytes, read_text
from refdl.config.values import Int, Option
from refdl.data.base import (
    ArrayDataset,
    DataInfo,
    DatasetDef,
    check_labels,
    register,
    text_dataset,
)
from refdl.errors import DataError

# IDX type codes (LeCun's format description): code -> big-endian dtype.
_IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {v.newbyteorder("="): k for k, v in _IDX_TYPES.items()}


IDX_CLASSES = 10  # MNIST's digits, Fashion-MNIST's garments
IDX_LIMIT = 4 << 30  # bytes of an IDX payload (MNIST's images: 47 MB)
CIFAR_LIMIT = 256 << 20  # bytes of a CIFAR python batch (each is 31 MB)
CIFAR_OPS = 1_000_000  # pickle opcodes in a batch (about 20,000 in a real one)
TEXT_LIMIT = 2 << 30  # bytes of a PTB-style text file (ptb.train.txt: 5 MB)


def _open(path: Path):
    """A data file opened for reading once it is a regular file (a FIFO is refused, not
    waited on); ``.gz`` decompressed as read."""
    f = os.fdopen(open_regular(path, "data file", IDX_LIMIT, DataError), "rb")
    return gzip.GzipFile(fileobj=f, mode="rb") if path.suffix == ".gz" else f


def _find(data_dir: str | Path, name: str) -> Path:
    """``name`` or ``name.gz`` in ``data_dir``; a DataError naming both if neither exists."""
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"{d}: not a readable directory (check --data-dir)")
    for cand in (d / name, d / f"{name}.gz"):
        if cand.exists():  # a FIFO or folder there is refused by the reader, by name
            return cand
    raise DataError(f"{d / name}: missing (also looked for {name}.gz)")


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file as a NumPy array (native byte order)."""
    path = Path(path)
    try:
        with _open(path) as f:
            head = f.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0:
                raise DataError(f"{path}: not an IDX file (bad magic number)")
            code, ndim = head[2], head[3]
            if code not in _IDX_TYPES:
                raise DataError(f"{path}: unknown IDX element type 0x{code:02x}")
            dims = f.read(4 * ndim)
            if len(dims) < 4 * ndim:
                raise DataError(f"{path}: truncated IDX header")
            shape = struct.unpack(f">{ndim}I", dims)
            dtype = _IDX_TYPES[code]
            expected = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
            if expected > IDX_LIMIT:
                raise DataError(f"{path}: IDX header {shape} asks for {expected} bytes, more "
                                f"than the {IDX_LIMIT} refdl reads")  # fmt: skip
            body = f.read(expected + 1)  # never more than the header promised, plus one
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: damaged or truncated gzip file ({e})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(body) != expected:
        got = "more" if len(body) > expected else f"{len(body)}"
        raise DataError(f"{path}: IDX body has {got} bytes, header {shape} needs {expected}")
    return np.frombuffer(body, dtype).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (``.gz`` compressed if the name ends so)."""
    path = Path(path)
    a = np.asarray(array)
    code = _IDX_CODES.get(a.dtype)
    if code is None:
        raise ValueError(f"IDX cannot store dtype {a.dtype}")
    data = bytes([0, 0, code, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape)
    data += a.astype(_IDX_TYPES[code]).tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(data)


def _idx_pair(data_dir: str, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    images_path = _find(data_dir, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(data_dir, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise DataError(f"{images_path}: expected [N, H, W] images, got shape {images.shape}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(f"{labels_path}: {labels.shape} labels do not match {len(images)} images")
    if len(images) == 0:
        raise DataError(f"{images_path}: holds no examples")
    check_labels(labels_path, labels.astype(np.int64), IDX_CLASSES)
    x = (images.astype(np.float32) / 255.0)[..., None]
    return x, labels.astype(np.int32)


def load_idx_dataset(data_dir: str, name: str = "mnist") -> ArrayDataset:
    """MNIST-format IDX train/test files as a data set (pixels scaled to [0, 1])."""
    train, test = _idx_pair(data_dir, "train"), _idx_pair(data_dir, "t10k")
    info = DataInfo(
        name, "image", train[0].shape[1:], "float32", IDX_CLASSES, len(train[0]), len(test[0])
    )
    return ArrayDataset(info, train, test)


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles only what a CIFAR batch holds - dicts, lists, strings, bytes, numbers and
    NumPy arrays - and refuses every other global, so a crafted file cannot run code:
    ``find_class`` is the only way a pickle reaches a callable."""

    ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"),
        }
    )

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: data files are data")


def _shallow_pickle(path: Path, raw: bytes) -> None:
    """A CIFAR batch is a flat dict: refuse a pickle with too many opcodes or nested
    containers before unpickling it (a nested-list bomb takes minutes and gigabytes)."""
    depth = 0
    try:
        for n, (op, _, _) in enumerate(pickletools.genops(raw)):
            if n > CIFAR_OPS:
                raise DataError(f"{path}: not a CIFAR python batch (over {CIFAR_OPS} opcodes)")
            if op.name == "MARK":
                depth += 1
            elif op.name in ("LIST", "TUPLE", "DICT", "APPENDS", "SETITEMS", "OBJ", "BUILD_SET"):
                depth = max(depth - 1, 0)
            if depth > 4:
                raise DataError(f"{path}: not a CIFAR python batch (nested containers)")
    except DataError:
        raise
    except Exception as e:  # genops meets bytes that are no pickle
        raise DataError(f"{path}: not a CIFAR python batch ({type(e).__name__}: {e})") from None


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: images ``[N, 32, 32, 3]`` uint8 and labels (read with
    ``_BatchUnpickler``: nothing in the file is executed)."""
    path = Path(path)
    raw = read_bytes(path, "CIFAR batch", CIFAR_LIMIT, DataError)
    _shallow_pickle(path, raw)
    try:
        d = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # untrusted bytes: whatever the unpickler trips on, it is not a batch
        raise DataError(f"{path}: not a CIFAR python batch ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
        raise DataError(f"{path}: not a CIFAR python batch (no b'data' / b'labels' keys)")
    if not isinstance(d[b"data"], np.ndarray) or not isinstance(d[b"labels"], list | np.ndarray):
        raise DataError(f"{path}: not a CIFAR python batch (data is not an array of pixels)")
    flat = isinstance(d[b"labels"], np.ndarray) or all(
        isinstance(v, int) and not isinstance(v, bool) for v in d[b"labels"]
    )
    if not flat:  # a nested list would be expanded by NumPy: refused before it is
        raise DataError(f"{path}: not a CIFAR python batch (labels are not a list of integers)")
    try:
        data = np.asarray(d[b"data"], np.uint8)
        labels = np.asarray(d[b"labels"], np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise DataError(f"{path}: not a CIFAR python batch ({e})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (len(data),):
        raise DataError(f"{path}: expected data [N, 3072] and N labels, got {data.shape}")
    if len(data) == 0:
        raise DataError(f"{path}: holds no examples")
    check_labels(path, labels, 10)
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels.astype(np.int32)


def write_cifar_batch(path: str | Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write a CIFAR-10 python batch (images ``[N, 32, 32, 3]`` uint8)."""
    data = np.asarray(images, np.uint8).transpose(0, 3, 1, 2).reshape(len(images), -1)
    with open(path, "wb") as f:
        pickle.dump({b"data": data, b"labels": [int(v) for v in labels]}, f)


def load_cifar10(data_dir: str) -> ArrayDataset:
    """CIFAR-10 from its python batches (pixels scaled to [0, 1])."""
    d = Path(data_dir)
    names = sorted(p.name for p in d.glob("data_batch_*")) if d.is_dir() else []
    if not names:
        _find(data_dir, "data_batch_1")  # raises the right message
    parts = [read_cifar_batch(d / n) for n in names]
    tx = np.concatenate([p[0] for p in parts])
    ty = np.concatenate([p[1] for p in parts])
    ex, ey = read_cifar_batch(_find(data_dir, "test_batch"))
    scale = lambda a: a.astype(np.float32) / 255.0  # noqa: E731
    info = DataInfo("cifar10", "image", (32, 32, 3), "float32", 10, len(tx), len(ex))
    return ArrayDataset(info, (scale(tx), ty), (scale(ex), ey))


def read_ptb(path: str | Path) -> list[str]:
    """A PTB-style text file as a list of words, ``<eos>`` after every line."""
    path = Path(path)
    text = read_text(path, "text file", TEXT_LIMIT, DataError)
    words = [w for line in text.splitlines() for w in [*line.split(), "<eos>"]]
    if not words:
        raise DataError(f"{path}: empty")
    return words


def load_ptb(data_dir: str, seq_len: int = 20) -> ArrayDataset:
    """PTB word-level: vocabulary from the training file (by frequency, then alphabetically)."""
    train = read_ptb(_find(data_dir, "ptb.train.txt"))
    test = read_ptb(_find(data_dir, "ptb.test.txt"))
    counts = collections.Counter(train)
    vocab = tuple(sorted(counts, key=lambda w: (-counts[w], w)))
    if "<unk>" not in counts:
        vocab = (*vocab, "<unk>")
    index = {w: i for i, w in enumerate(vocab)}
    unk = index["<unk>"]
    ids = lambda ws: np.asarray([index.get(w, unk) for w in ws], np.int32)  # noqa: E731
    return text_dataset("ptb", ids(train), ids(test), vocab, seq_len)


register(
    DatasetDef(
        "mnist",
        lambda d: load_idx_dataset(d, "mnist"),
        "image",
        {},
        needs_dir=True,
        doc="a folder of MNIST IDX files",
    )
)
register(
    DatasetDef(
        "fashion_mnist",
        lambda d: load_idx_dataset(d, "fashion_mnist"),
        "image",
        {},
        needs_dir=True,
        doc="a folder of Fashion-MNIST IDX files",
    )
)
register(
    DatasetDef(
        "cifar10", load_cifar10, "image", {}, needs_dir=True, doc="the cifar-10-batches-py folder"
    )
)
register(
    DatasetDef(
        "ptb",
        load_ptb,
        "tokens",
        {"seq_len": Option(20, Int(1, 1 << 16), "tokens per window")},
        needs_dir=True,
        doc="a folder with ptb.train.txt and ptb.test.txt",
    )
)
