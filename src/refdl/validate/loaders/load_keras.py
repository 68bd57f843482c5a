"""refdl's exported start for a Keras / TensorFlow run (written by ``refdl validate
--export-start``).

    from load_keras import load_start, batches, FINGERPRINT
    model = keras.Sequential([...])        # your model; the same layers as refdl's
    load_start(model)                      # refdl's initial weights, in weight order
    for x, y in batches():                 # refdl's batches (images NHWC), one per step
        ...

Log ``"start": FINGERPRINT`` in your configuration and refdl compares your run with
its own step by step.
"""

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
START = json.loads((HERE / "start.json").read_text())
FINGERPRINT = START["fingerprint"]


def load_start(model) -> None:
    """Assign refdl's initial weights to ``model.weights``, in order, shapes checked."""
    entries = START["keras_weights"]
    weights = list(model.weights)
    if len(weights) != len(entries):
        raise ValueError(
            f"the model has {len(weights)} weights, refdl's start {len(entries)}: "
            + ", ".join(e["name"] for e in entries)
        )
    with np.load(HERE / "init_keras.npz") as arrays:
        for i, (w, entry) in enumerate(zip(weights, entries, strict=True)):
            value = arrays[f"p{i:03d}"]
            if tuple(w.shape) != tuple(value.shape):
                raise ValueError(
                    f"weight {i} ({entry['name']}): model {tuple(w.shape)}, "
                    f"refdl {tuple(value.shape)}"
                )
            w.assign(value)


def batches():
    """``(x, y)`` NumPy arrays of every step, in refdl's order (images NHWC)."""
    with np.load(HERE / "train.npz") as data:
        x, y = data["x"], data["y"]
    for rows in np.load(HERE / "batches.npy"):
        yield x[rows], y[rows]


def test_set():
    with np.load(HERE / "test.npz") as data:
        return data["x"], data["y"]
