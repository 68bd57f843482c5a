"""D-PSGD in plain ``torch.distributed``: Deep500's ConsistentNeighbors semantics, one
gloo process a worker, neighbour averaging with ``isend``/``irecv``.

Worker ``i`` keeps a replica, takes a local optimizer step on its contiguous share of
the global batch, then mixes: ``x_i <- W_ii x_i + sum_j W_ij x_j`` over its neighbours
in ``--topology`` with Metropolis weights (``refdl.comm.topology``, the same ``W`` as
refdl's ``decentralized``, adapt-then-combine), the terms added in the order of refdl's
cyclic shifts. The compared model is the replicas' average, as refdl evaluates it. The
planted bug ``mixing`` leaves the replica's own term out of the mix (``W`` no longer
stochastic).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from refdl.adapters.torch.models import export
from refdl.adapters.torch.runners import (
    TorchResult,
    TrainPlan,
    _read,
    _set_lr,
    _spawn,
    _tensor,
    _trainable,
    global_mean,
    loss_fn,
    plan_optimizer,
    save_rank,
)
from refdl.comm import topology
from refdl.data.order import worker_share


def _rank(rank: int, world: int, plan: TrainPlan, extra: Any, out: Path) -> None:
    import torch
    import torch.distributed as dist

    name, bug = extra
    adj = topology.adjacency(name, world)
    w = topology.metropolis(adj)
    shifts = topology.shifts(adj)
    model = plan.model.build(plan.params, bn="local")
    model.train()
    params = _trainable(model)
    opt = plan_optimizer(plan, [model])
    criterion = loss_fn(plan.loss)

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params])

    def assign(vec: torch.Tensor) -> None:
        with torch.no_grad():
            off = 0
            for p in params:
                p.copy_(vec[off : off + p.numel()].view_as(p))
                off += p.numel()

    def mix() -> None:
        mine = flat()
        out_vec = torch.zeros_like(mine) if bug == "mixing" else float(w[rank, rank]) * mine
        for s in shifts:  # one exchange per cyclic shift, in refdl's order
            dst, src = (rank + s) % world, (rank - s) % world
            reqs = []
            if adj[dst, rank]:
                reqs.append(dist.isend(mine, dst))
            got = torch.empty_like(mine)
            if adj[rank, src]:
                reqs.append(dist.irecv(got, src))
            for r in reqs:
                r.wait()
            if adj[rank, src]:
                out_vec = out_vec + float(w[rank, src]) * got
        assign(out_vec)

    def average() -> dict:
        vec = flat().clone()
        dist.all_reduce(vec)
        keep = flat().clone()
        assign(vec / world)
        result = export(model)
        assign(keep)
        return result

    losses, times, first = [], [], {}
    for batch, lr in zip(plan.batches, plan.lrs, strict=True):
        share = worker_share(batch, rank, world)
        t0 = time.perf_counter()
        _set_lr(opt, lr)
        opt.zero_grad(set_to_none=True)
        loss = criterion(model(_tensor(share["x"])), _tensor(share["y"]))
        loss.backward()
        opt.step()
        mix()
        losses.append(global_mean(loss, world))
        times.append(time.perf_counter() - t0)
        if len(losses) == 1:
            first = average()
    save_rank(out, rank, average(), losses, times, first)


def train_gossip(
    plan: TrainPlan, workers: int, name: str, bug: str | None = None, timeout: float = 600
) -> TorchResult:
    """D-PSGD on ``workers`` gloo processes over the ``name`` topology."""
    return _read(_spawn(_rank, workers, plan, (name, bug), timeout))


def describe(workers: int, name: str) -> str:
    """What ran, in words (``framework_impl``)."""
    return f"D-PSGD with isend/irecv over a {name} of {workers} gloo processes"
