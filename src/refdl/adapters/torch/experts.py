"""A mixture of experts split over ranks in PyTorch, which has no expert-parallel module:
refdl's routing, capacity and drop rule (``refdl.adapters.torch.models.MoEFeedForward``)
with each rank's buffers sent to the experts' owners and back by ``all_to_all_single``
over an expert process group, as refdl's ``--mesh data=D,expert=E`` does.

Ranks are laid out data-major (rank ``r`` at data ``r // E``, expert ``r % E``) and rank
``r`` takes the ``r``-th contiguous shard of each global batch; owner ``g`` of an expert
group runs experts ``g E_n/E .. (g+1) E_n/E - 1`` on the buffers of its group. Every rank
keeps the whole weights (only the owners' slices receive gradients from the experts),
and every gradient is summed over all ranks and divided by their number: the mean over
the shards of each one's loss plus its load-balancing loss. The planted bug
``expert-return`` sends each expert's results back to the wrong rank (rolled by one).
"""

from __future__ import annotations

import time
import warnings
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
    aux_loss,
    global_mean,
    loss_fn,
    plan_optimizer,
    save_rank,
)


def _exchange(group: Any, ep: int, index: int, bug: str | None):
    """``exchange(buffers, layer)`` for an expert group of ``ep`` ranks, this rank ``index``."""
    from torch.distributed.nn.functional import all_to_all_single

    def exchange(buffers, layer):
        b, e, c, d = buffers.shape
        per = e // ep
        send = buffers.permute(1, 0, 2, 3).reshape(ep, per, b, c, d).contiguous()
        recv = all_to_all_single(send.new_empty(send.shape), send, group=group)
        mine = recv.permute(0, 2, 1, 3, 4).reshape(ep * b, per, c, d)  # [B ep, E/ep, C, D]
        out = layer.experts(mine, index * per, (index + 1) * per)
        back = out.reshape(ep, b, per, c, d).permute(0, 2, 1, 3, 4).contiguous()
        if bug == "expert-return":
            back = back.roll(1, 0)
        got = all_to_all_single(back.new_empty(back.shape), back, group=group)
        return got.reshape(e, b, c, d).permute(1, 0, 2, 3)

    return exchange


def _rank(rank: int, world: int, plan: TrainPlan, extra: Any, out: Path) -> None:
    import torch.distributed as dist

    ep, bug = extra
    # torch.distributed.nn.functional's all_to_all_single is the one with a backward in
    # PyTorch 2.13's public API; its deprecation names a private module instead.
    warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated")
    groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(world // ep)]
    model = plan.model.build(plan.params, bn="local")
    model.train()
    exchange = _exchange(groups[rank // ep], ep, rank % ep, bug)
    for m in model.modules():
        if hasattr(m, "exchange"):
            m.exchange = exchange
    params = _trainable(model)
    opt = plan_optimizer(plan, [model])
    criterion = loss_fn(plan.loss)
    losses, times, first = [], [], {}
    for batch, lr in zip(plan.batches, plan.lrs, strict=True):
        n = batch["x"].shape[0] // world
        x, y = (_tensor(batch[k][rank * n : (rank + 1) * n]) for k in ("x", "y"))
        t0 = time.perf_counter()
        _set_lr(opt, lr)
        opt.zero_grad(set_to_none=False)
        loss = criterion(model(x), y)
        (loss + aux_loss(model)).backward()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        losses.append(global_mean(loss, world))
        times.append(time.perf_counter() - t0)
        if len(losses) == 1:
            first = export(model)
    save_rank(out, rank, export(model), losses, times, first)


def train_experts(
    plan: TrainPlan, data: int, ep: int, bug: str | None = None, timeout: float = 600
) -> TorchResult:
    """The expert-parallel twin on ``data x ep`` gloo processes."""
    return _read(_spawn(_rank, data * ep, plan, (ep, bug), timeout))


def describe(data: int, ep: int) -> str:
    """What ran, in words (``framework_impl``)."""
    return (f"mixture of experts over all_to_all_single (expert groups of {ep}) x {data} "
            "data ranks, gloo")  # fmt: skip
