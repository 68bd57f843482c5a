"""PyTorch's own training of a twin model: single process, ``DistributedDataParallel``
over gloo (one spawned process per worker), and ``torch.distributed.pipelining``
(``ScheduleGPipe``/``Schedule1F1B``, one process per stage). Each takes the same
batches and learning rates as refdl and returns per-step losses and the final
parameters in refdl's layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from refdl.adapters.children import free_ports
from refdl.adapters.torch.models import NATIVE_DDP_REFUSED, Flat, ModelPlan, export, require
from refdl.errors import UsageError

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - exercised where torch is absent
    torch = None  # type: ignore[assignment]


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """Everything a PyTorch run needs, as plain data (picklable for spawned workers)."""

    model: ModelPlan
    params: Flat
    batches: tuple[dict[str, np.ndarray], ...]  # one global batch per step, refdl's order
    lrs: tuple[float, ...]  # refdl's learning rate of each step
    optimizer: str = "momentum"
    momentum: float = 0.9
    weight_decay: float = 0.0
    loss: str = "cross_entropy"
    threads: int = 0  # torch intra-op threads per process (0: PyTorch's default)
    native_bn: bool = False  # torch.nn.BatchNorm2d instead of the adapter's BatchNorm2d


def make_optimizer(name: str, params: list, momentum: float, weight_decay: float):
    """The PyTorch optimizer that computes what refdl's optax optimizer of ``name`` does."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.0, weight_decay=weight_decay)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD(
            params, lr=0.0, momentum=momentum, nesterov=name == "nesterov",
            weight_decay=weight_decay,
        )  # fmt: skip
    if name == "adam":
        return torch.optim.Adam(params, lr=0.0, eps=1e-8, weight_decay=weight_decay)
    raise ValueError(f"no PyTorch twin for optimizer {name!r}")


def loss_fn(name: str) -> Callable:
    """refdl's loss in PyTorch (mean over examples and time steps)."""
    if name == "cross_entropy":
        return lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1).long())
    if name == "squared":

        def squared(out, y):
            target = F.one_hot(y.long(), out.shape[-1]).to(out.dtype)
            return (0.5 * ((out - target) ** 2).sum(-1)).mean()

        return squared
    raise ValueError(f"no PyTorch twin for loss {name!r}")


def _tensor(a: np.ndarray):
    return torch.from_numpy(np.array(a, copy=True))


@dataclasses.dataclass
class TorchResult:
    """Per-step losses (global batch), final parameters, and the step times."""

    losses: list[float]
    params: Flat
    step_times: list[float]
    first_params: Flat = dataclasses.field(default_factory=dict)  # after the first update


def train_single(plan: TrainPlan) -> TorchResult:
    """Plain PyTorch training in this process: forward, backward, ``optimizer.step``."""
    require()
    if plan.threads:
        torch.set_num_threads(plan.threads)
    model = plan.model.build(plan.params, bn="native" if plan.native_bn else "local")
    model.train()
    opt = make_optimizer(plan.optimizer, _trainable(model), plan.momentum, plan.weight_decay)
    criterion = loss_fn(plan.loss)
    losses, times = [], []
    for batch, lr in zip(plan.batches, plan.lrs, strict=True):
        t0 = time.perf_counter()
        if opt is not None:
            _set_lr(opt, lr)
            opt.zero_grad(set_to_none=True)
        loss = criterion(model(_tensor(batch["x"])), _tensor(batch["y"]))
        loss.backward()
        if opt is not None:
            opt.step()
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t0)
        if len(losses) == 1:
            first = export(model)
    return TorchResult(losses, export(model), times, first)


def train_single_apart(plan: TrainPlan, timeout: float = 600) -> TorchResult:
    """``train_single`` in a spawned process of its own, so that PyTorch's thread pools
    never share a process with what it is compared against (benchmarks)."""
    require()
    return _read(_spawn(_single_rank, 1, plan, None, timeout))


def _single_rank(rank: int, world: int, plan: TrainPlan, extra: Any, out: Path) -> None:
    r = train_single(plan)
    _save(out / f"rank{rank}.npz", r.params, r.losses, r.step_times, r.first_params)


def _trainable(model: Any) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _set_lr(opt: Any, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def _spawn(fn: Callable, world: int, plan: TrainPlan, extra: Any, timeout: float) -> list[Path]:
    """Run ``fn(rank, world, port, plan, extra, out_dir)`` in ``world`` spawned processes
    (gloo over TCP on localhost); returns the per-rank result files. A worker that
    fails or hangs past ``timeout`` seconds stops them all with its error."""
    import torch.multiprocessing as mp

    port = free_ports(1)[0]
    tmp = Path(tempfile.mkdtemp(prefix="refdl-torch-"))
    ctx = mp.start_processes(
        _worker, args=(fn, world, port, plan, extra, str(tmp)), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"PyTorch workers did not finish within {timeout:.0f} s")
    return [tmp / f"rank{r}.npz" for r in range(world)]


def _worker(rank: int, fn, world, port, plan, extra, out_dir) -> None:
    import torch.distributed as dist

    torch.set_num_threads(plan.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        fn(rank, world, plan, extra, Path(out_dir))
    finally:
        dist.destroy_process_group()


def _save(path: Path, params: Flat, losses: list[float], times: list[float], first: Flat) -> None:
    np.savez(path, **{f"p:{k}": v for k, v in params.items()},
             **{f"f:{k}": v for k, v in first.items()},
             __losses=np.asarray(losses), __times=np.asarray(times))  # fmt: skip


def _read(paths: list[Path]) -> TorchResult:
    params: Flat = {}
    first: Flat = {}
    losses: list[float] = []
    times: list[float] = []
    for p in paths:
        with np.load(p) as z:
            params.update({k[2:]: z[k] for k in z.files if k.startswith("p:")})
            first.update({k[2:]: z[k] for k in z.files if k.startswith("f:")})
            if len(z["__losses"]):
                losses = [float(v) for v in z["__losses"]]
            if len(z["__times"]) and not times:
                times = [float(v) for v in z["__times"]]
        p.unlink()
    with contextlib.suppress(OSError):
        paths[0].parent.rmdir()
    return TorchResult(losses, params, times, first)


def _ddp_rank(rank: int, world: int, plan: TrainPlan, extra: Any, out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = plan.model.build(plan.params, bn="sync")
    model.train()
    # Two warnings that say nothing to a refdl user (PyTorch 2.13): rank-local buffers are
    # what broadcast_buffers=False keeps until `init_sync_buffers` exists; and a
    # 1-channel convolution's gradient strides differ from its bucket's only along its
    # size-1 dimension.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
        ddp = DDP(model, broadcast_buffers=False)
    opt = make_optimizer(plan.optimizer, _trainable(model), plan.momentum, plan.weight_decay)
    criterion = loss_fn(plan.loss)
    losses, times = [], []
    for batch, lr in zip(plan.batches, plan.lrs, strict=True):
        n = batch["x"].shape[0] // world
        x = _tensor(batch["x"][rank * n : (rank + 1) * n])
        y = _tensor(batch["y"][rank * n : (rank + 1) * n])
        t0 = time.perf_counter()
        if opt is not None:
            _set_lr(opt, lr)
            opt.zero_grad(set_to_none=True)
        loss = criterion(ddp(x), y)
        loss.backward()  # DDP averages the gradients over the ranks here
        if opt is not None:
            opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        times.append(time.perf_counter() - t0)
        losses.append(float(mean) / world)
        if len(losses) == 1:
            first = export(model)
    if rank == 0:
        _save(out / "rank0.npz", export(model), losses, times, first)
    else:
        _save(out / f"rank{rank}.npz", {}, [], [], {})


def train_ddp(plan: TrainPlan, world: int, timeout: float = 600) -> TorchResult:
    """``DistributedDataParallel`` on ``world`` CPU processes (gloo): rank ``r`` takes
    the ``r``-th contiguous shard of each global batch, as refdl's ``data`` does;
    BatchNorm statistics are global (``SyncBatchNorm2d``), as in refdl."""
    require()
    if plan.native_bn:
        raise UsageError(NATIVE_DDP_REFUSED)
    if plan.batches and plan.batches[0]["x"].shape[0] % world:
        raise UsageError(
            f"batch {plan.batches[0]['x'].shape[0]} does not split over {world} DDP ranks"
        )
    return _read(_spawn(_ddp_rank, world, plan, None, timeout))


def _pipe_rank(rank: int, world: int, plan: TrainPlan, extra: Any, out: Path) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    cuts, microbatches, schedule = extra
    edges = [0, *cuts, len(plan.model.layers)]
    bn = "native" if plan.native_bn else "local"
    module = plan.model.build(plan.params, bn, start=edges[rank], stop=edges[rank + 1])
    module.train()
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    # scale_grads: PyTorch sums the microbatches' gradients and then divides by their
    # number, so the step takes the full batch's mean gradient, as refdl's does.
    sched = cls(stage, n_microbatches=microbatches, loss_fn=loss_fn(plan.loss), scale_grads=True)
    # A stage without parameters (e.g. a lone Flatten) has nothing to update.
    params = _trainable(module)
    opt = None
    if params:
        opt = make_optimizer(plan.optimizer, params, plan.momentum, plan.weight_decay)
    losses, times = [], []
    for batch, lr in zip(plan.batches, plan.lrs, strict=True):
        t0 = time.perf_counter()
        if opt is not None:
            _set_lr(opt, lr)
            opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(_tensor(batch["x"]))
        elif rank == world - 1:
            mb_losses: list = []
            sched.step(target=_tensor(batch["y"]), losses=mb_losses)
            losses.append(float(torch.stack([v.detach() for v in mb_losses]).mean()))
        else:
            sched.step()
        if opt is not None:
            opt.step()
        times.append(time.perf_counter() - t0)
        if len(times) == 1:
            first = export(module)
    _save(out / f"rank{rank}.npz", export(module), losses, times, first)


def train_pipeline(
    plan: TrainPlan, cuts: list[int], microbatches: int, schedule: str = "1f1b",
    timeout: float = 600,
) -> TorchResult:  # fmt: skip
    """``torch.distributed.pipelining`` with one stage per process, cut at refdl's layer
    indices ``cuts``; ``schedule`` is ``gpipe`` or ``1f1b``."""
    require()
    if schedule not in ("gpipe", "1f1b"):
        raise UsageError(f"PyTorch pipelining twin exists for gpipe and 1f1b, not {schedule!r}")
    world = len(cuts) + 1
    return _read(_spawn(_pipe_rank, world, plan, (list(cuts), microbatches, schedule), timeout))


# The refdl strategies PyTorch runs its own way; any other synchronous strategy is compared
# with plain PyTorch, since its parameters after N steps equal ``single``'s.
TWINS = ("single", "data", "pipeline")


def train_twin(
    strategy: str, plan: TrainPlan, *, devices: int = 1, cuts: tuple[int, ...] = (),
    microbatches: int = 1, schedule: str = "1f1b", timeout: float = 600, apart: bool = False,
) -> tuple[TorchResult, str]:  # fmt: skip
    """PyTorch's twin of ``strategy`` on ``plan`` (plain PyTorch for a strategy without
    one; ``apart``: plain PyTorch in a process of its own) and what ran, in words."""
    twin = strategy if strategy in TWINS else "single"
    if twin == "data":
        return train_ddp(plan, devices, timeout), f"DDP over gloo, {devices} processes"
    if twin == "pipeline":
        result = train_pipeline(plan, list(cuts), microbatches, schedule, timeout)
        return result, f"torch.distributed.pipelining {schedule}"
    return (train_single_apart(plan, timeout) if apart else train_single(plan)), "plain PyTorch"
