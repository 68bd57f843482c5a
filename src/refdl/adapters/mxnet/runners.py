"""MXNet's own training of a Gluon twin: ``autograd`` and a ``gluon.Trainer``.

- ``single``: one CPU context, no KVStore;
- ``data`` on ``devices`` > 1: that many CPU contexts in this process and KVStore
  ``local``, which sums the contexts' gradients before one update; each context's
  loss is its share of the global mean;
- ``ps``: KVStore ``dist_sync`` (``--ps-mode sync``: the server sums the W workers'
  gradients, then updates once - refdl's ``ps --ps-mode sync`` and ``data``) or
  ``dist_async`` (every push updates at once, refdl's ``ps --ps-mode async``), with
  a scheduler, one server and W workers as processes on loopback (``DMLC_*``). The
  optimizer runs on the server (``update_on_kvstore``). Worker w computes, at each
  step, the gradient of its share of the global batch's mean: 1/W of its share's
  mean, as refdl's async server scales it.

MXNet's SGD keeps ``mom = m mom - lr g`` (the learning rate folded into the
velocity), which equals optax's rule while the rate is constant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from refdl.adapters.children import free_ports, wait_all
from refdl.adapters.exchange import Flat, read_job, write_result
from refdl.adapters.mxnet.models import build, export


def optimizer(job: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """MXNet's optimizer computing refdl's (weight decay as MXNet's L2 ``wd``, as refdl)."""
    name = job["optimizer"]
    lr = job["lrs"][0]
    if name == "sgd":
        return "sgd", {"learning_rate": lr, "wd": job["weight_decay"]}
    if name == "momentum":
        return "sgd", {"learning_rate": lr, "momentum": job["momentum"], "wd": job["weight_decay"]}
    raise ValueError(f"no MXNet twin for optimizer {name!r} (sgd and momentum are covered)")


def loss_sum(name: str, out: Any, y: Any) -> Any:
    """The sum over terms of refdl's loss ``name`` (divided by the global count outside)."""
    if name == "cross_entropy":
        logp = mx.nd.log_softmax(out, axis=-1)
        return -mx.nd.pick(logp, y, axis=-1).sum()
    if name == "squared":
        target = mx.nd.one_hot(y, out.shape[-1])
        return 0.5 * ((out - target) ** 2).sum()
    raise ValueError(f"no MXNet twin for loss {name!r}")


def _terms(batch: dict[str, np.ndarray]) -> int:
    return int(np.prod(batch["y"].shape))


def train_local(job: dict[str, Any], params: Flat, batches: list[dict], contexts: list,
                kvstore: Any) -> tuple[dict, Flat, Flat]:  # fmt: skip
    """Training on ``contexts`` of this process (``kvstore`` None: plain single-device)."""
    net = build(job["layers"], params, contexts)
    name, opts = optimizer(job)
    trainer = gluon.Trainer(net.collect_params(), name, opts, kvstore=kvstore)
    n = len(contexts)
    losses, times, first = [], [], {}
    for t, (batch, lr) in enumerate(zip(batches, job["lrs"], strict=True)):
        terms = float(_terms(batch))
        xs = [mx.nd.array(x, ctx=c, dtype=x.dtype) for x, c in
              zip(np.split(batch["x"], n), contexts, strict=True)]  # fmt: skip
        ys = [mx.nd.array(y, ctx=c, dtype="int32") for y, c in
              zip(np.split(batch["y"], n), contexts, strict=True)]  # fmt: skip
        t0 = time.perf_counter()
        trainer.set_learning_rate(lr)
        with autograd.record():
            parts = [loss_sum(job["loss"], net(x), y) / terms for x, y in zip(xs, ys, strict=True)]
        autograd.backward(parts)
        trainer.step(1)
        losses.append(float(sum(p.asscalar() for p in parts)))
        times.append(time.perf_counter() - t0)
        if t == 0:
            first = export(net)
    kind = f"KVStore {kvstore} over {n} CPU contexts" if kvstore else "one CPU context"
    return (
        {"losses": losses, "step_times": times, "impl": f"gluon.Trainer, {kind}"},
        export(net),
        first,
    )


# -- dist_sync / dist_async: processes on loopback ---------------------------------------------


def train_dist(folder: Path, job: dict[str, Any]) -> None:
    """Start a scheduler, one server and ``job['workers']`` workers; wait; gather results."""
    w = job["workers"]
    (port,) = free_ports(1)
    env = {**os.environ, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": str(w)}  # fmt: skip
    roles = [("scheduler", 0), ("server", 0)] + [("worker", i) for i in range(w)]
    procs, logs = [], []
    for role, i in roles:
        log = folder / f"{role}-{i}.log"
        cmd = [sys.executable, "-m", "refdl.adapters.mxnet", str(folder), role, str(i)]
        procs.append(subprocess.Popen(cmd, env={**env, "DMLC_ROLE": role}, stdout=log.open("w"),
                                      stderr=subprocess.STDOUT))  # fmt: skip
        logs.append(log)
    wait_all(procs, logs, job["timeout"], "MXNet")
    parts = [json.loads((folder / f"worker-{i}.json").read_text()) for i in range(w)]
    with np.load(folder / "worker-0.npz") as f:
        final = {k: f[k] for k in f.files}
    first = {}
    if job["ps_mode"] == "sync":  # worker 0's weights after the first (common) update
        with np.load(folder / "worker-0-first.npz") as f:
            first = {k: f[k] for k in f.files}
    result = {
        "impl": f"gluon.Trainer, KVStore {parts[0]['kvstore']} (1 server, {w} workers)",
        "wall_s": max(p["end"] for p in parts) - min(p["start"] for p in parts),
        "updates": [u for p in parts for u in p["updates"]],
        "update_losses": [v for p in parts for v in p["losses"]],
    }
    if job["ps_mode"] == "sync":  # the global batch's loss: the workers' shares added
        result["losses"] = [float(sum(v)) for v in zip(*(p["losses"] for p in parts), strict=True)]
        result["step_times"] = [max(v) for v in zip(*(p["step_times"] for p in parts),
                                                    strict=True)]  # fmt: skip
    write_result(folder, result, final, first)


def worker_process(folder: Path, index: int) -> None:
    """One worker of ``train_dist`` (``DMLC_ROLE=worker``)."""
    job, params, batches = read_job(folder)
    kv = mx.kv.create("dist_sync" if job["ps_mode"] == "sync" else "dist_async")
    rank, w = kv.rank, kv.num_workers
    net = build(job["layers"], params, [mx.cpu()])
    name, opts = optimizer(job)
    trainer = gluon.Trainer(net.collect_params(), name, opts, kvstore=kv, update_on_kvstore=True)
    losses, times, updates = [], [], []
    start = time.time()
    for batch in batches:
        terms = float(_terms(batch))
        x = mx.nd.array(np.split(batch["x"], w)[rank], dtype=batch["x"].dtype)
        y = mx.nd.array(np.split(batch["y"], w)[rank], dtype="int32")
        t0 = time.perf_counter()
        read = time.time()
        with autograd.record():
            loss = loss_sum(job["loss"], net(x), y) / terms
        loss.backward()
        trainer.step(1)  # push the gradient, the server updates, pull the weights
        mx.nd.waitall()
        updates.append([read, time.time()])
        losses.append(float(loss.asscalar()))
        times.append(time.perf_counter() - t0)
        if rank == 0 and len(losses) == 1:
            np.savez(folder / "worker-0-first.npz", **export(net))
    end = time.time()
    kv._barrier()  # every worker done: the server holds the final weights
    if rank == 0:
        for i, param in enumerate(trainer._params):
            kv.pull(i, out=param.list_data(), priority=-i)
        mx.nd.waitall()
        np.savez(folder / "worker-0.npz", **export(net))
    (folder / f"worker-{rank}.json").write_text(json.dumps({
        "losses": losses, "step_times": times, "updates": updates, "start": start, "end": end,
        "kvstore": kv.type,
    }))  # fmt: skip
    kv._barrier()
