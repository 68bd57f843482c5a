"""``refdl validate --export-start DIR``: refdl's starting point, for a run in another
framework that should be comparable step by step.

The folder holds everything a user's own script needs to start where refdl
starts and see what refdl sees:

- ``start.json``: the configuration, the **fingerprint** (write it into the log's
  configuration as ``"start"``: a log that carries it is compared exactly), the
  input preprocessing, and the parameter order of each layout;
- ``init_refdl.npz`` (refdl's layout), ``init_torch.npz`` (PyTorch's: Linear
  ``(out, in)``, Conv2d OIHW, the flatten after a convolution reordered for NCHW),
  ``init_keras.npz`` (Keras': refdl's layouts); parameters ``p000``, ``p001``... in
  the order the framework lists a plain sequential model's parameters;
- ``batches.npy``: the training-set row of every example of every step, in
  refdl's data order (``[steps, batch]``); ``train.npz``/``test.npz``: the data set
  as refdl feeds it (after preprocessing; images NHWC);
- ``load_torch.py``, ``load_keras.py``: short loaders (NumPy and the framework
  only): ``load_start(model)``, ``batches()``, ``save_params(model, path)``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from refdl.adapters.layers import describe
from refdl.adapters.torch import flatten
from refdl.config.spec import RunSpec
from refdl.data.order import global_batch_indices
from refdl.errors import UsageError
from refdl.run.build import build

LOADERS = Path(__file__).parent / "loaders"
PREPROCESSING = {
    "digits": "scikit-learn's 8x8 digits, pixels / 16 (0..1), float32 NHWC (N, 8, 8, 1); "
    "split: permutation with seed 0, first 1,437 train, last 360 test",
    "pytext": "CPython help topics, characters as int32 ids, windows of seq_len tokens; the "
    "target is the input shifted by one",
}


def torch_layout(layers: list[dict[str, Any]], flat: dict[str, np.ndarray]) -> list[tuple]:
    """``(name, array)`` in the order ``model.parameters()`` lists a plain PyTorch twin's:
    Linear ``(out, in)``, Conv2d OIHW, Embedding, LSTM ``weight_ih, weight_hh, bias_ih,
    bias_hh`` (refdl's one bias as ``bias_ih``, ``bias_hh`` zero: freeze it). A Dense
    after a flatten of an NHWC map gets its rows reordered for PyTorch's NCHW flatten."""
    out: list[tuple[str, np.ndarray]] = []
    nhwc: tuple[int, ...] | None = None
    for spec in layers:
        key, kind = spec["key"], spec["kind"]
        if kind == "flatten" and len(spec["input"]) == 4:
            nhwc = tuple(spec["input"][1:])
        if kind == "dense":
            kernel = flat[f"{key}/kernel"]
            if nhwc is not None:  # rows (h, w, c) -> (c, h, w)
                h, w, c = nhwc
                kernel = kernel.reshape(h, w, c, -1).transpose(2, 0, 1, 3).reshape(h * w * c, -1)
                nhwc = None
            out.append((f"{key}.weight", kernel.T))
            if f"{key}/bias" in flat:
                out.append((f"{key}.bias", flat[f"{key}/bias"]))
        elif kind == "conv":
            out.append((f"{key}.weight", flat[f"{key}/kernel"].transpose(3, 2, 0, 1)))
            if f"{key}/bias" in flat:
                out.append((f"{key}.bias", flat[f"{key}/bias"]))
        elif kind == "embed":
            out.append((f"{key}.weight", flat[f"{key}/embedding"]))
        elif kind == "lstm":
            bias = flat[f"{key}/bias"]
            out += [(f"{key}.weight_ih", flat[f"{key}/w_ih"].T),
                    (f"{key}.weight_hh", flat[f"{key}/w_hh"].T),
                    (f"{key}.bias_ih", bias), (f"{key}.bias_hh", np.zeros_like(bias))]  # fmt: skip
    return out


def keras_layout(layers: list[dict[str, Any]], flat: dict[str, np.ndarray]) -> list[tuple]:
    """``(name, array)`` in the order a plain Keras twin lists its weights (refdl's layouts)."""
    names = {"dense": ("kernel", "bias"), "conv": ("kernel", "bias"), "embed": ("embedding",),
             "lstm": ("w_ih", "w_hh", "bias")}  # fmt: skip
    return [(f"{s['key']}/{n}", flat[f"{s['key']}/{n}"]) for s in layers
            for n in names.get(s["kind"], ()) if f"{s['key']}/{n}" in flat]  # fmt: skip


def start_spec(config: dict[str, Any]) -> RunSpec:
    """The single-device run an exported start describes (from a log's or the CLI's
    configuration: model, dataset, batch size, steps, seed, optimizer, lr...)."""
    kw = {k: config[k] for k in ("dataset", "optimizer", "lr", "momentum", "weight_decay",
                                 "lr_schedule", "loss") if config.get(k) is not None}  # fmt: skip
    return RunSpec(strategy="single", model=config["model"], steps=int(config["steps"]),
                   batch_size=int(config.get("batch_size", 64)), seed=int(config.get("seed", 0)),
                   progress=False, **kw)  # fmt: skip


def fingerprint(spec: RunSpec, init: dict[str, np.ndarray], batches: np.ndarray) -> str:
    """A short hash of what makes two runs comparable step by step: the configuration,
    the initial weights and the batch order."""
    h = hashlib.sha256()
    keys = ("model", "dataset", "data_opts", "seed", "batch_size", "steps")
    h.update(json.dumps({k: getattr(spec, k) for k in keys}, sort_keys=True).encode())
    for name in sorted(init):
        h.update(name.encode())
        h.update(np.ascontiguousarray(init[name], np.float32).tobytes())
    h.update(np.ascontiguousarray(batches, np.int64).tobytes())
    return h.hexdigest()[:16]


def start_of(spec: RunSpec) -> tuple[Any, dict[str, np.ndarray], np.ndarray, str]:
    """``(run, initial weights, batch indices, fingerprint)`` of ``spec``'s start."""
    run = build(spec)
    init = flatten(jax.device_get(run.task.init_state(spec.seed).params))
    size = run.dataset.info.train_size
    batches = np.stack([global_batch_indices(spec.seed, t, spec.batch_size, size)
                        for t in range(spec.steps)])  # fmt: skip
    return run, init, batches, fingerprint(run.spec, init, batches)  # resolved: defaults filled


def _fingerprint_in(path: Path) -> str | None:
    """The fingerprint of a ``start.json`` already there (None where there is none; a file
    that is not one reads as a start of its own, "unreadable")."""
    if not path.exists():
        return None
    try:
        return str(json.loads(path.read_text())["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable"


def export_start(config: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write the folder described in the module docstring; return ``start.json``'s dict."""
    spec = start_spec(config)
    run, init, batches, fp = start_of(spec)
    layers = describe(run.task.model, run.task.sample_x, covers="mlp, lenet5 and lstm_lm")
    held = _fingerprint_in(out / "start.json")
    if held not in (None, fp):  # a log may name the start there: never replaced by another
        raise UsageError(f"--export-start {out} holds another start (fingerprint {held}; "
                         f"this one's {fp}); give a new folder")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    torch_params, keras_params = torch_layout(layers, init), keras_layout(layers, init)
    np.savez(out / "init_refdl.npz", **init)
    np.savez(out / "init_torch.npz", **{f"p{i:03d}": a for i, (_, a) in enumerate(torch_params)})
    np.savez(out / "init_keras.npz", **{f"p{i:03d}": a for i, (_, a) in enumerate(keras_params)})
    np.save(out / "batches.npy", batches)
    idx = np.arange(run.dataset.info.train_size)
    np.savez(out / "train.npz", **run.dataset.train_batch(idx))
    test = list(run.dataset.test_batches())
    np.savez(out / "test.npz", x=np.concatenate([b["x"] for b in test]),
             y=np.concatenate([b["y"] for b in test]))  # fmt: skip
    start = {
        "fingerprint": fp,
        "how": 'write this fingerprint into your log\'s configuration as "start"; refdl '
        "then compares your run with its own step by step",
        "config": {
            "model": spec.model,
            "dataset": run.dataset.info.name,  # the model's default when none was named
            "data_opts": dict(spec.data_opts),
            "batch_size": spec.batch_size,
            "steps": spec.steps,
            "seed": spec.seed,
            "optimizer": run.spec.optimizer,
            "lr": run.spec.lr,
            "momentum": run.spec.momentum,
            "weight_decay": run.spec.weight_decay,
            "lr_schedule": run.spec.lr_schedule,
            "loss": run.spec.loss,
            "loss_reduction": "mean",
            "dtype": "float32",
            "init": "refdl",
            "data_order": "refdl",
        },
        "preprocessing": PREPROCESSING.get(
            run.dataset.info.name, f"refdl's {run.dataset.info.name} reader, as train.npz holds it"
        ),
        "layers": layers,
        "torch_parameters": [{"name": n, "shape": list(a.shape)} for n, a in torch_params],
        "keras_weights": [{"name": n, "shape": list(a.shape)} for n, a in keras_params],
        "refdl_parameters": [{"name": n, "shape": list(a.shape)} for n, a in init.items()],
    }
    (out / "start.json").write_text(json.dumps(start, indent=1))
    for name in ("load_torch.py", "load_keras.py"):
        shutil.copyfile(LOADERS / name, out / name)
    return start
