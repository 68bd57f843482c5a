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
    muon: tuple[str, ...] = ()  # optimizer muon: the refdl paths refdl's Muon updates
    muon_ns: str = "bf16"  # torch.optim.Muon's Newton-Schulz as shipped, or "native"
    muon_options: tuple[tuple[str, Any], ...] = ()  # more torch.optim.Muon keywords (a plant)
    precision: str = "fp32"  # "bf16": every twin under torch.autocast (fp32 weights)


def amp(plan: TrainPlan) -> Any:
    """The twin's precision: ``torch.autocast`` to bf16 on the CPU for a bf16 plan, as
    torchtitan runs DDP and TP without FSDP (fp32 weights, optimizer and reductions of
    gradients; bf16 matrix products), the same in every twin and in the control. Without
    autocast's cache of cast weights: a rank runs all its steps in one context, and the
    cache would keep step 1's bf16 weights until it closes."""
    if plan.precision == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16, cache_enabled=False)
    if plan.precision != "fp32":
        raise UsageError(f"PyTorch's twins run fp32 or bf16, not {plan.precision}")
    return contextlib.nullcontext()


def optimizer_class(name: str, momentum: float, weight_decay: float) -> tuple[type, dict]:
    """The PyTorch optimizer class and keyword arguments (no ``lr``) that compute what
    refdl's optax optimizer of ``name`` does (Muon: ``make_optimizer``)."""
    if name == "sgd":
        return torch.optim.SGD, {"weight_decay": weight_decay}
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD, {"momentum": momentum, "nesterov": name == "nesterov",
                                 "weight_decay": weight_decay}  # fmt: skip
    if name == "adam":
        return torch.optim.Adam, {"eps": 1e-8, "weight_decay": weight_decay}
    raise ValueError(f"no PyTorch twin for optimizer {name!r}")


class MuonAdamW:
    """``torch.optim.Muon`` on the matrices refdl's Muon updates and ``torch.optim.AdamW``
    on the rest, stepped together: how PyTorch's documentation pairs them, and what refdl's
    ``muon`` does in one optax optimizer. Both use their defaults but the weight decay
    (AdamW's loop is the per-tensor one, which takes DTensor and plain tensors alike).
    ``native``: Muon's steps run ``native_newton_schulz`` in place of PyTorch's;
    ``options``: other ``torch.optim.Muon`` settings (a misconfiguration planted)."""

    def __init__(self, matrices: list, rest: list, weight_decay: float, native: bool,
                 **options: Any) -> None:  # fmt: skip
        self.native = native
        self.parts = []
        if matrices:
            self.parts.append(torch.optim.Muon(matrices, lr=0.0, weight_decay=weight_decay,
                                               **options))  # fmt: skip
        if rest:
            self.parts.append(
                torch.optim.AdamW(rest, lr=0.0, weight_decay=weight_decay, foreach=False)
            )

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        import torch.optim._muon as torch_muon

        shipped = torch_muon._zeropower_via_newtonschulz
        if self.native:
            torch_muon._zeropower_via_newtonschulz = native_newton_schulz
        try:
            for part in self.parts:
                part.step()
        finally:
            torch_muon._zeropower_via_newtonschulz = shipped


def make_optimizer(name: str, params: list, momentum: float, weight_decay: float,
                   modules: list | None = None, muon: tuple[str, ...] = (),
                   native: bool = False, muon_options: tuple = (),
                   **extra: Any) -> Any:  # fmt: skip
    """The PyTorch optimizer that computes what refdl's optax optimizer of ``name`` does
    (``extra``: the class's options, such as ``foreach``); for Muon, ``modules`` (their
    ``links()``) tell which of ``params`` are the refdl paths ``muon`` names (``native``:
    its Newton-Schulz without the bf16 cast, ``native_newton_schulz``)."""
    if name == "muon":
        if modules is None or not muon:  # else every parameter would go to AdamW, unsaid
            raise ValueError("Muon's twin needs the modules and refdl's Muon paths")
        ids = {id(t) for m in modules for path, t, _, _ in m.links() if path in muon}
        matrices = [p for p in params if id(p) in ids]
        rest = [p for p in params if id(p) not in ids]
        return MuonAdamW(matrices, rest, weight_decay, native, **dict(muon_options))
    cls, kwargs = optimizer_class(name, momentum, weight_decay)
    return cls(params, lr=0.0, **kwargs, **extra)


def native_newton_schulz(grad: Any, ns_coefficients: tuple, ns_steps: int, eps: float) -> Any:
    """``torch.optim._muon._zeropower_via_newtonschulz`` (PyTorch 2.13) line for line, but
    in the gradient's own dtype where PyTorch casts it to bf16: the one change
    ``--torch-muon-ns native`` makes to PyTorch, so that only the algorithm is compared."""
    a, b, c = ns_coefficients
    ortho_grad = grad.clone()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def plan_optimizer(plan: TrainPlan, modules: list, **extra: Any) -> Any:
    """``make_optimizer`` of ``plan`` for the trainable parameters of ``modules``."""
    params = [p for m in modules for p in _trainable(m)]
    return make_optimizer(plan.optimizer, params, plan.momentum, plan.weight_decay, modules,
                          plan.muon, native=plan.muon_ns == "native",
                          muon_options=plan.muon_options, **extra)  # fmt: skip


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


def aux_loss(model: Any) -> Any:
    """The mixture-of-experts layers' load-balancing losses of the last forward (0 for a
    model without any): refdl adds them to the objective, not to the reported loss."""
    return sum(m.aux for m in model.modules() if getattr(m, "aux", None) is not None)


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
    opt = plan_optimizer(plan, [model])
    criterion = loss_fn(plan.loss)
    losses, times = [], []
    for batch, lr in zip(plan.batches, plan.lrs, strict=True):
        t0 = time.perf_counter()
        if opt is not None:
            _set_lr(opt, lr)
            opt.zero_grad(set_to_none=True)
        with amp(plan):  # forward and backward, as a spawned rank's (``_worker``)
            loss = criterion(model(_tensor(batch["x"])), _tensor(batch["y"]))
            (loss + aux_loss(model)).backward()  # the reported loss stays the cross-entropy
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
        with amp(plan):  # a bf16 plan: the rank's forward and backward under autocast
            fn(rank, world, plan, extra, Path(out_dir))
    finally:
        dist.destroy_process_group()


def _save(path: Path, params: Flat, losses: list[float], times: list[float], first: Flat) -> None:
    np.savez(path, **{f"p:{k}": v for k, v in params.items()},
             **{f"f:{k}": v for k, v in first.items()},
             __losses=np.asarray(losses), __times=np.asarray(times))  # fmt: skip


def global_mean(loss: Any, world: int) -> float:
    """The mean over ``world`` ranks of each rank's loss (a collective)."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def save_rank(out: Path, rank: int, params: Flat, losses: list[float], times: list[float],
              first: Flat) -> None:  # fmt: skip
    """Rank 0 writes the run's result; the others an empty file (``_read`` takes rank 0's)."""
    if rank == 0:
        _save(out / "rank0.npz", params, losses, times, first)
    else:
        _save(out / f"rank{rank}.npz", {}, [], [], {})


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
    opt = plan_optimizer(plan, [model])
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
        losses.append(global_mean(loss, world))
        times.append(time.perf_counter() - t0)
        if len(losses) == 1:
            first = export(model)
    save_rank(out, rank, export(model), losses, times, first)


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


# refdl's schedules and PyTorch's classes that run them; and where stage ``i`` of
# ``n`` sits among ``p`` ranks (looped: chunk c of rank s is stage c p + s; V: rank s
# holds stages s and 2p - 1 - s), as refdl places them (refdl.config.choices).
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
             "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}  # fmt: skip
V_SHAPED = ("zbv", "dualpipev")
SPLIT = ("zb-h1", "zbv", "dualpipev")  # backward split into input (B) and weight (W)


def stages_of(rank: int, world: int, stages: int, schedule: str) -> list[int]:
    """The pipeline stages rank ``rank`` of ``world`` holds, in PyTorch's order."""
    if schedule in V_SHAPED:
        return [rank, 2 * world - 1 - rank]
    return list(range(rank, stages, world))


def _pipe_rank(rank: int, world: int, plan: TrainPlan, extra: Any, out: Path) -> None:
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    cuts, microbatches, schedule, bug = extra
    edges = [0, *cuts, len(plan.model.layers)]
    n = len(edges) - 1
    bn = "native" if plan.native_bn else "local"
    mine = stages_of(rank, world, n, schedule)
    modules = [plan.model.build(plan.params, bn, start=edges[i], stop=edges[i + 1]) for i in mine]
    stages = [PipelineStage(m.train(), i, n, torch.device("cpu"))
              for m, i in zip(modules, mine, strict=True)]  # fmt: skip
    cls = getattr(pipelining, SCHEDULES[schedule])
    # scale_grads: PyTorch sums the microbatches' gradients and then divides by their
    # number, so the step takes the full batch's mean gradient, as refdl's does (the
    # planted bug leaves the sum).
    one = schedule in ("gpipe", "1f1b")
    sched = cls(stages[0] if one else stages, n_microbatches=microbatches,
                loss_fn=loss_fn(plan.loss), scale_grads=bug != "microbatch-scale")  # fmt: skip
    # A stage without parameters (e.g. a lone Flatten) has nothing to update.
    opt = plan_optimizer(plan, modules) if any(_trainable(m) for m in modules) else None
    first_here, last_here = 0 in mine, n - 1 in mine
    losses, times = [], []
    for batch, lr in zip(plan.batches, plan.lrs, strict=True):
        t0 = time.perf_counter()
        if opt is not None:
            _set_lr(opt, lr)
            opt.zero_grad(set_to_none=True)
        x = _tensor(batch["x"])
        if schedule in SPLIT and x.is_floating_point():
            # PyTorch's split backward captures a stage's weight gradients through its
            # input's graph; where a stage's input needs no gradient (after a first stage
            # with no parameters, mlp's Flatten) only stage 0 falls back to a full
            # backward (stage.py's backward_weight_one_chunk, "TODO") and stage 1's
            # gradients come out wrong (2e-3 after one update). An input that requires
            # grad keeps every stage's graph whole.
            x.requires_grad_(True)
        args = (x,) if first_here else ()
        mb_losses: list = []
        kw = {"target": _tensor(batch["y"]), "losses": mb_losses} if last_here else {}
        sched.step(*args, **kw)
        if last_here:
            losses.append(float(torch.stack([v.detach() for v in mb_losses]).mean()))
        if opt is not None:
            opt.step()
        times.append(time.perf_counter() - t0)
        if len(times) == 1:
            first = {k: v for m in modules for k, v in export(m).items()}
    params_out = {k: v for m in modules for k, v in export(m).items()}
    _save(out / f"rank{rank}.npz", params_out, losses, times, first)


def train_pipeline(
    plan: TrainPlan, cuts: list[int], microbatches: int, schedule: str = "1f1b",
    timeout: float = 600, bug: str | None = None, world: int | None = None,
) -> tuple[TorchResult, str]:  # fmt: skip
    """``torch.distributed.pipelining`` with refdl's stages (cut at its layer indices
    ``cuts``) placed on ranks as refdl places them, run by PyTorch's class for
    ``schedule`` on ``world`` ranks (default: two stages a rank for the V schedules, one
    otherwise); returns the result and the class's name."""
    require()
    if schedule not in SCHEDULES:
        raise UsageError(f"PyTorch runs the schedules {', '.join(SCHEDULES)}, not {schedule!r}")
    stages = len(cuts) + 1
    world = world or (stages // 2 if schedule in V_SHAPED else stages)
    extra = (list(cuts), microbatches, schedule, bug)
    return _read(_spawn(_pipe_rank, world, plan, extra, timeout)), SCHEDULES[schedule]
