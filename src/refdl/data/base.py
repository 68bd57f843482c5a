"""Data sets: what every data set provides, and the registry they are found in."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from refdl.config.values import Option, parse_options
from refdl.errors import DataError, UsageError
from refdl.registry import Registry


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about a data set.

    ``kind`` is ``"image"`` (x: float32 ``[N, H, W, C]``, y: class ids) or
    ``"tokens"`` (x, y: int32 ``[N, T]``, y is x shifted by one token);
    ``num_classes`` is the number of classes or the vocabulary size.
    """

    name: str
    kind: str
    input_shape: tuple[int, ...]
    input_dtype: str
    num_classes: int
    train_size: int
    test_size: int
    baselines: dict[str, float] = dataclasses.field(default_factory=dict)
    vocab: tuple[str, ...] = ()


def check_labels(path: object, labels: np.ndarray, classes: int | None = None) -> None:
    """Labels are class ids: integers from 0 (and below ``classes`` when it is known)."""
    if labels.size and labels.min() < 0:
        raise DataError(f"{path}: label {int(labels.min())} is negative; labels are class ids")
    if classes is not None and labels.size and labels.max() >= classes:
        raise DataError(f"{path}: label {int(labels.max())} is not below {classes} classes")


class Dataset:
    """Random access to training examples by index, and the test set in chunks."""

    info: DataInfo

    def train_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """``{"x": ..., "y": ...}`` for the training examples at ``indices`` (in that order)."""
        raise NotImplementedError

    def test_batches(self, chunk: int = 512) -> Iterator[dict[str, np.ndarray]]:
        """The whole test set in chunks of at most ``chunk`` examples."""
        raise NotImplementedError


class ArrayDataset(Dataset):
    """A data set held in memory as NumPy arrays."""

    def __init__(
        self,
        info: DataInfo,
        train: tuple[np.ndarray, np.ndarray],
        test: tuple[np.ndarray, np.ndarray],
    ) -> None:
        self.info = info
        self.train_x, self.train_y = train
        self.test_x, self.test_y = test
        if len(self.train_x) != info.train_size or len(self.test_x) != info.test_size:
            raise ValueError("DataInfo sizes do not match the arrays")

    def train_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"x": self.train_x[indices], "y": self.train_y[indices]}

    def test_batches(self, chunk: int = 512) -> Iterator[dict[str, np.ndarray]]:
        for i in range(0, len(self.test_x), chunk):
            yield {"x": self.test_x[i : i + chunk], "y": self.test_y[i : i + chunk]}


@dataclasses.dataclass(frozen=True)
class DatasetDef:
    """A registered data set: ``load(data_dir, options)`` builds it.

    ``options`` are its knobs, each an ``Option`` with its default, type and range
    (``--data-opt KEY=VALUE``, checked before anything is read);
    ``needs_dir`` says whether ``--data-dir`` is required.
    """

    name: str
    load: Callable[..., Dataset]
    kind: str
    options: dict[str, Option]
    needs_dir: bool = False
    doc: str = ""

    def defaults_of_options(self) -> dict[str, Any]:
        """Each option's default value."""
        return {k: o.default for k, o in self.options.items()}

    def make(self, data_dir: str | None, overrides: dict[str, str] | None = None) -> Dataset:
        if self.needs_dir and not data_dir:
            raise UsageError(
                f"data set {self.name!r} reads files: pass --data-dir DIR ({self.doc})"
            )
        if data_dir and not self.needs_dir:  # a folder it would not read: the user's mistake
            readers = ", ".join(n for n in DATASETS.names() if DATASETS.get(n).needs_dir)
            raise UsageError(
                f"data set {self.name!r} ({self.doc}) reads no folder; drop --data-dir, or "
                f"choose a data set that reads one: {readers}"
            )
        opts = parse_options(self.options, overrides or {}, f"data set {self.name!r}", "--data-opt")
        if self.needs_dir:
            return self.load(data_dir, **opts)
        return self.load(**opts)


DATASETS: Registry[DatasetDef] = Registry("data set")


def register(ds: DatasetDef) -> DatasetDef:
    """Register ``ds`` under its name."""
    return DATASETS.register(ds.name)(ds)


def token_windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of ``seq_len + 1`` tokens: inputs ``w[:-1]``, targets ``w[1:]``.

    >>> x, y = token_windows(np.arange(7), 3)
    >>> x.tolist(), y.tolist()
    ([[0, 1, 2], [3, 4, 5]], [[1, 2, 3], [4, 5, 6]])
    """
    if seq_len <= 0:
        raise UsageError(f"seq_len must be > 0 (got {seq_len})")
    n = (len(ids) - 1) // seq_len
    if n <= 0:
        raise UsageError(f"text of {len(ids)} tokens is too short for seq_len={seq_len}")
    x = np.lib.stride_tricks.sliding_window_view(ids[: n * seq_len], seq_len)[::seq_len]
    y = np.lib.stride_tricks.sliding_window_view(ids[1 : n * seq_len + 1], seq_len)[::seq_len]
    return np.ascontiguousarray(x, np.int32), np.ascontiguousarray(y, np.int32)


def unigram_perplexity(train_ids: np.ndarray, test_ids: np.ndarray, vocab: int) -> float:
    """Perplexity on ``test_ids`` of the add-one-smoothed unigram model of ``train_ids``:
    the baseline a language model must clearly beat."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-np.mean(logp[test_ids])))


def text_dataset(
    name: str,
    train_ids: np.ndarray,
    test_ids: np.ndarray,
    vocab: tuple[str, ...],
    seq_len: int,
) -> ArrayDataset:
    """A token data set of windows from a train and a test token stream."""
    train = token_windows(train_ids, seq_len)
    test = token_windows(test_ids, seq_len)
    info = DataInfo(
        name=name,
        kind="tokens",
        input_shape=(seq_len,),
        input_dtype="int32",
        num_classes=len(vocab),
        train_size=len(train[0]),
        test_size=len(test[0]),
        baselines={
            "unigram_test_perplexity": unigram_perplexity(
                train[1].ravel(), test[1].ravel(), len(vocab)
            )
        },
        vocab=vocab,
    )
    return ArrayDataset(info, train, test)
