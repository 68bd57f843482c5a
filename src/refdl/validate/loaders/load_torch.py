"""refdl's exported start for a PyTorch run (written by ``refdl validate --export-start``).

    from load_torch import load_start, batches, save_params, FINGERPRINT
    model = nn.Sequential(...)             # your model; the same layers as refdl's
    load_start(model)                      # refdl's initial weights, in parameter order
    for x, y in batches():                 # refdl's batches (images NCHW), one per step
        ...
    save_params(model, "final_refdl.npz")  # final weights in refdl's layout (optional)

Log ``"start": FINGERPRINT`` in your configuration and refdl compares your run with
its own step by step. refdl's LSTM has one bias: freeze ``bias_hh_l*`` (it starts at 0).
"""

import json
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
START = json.loads((HERE / "start.json").read_text())
FINGERPRINT = START["fingerprint"]


def load_start(model: torch.nn.Module) -> None:
    """Copy refdl's initial weights into ``model.parameters()``, in order, shapes checked."""
    entries = START["torch_parameters"]
    params = list(model.parameters())
    if len(params) != len(entries):
        raise ValueError(
            f"the model has {len(params)} parameters, refdl's start {len(entries)}: "
            + ", ".join(e["name"] for e in entries)
        )
    with np.load(HERE / "init_torch.npz") as arrays, torch.no_grad():
        for i, (p, entry) in enumerate(zip(params, entries, strict=True)):
            value = arrays[f"p{i:03d}"]
            if tuple(p.shape) != tuple(value.shape):
                raise ValueError(
                    f"parameter {i} ({entry['name']}): model {tuple(p.shape)}, "
                    f"refdl {tuple(value.shape)}"
                )
            p.copy_(torch.from_numpy(value))


def _nchw(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 3, 1, 2) if x.ndim == 4 else x


def batches():
    """``(x, y)`` tensors of every step, in refdl's order (images NCHW, labels int64)."""
    with np.load(HERE / "train.npz") as data:
        x, y = _nchw(data["x"]), data["y"]
    for rows in np.load(HERE / "batches.npy"):
        yield torch.from_numpy(np.ascontiguousarray(x[rows])), torch.from_numpy(y[rows]).long()


def test_set():
    """``(x, y)`` of the test set as refdl evaluates it (images NCHW)."""
    with np.load(HERE / "test.npz") as data:
        return torch.from_numpy(_nchw(data["x"]).copy()), torch.from_numpy(data["y"]).long()


def save_params(model: torch.nn.Module, path: str) -> None:
    """``model``'s weights in refdl's layout (names of ``init_refdl.npz``)."""
    values = [p.detach().cpu().numpy() for p in model.parameters()]
    out, i = {}, 0
    for layer in START["layers"]:
        key, kind = layer["key"], layer["kind"]
        if kind == "dense":
            kernel = values[i].T
            out[f"{key}/kernel"] = kernel
            i += 1
            if layer["bias"]:
                out[f"{key}/bias"] = values[i]
                i += 1
        elif kind == "conv":
            out[f"{key}/kernel"] = values[i].transpose(2, 3, 1, 0)
            i += 1
            if layer["bias"]:
                out[f"{key}/bias"] = values[i]
                i += 1
        elif kind == "embed":
            out[f"{key}/embedding"] = values[i]
            i += 1
        elif kind == "lstm":
            out[f"{key}/w_ih"], out[f"{key}/w_hh"] = values[i].T, values[i + 1].T
            out[f"{key}/bias"] = values[i + 2] + values[i + 3]
            i += 4
    _unflatten_first_dense(out)
    np.savez(path, **out)


def _unflatten_first_dense(out: dict) -> None:
    """Undo the NCHW row order of the Dense after a flatten of an image map."""
    for layer in START["layers"]:
        if layer["kind"] == "flatten" and len(layer["input"]) == 4:
            h, w, c = layer["input"][1:]
            nxt = next(
                s
                for s in START["layers"]
                if s["kind"] == "dense" and START["layers"].index(s) > START["layers"].index(layer)
            )
            k = out[f"{nxt['key']}/kernel"]
            out[f"{nxt['key']}/kernel"] = (
                k.reshape(c, h, w, -1).transpose(1, 2, 0, 3).reshape(h * w * c, -1)
            )
            return
