"""The embedded real data sets, shipped inside installed packages (no download).

- ``digits``: scikit-learn's 8x8 handwritten digits (UCI ML optical
  recognition; 1,797 images, 10 classes), pixels scaled to [0, 1]. Fixed
  split: a permutation with seed 0, the first 1,437 for training and the last
  360 (20 %) for testing; ``--data-opt split=K`` draws the permutation with seed
  K instead (a script's own random 80/20 split, as ``refdl validate --results``
  compares with: refdl's fixed split is an easy one, docs/validation.md).
- ``pytext``: CPython's own ``pydoc_data.topics`` (the help texts, ~0.5 MB of
  English), topics concatenated in sorted order; the first 90 % of the
  characters train, the last 10 % test. Character level by default;
  ``--data-opt level=word`` gives words (lower-cased, top 5,000 + ``<unk>``).
"""

from __future__ import annotations

import collections
import gzip
import importlib.util
import re
from pathlib import Path
from pydoc_data import topics

import numpy as np

from refdl.config.values import Choice, Int, Option
from refdl.data.base import ArrayDataset, DataInfo, DatasetDef, register, text_dataset
from refdl.errors import DataError

DIGITS_TEST = 360


def _digits_file() -> Path:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data set 'digits' needs scikit-learn: run scripts/setup.sh")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DataError(f"{path}: missing from the scikit-learn install; reinstall scikit-learn")
    return path


def load_digits(size: int = 8, split: int = 0, train_on_test: int = 0) -> ArrayDataset:
    """The 1,797 8x8 digits with the 1,437 / 360 split drawn with seed ``split`` (0: the
    fixed split); ``size`` > 8 enlarges each pixel to ``size // 8`` squared and centres
    the digit on a zero border (``size=28``: MNIST's 28x28 frame, the digit in its
    central 24x24, as LeNet-5's studies fed it). ``train_on_test=1`` trains on all 1,797
    (the test rows included, as a script that never held them out)."""
    path = _digits_file()
    with gzip.open(path, "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = (raw[:, :64] / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    if size > 8:
        k = size // 8
        x = np.repeat(np.repeat(x, k, axis=1), k, axis=2)
        lo = (size - 8 * k) // 2
        x = np.pad(x, ((0, 0), (lo, size - 8 * k - lo), (lo, size - 8 * k - lo), (0, 0)))
    y = raw[:, 64].astype(np.int32)
    perm = np.random.default_rng(split).permutation(len(x))
    tr, te = perm[:-DIGITS_TEST], perm[-DIGITS_TEST:]
    if train_on_test:
        tr = perm
    info = DataInfo("digits", "image", (size, size, 1), "float32", 10, len(tr), len(te))
    return ArrayDataset(info, (x[tr], y[tr]), (x[te], y[te]))


def pydoc_text() -> str:
    """The text of CPython's help topics, topics in sorted order."""
    return "\n".join(topics.topics[k] for k in sorted(topics.topics))


def load_pytext(seq_len: int = 20, level: str = "char", vocab_size: int = 5000) -> ArrayDataset:
    """The help-topics corpus as windows of ``seq_len`` tokens (character or word level)."""
    text = pydoc_text()
    if level == "char":
        vocab = tuple(sorted(set(text)))
        index = {c: i for i, c in enumerate(vocab)}
        ids = np.fromiter((index[c] for c in text), np.int32, len(text))
    elif level == "word":
        words = re.findall(r"[a-z0-9]+|[^\sa-z0-9]", text.lower())
        cut = int(0.9 * len(words))
        common = [w for w, _ in collections.Counter(words[:cut]).most_common(vocab_size - 1)]
        vocab = ("<unk>", *sorted(common))
        index = {w: i for i, w in enumerate(vocab)}
        ids = np.asarray([index.get(w, 0) for w in words], np.int32)
    else:
        raise DataError(f"pytext: --data-opt level must be 'char' or 'word' (got {level!r})")
    cut = int(0.9 * len(ids))
    return text_dataset("pytext", ids[:cut], ids[cut:], vocab, seq_len)


register(
    DatasetDef(
        "digits",
        load_digits,
        "image",
        {
            "size": Option(8, Int(8, 256), "image side; > 8 enlarges and centres (28: MNIST's)"),
            "split": Option(0, Int(0, 2**31 - 1), "seed of the 80/20 split (0: the fixed one)"),
            "train_on_test": Option(0, Int(0, 1), "1: train on all, the test rows included"),
        },
        doc="8x8 handwritten digits",
    )
)
register(
    DatasetDef(
        "pytext",
        load_pytext,
        "tokens",
        {
            "seq_len": Option(20, Int(1, 1 << 16), "tokens per window"),
            "level": Option("char", Choice(("char", "word")), "character or word tokens"),
            "vocab_size": Option(5000, Int(2, 1 << 20), "word level: vocabulary size"),
        },
        doc="CPython help topics text",
    )
)
