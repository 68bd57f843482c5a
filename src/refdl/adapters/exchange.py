"""The files between refdl and a framework's own process: a job folder in, a result out.

A framework that cannot share refdl's environment (MXNet needs numpy < 1.24),
or whose runtime should not live beside JAX (TensorFlow), runs as a separate
process that reads ``job.json`` (what to build and how to train: the layers as
``refdl.adapters.layers`` describes them, optimizer, learning rates, strategy,
workers) and ``job.npz`` (refdl's initial parameters ``param/<path>`` and the
global batch of every step ``x/<t>``, ``y/<t>``), and writes ``result.json``
(per-step losses, step times, per-update timestamps) and ``result.npz`` (final
parameters ``param/<path>``, and after the first update ``first/<path>``) in
refdl's layout. Nothing in these files is executed: arrays are read with
``allow_pickle=False``. NumPy and JSON only, so this module runs under MXNet's
numpy 1.23 as under refdl's numpy 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

JOB, JOB_ARRAYS, RESULT, RESULT_ARRAYS = "job.json", "job.npz", "result.json", "result.npz"
Flat = dict[str, np.ndarray]


def write_job(folder: Path, job: dict[str, Any], params: Flat, batches: list[dict]) -> None:
    """The job for a framework's process: ``job`` (JSON-ready), parameters, batches."""
    arrays = {f"param/{k}": np.asarray(v, np.float32) for k, v in params.items()}
    for t, batch in enumerate(batches):
        arrays[f"x/{t}"], arrays[f"y/{t}"] = np.asarray(batch["x"]), np.asarray(batch["y"])
    np.savez(folder / JOB_ARRAYS, **arrays)
    (folder / JOB).write_text(json.dumps({**job, "steps": len(batches)}))


def read_job(folder: Path) -> tuple[dict[str, Any], Flat, list[dict[str, np.ndarray]]]:
    """``(job, parameters, batches)`` as ``write_job`` wrote them."""
    job = json.loads((folder / JOB).read_text())
    with np.load(folder / JOB_ARRAYS, allow_pickle=False) as f:
        params = {k[len("param/") :]: f[k] for k in f.files if k.startswith("param/")}
        batches = [{"x": f[f"x/{t}"], "y": f[f"y/{t}"]} for t in range(job["steps"])]
    return job, params, batches


def write_result(folder: Path, result: dict[str, Any], params: Flat, first: Flat) -> None:
    """What the framework's run produced (``result``: JSON-ready), final parameters and
    the parameters after the first update, in refdl's layout."""
    arrays = {f"param/{k}": v for k, v in params.items()}
    arrays.update({f"first/{k}": v for k, v in first.items()})
    np.savez(folder / RESULT_ARRAYS, **arrays)
    (folder / RESULT).write_text(json.dumps(result))


def read_result(folder: Path) -> tuple[dict[str, Any], Flat, Flat]:
    """``(result, parameters, first-update parameters)`` as ``write_result`` wrote them."""
    result = json.loads((folder / RESULT).read_text())
    with np.load(folder / RESULT_ARRAYS, allow_pickle=False) as f:
        params = {k[len("param/") :]: f[k] for k in f.files if k.startswith("param/")}
        first = {k[len("first/") :]: f[k] for k in f.files if k.startswith("first/")}
    return result, params, first


def same_pads(size: int, k: int, s: int) -> tuple[int, int]:
    """XLA's SAME padding of one spatial axis: ``(low, high)``, the odd pixel high."""
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def staleness(updates: list[tuple[float, float]]) -> list[int]:
    """Per update ``(read, applied)`` timestamps (one clock): how many other updates were
    applied after this one read the parameters and before it was applied (async SGD's
    staleness, counted from times the framework's own processes recorded)."""
    applied = sorted(a for _, a in updates)
    return [
        int(np.searchsorted(applied, a, "left") - np.searchsorted(applied, r, "right"))
        for r, a in updates
    ]
