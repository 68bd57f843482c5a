"""PyTorch's own sharded training of a twin model, one gloo process per rank: FSDP2
(``fully_shard`` per layer; ``--zero 1`` is ``ZeroRedundancyOptimizer`` over DDP), DTensor
tensor parallelism (``parallelize_module`` with refdl's column/row pairs, and
``SequenceParallel`` for the norms), and the two composed on a 2-D ``init_device_mesh``
as torchtitan composes them (tensor parallelism inside, FSDP2 over the batch axis).

Each runner takes refdl's batches and learning rates and returns the per-step losses and
the full parameters in refdl's layout (``full_tensor()`` of every DTensor). A ``bug``
plants a realistic mistake in PyTorch's side, so a test can check that ``refdl validate``
catches it: ``divide`` (the gradients summed over the batch ranks instead of averaged:
a divide factor off by the mesh size), ``rowwise`` (a ``RowwiseParallel`` left out: partial sums
never reduced).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

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
    optimizer_class,
    plan_optimizer,
    save_rank,
)
from refdl.errors import UsageError

BUGS = ("divide", "rowwise")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the ranks are laid out: ``dp`` ways over the batch (FSDP2, or ZeRO-1 when
    ``zero`` is 1), ``tp`` ways tensor-parallel; ``sequence``: SequenceParallel norms."""

    dp: int = 1
    tp: int = 1
    zero: int = 3
    sequence: bool = False
    bug: str | None = None


def export_full(module: Any) -> dict[str, np.ndarray]:
    """The parameters of a sharded ``module`` in refdl's layout, each gathered whole
    (a collective: every rank calls it)."""
    out = {}
    for path, tensor, _, from_torch in module.links():
        t = tensor.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[path] = np.array(from_torch(t.cpu().numpy()), copy=True, order="C")
    return out


def _tp_plan(model: Any, sequence: bool, bug: str | None) -> dict[str, Any]:
    """refdl's column/row pairs as DTensor styles: a Dense whose output units are split
    (its kernel's out axis ``mlp``) is ``ColwiseParallel``, one whose input units are
    (in axis ``mlp``) ``RowwiseParallel``; attention splits heads (Q, K, V column, the
    output projection row). ``sequence``: norms ``SequenceParallel``, the residual stream
    split over the sequence between them."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from refdl.adapters.torch.models import Dense, LayerNorm, TransformerBlock

    def col():
        return ColwiseParallel(input_layouts=Shard(1)) if sequence else ColwiseParallel()

    def row():
        if bug == "rowwise":  # the planted bug: a row layer's partial sums never reduced
            return RowwiseParallel(output_layouts=Partial())
        if sequence:
            return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        return RowwiseParallel()

    plan: dict[str, Any] = {}
    blocks = list(model.blocks)
    first_block = next((i for i, b in enumerate(blocks) if isinstance(b, TransformerBlock)),
                       None)  # fmt: skip
    for i, b in enumerate(blocks):
        name = f"blocks.{i}"
        if isinstance(b, Dense):
            layer = getattr(b, "refdl_axes", (None, None))
            if layer[1] == "mlp":
                plan[f"{name}.linear"] = ColwiseParallel()
            elif layer[0] == "mlp":
                plan[f"{name}.linear"] = row()
            elif sequence and first_block is not None and i > first_block:  # the head
                plan[name] = PrepareModuleInput(input_layouts=Shard(1),
                                                desired_input_layouts=Replicate(),
                                                use_local_output=True)  # fmt: skip
        elif isinstance(b, TransformerBlock):
            if sequence:
                plan[f"{name}.ln0.norm"] = SequenceParallel()
                plan[f"{name}.ln1.norm"] = SequenceParallel()
                if i == first_block:
                    plan[name] = PrepareModuleInput(input_layouts=Replicate(),
                                                    desired_input_layouts=Shard(1),
                                                    use_local_output=False)  # fmt: skip
            for w in ("wq", "wk", "wv"):
                plan[f"{name}.{w}"] = col()
            plan[f"{name}.wo"] = row()
            plan[f"{name}.fc0.linear"] = col()
            plan[f"{name}.fc1.linear"] = row()
        elif isinstance(b, LayerNorm) and sequence and first_block is not None:
            plan[f"{name}.norm"] = SequenceParallel()
    return plan


def _rank(rank: int, world: int, plan: TrainPlan, layout: Layout, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    # Two notes that say nothing to a refdl user: full_tensor() of a 2-D sharded weight
    # gathers twice; the root module's output is a view (refdl's twin never edits it).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    model = plan.model.build(plan.params, bn="sync" if layout.dp > 1 else "local")
    model.train()
    dp_rank = rank // layout.tp
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        if layout.dp > 1:
            mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
            tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
        else:
            tp_mesh, dp_mesh = init_device_mesh("cpu", (layout.tp,)), None
        parallelize_module(model, tp_mesh, _tp_plan(model, layout.sequence, layout.bug))
    else:
        dp_mesh = init_device_mesh("cpu", (layout.dp,)) if layout.dp > 1 else None
    net, opt = model, None
    if layout.dp > 1 and layout.zero == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        with warnings.catch_warnings():  # rank-local buffers, as runners._ddp_rank says
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
            net = DDP(model, broadcast_buffers=False)
        cls, kwargs = optimizer_class(plan.optimizer, plan.momentum, plan.weight_decay)
        opt = ZeroRedundancyOptimizer(_trainable(model), optimizer_class=cls, lr=0.0,
                                      foreach=False, **kwargs)  # fmt: skip
    elif layout.dp > 1:
        from torch.distributed.fsdp import fully_shard

        again = layout.zero == 3  # ZeRO-3: parameters resharded after each forward
        for block in model.blocks:
            if any(p.requires_grad for p in block.parameters()):
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=again)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=again)
    if opt is None:  # after fully_shard: DTensor and plain parameters side by side
        opt = plan_optimizer(plan, [model], foreach=False)
    criterion = loss_fn(plan.loss)
    losses, times, first = [], [], {}
    for batch, lr in zip(plan.batches, plan.lrs, strict=True):
        n = batch["x"].shape[0] // layout.dp
        x = _tensor(batch["x"][dp_rank * n : (dp_rank + 1) * n])
        y = _tensor(batch["y"][dp_rank * n : (dp_rank + 1) * n])
        t0 = time.perf_counter()
        _set_lr(opt, lr)
        opt.zero_grad(set_to_none=True)
        logits = net(x)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        loss = criterion(logits, y)
        loss.backward()
        if layout.bug == "divide":  # the planted bug: the gradients summed, not averaged
            for p in _trainable(model):  # (a divide factor off by the mesh size; FSDP2's
                p.grad.mul_(layout.dp)  # set_gradient_divide_factor needs PREMUL_SUM)
        opt.step()
        losses.append(global_mean(loss, world))  # every tp rank of a dp shard holds its loss
        times.append(time.perf_counter() - t0)
        if len(losses) == 1:
            first = export_full(model)
    save_rank(out, rank, export_full(model), losses, times, first)


def train_sharded(plan: TrainPlan, layout: Layout, timeout: float = 600) -> TorchResult:
    """PyTorch's sharded twin on ``layout.dp * layout.tp`` CPU processes (gloo): rank
    ``r`` at (``r // tp``, ``r % tp``) takes the ``r // tp``-th contiguous shard of each
    global batch, as refdl's batch axes do."""
    world = layout.dp * layout.tp
    if plan.batches and plan.batches[0]["x"].shape[0] % layout.dp:
        raise UsageError(
            f"batch {plan.batches[0]['x'].shape[0]} does not split over {layout.dp} ranks"
        )
    if layout.bug is not None and layout.bug not in BUGS:
        raise UsageError(f"--plant-bug {layout.bug}: choose one of {', '.join(BUGS)}")
    return _read(_spawn(_rank, world, plan, layout, timeout))


def describe(layout: Layout) -> str:
    """The PyTorch implementation a layout runs, in words (``framework_impl``)."""
    parts = []
    if layout.tp > 1:
        parts.append("parallelize_module (ColwiseParallel, RowwiseParallel"
                     + (", SequenceParallel)" if layout.sequence else ")"))  # fmt: skip
    if layout.dp > 1:
        parts.append("ZeroRedundancyOptimizer over DDP" if layout.zero == 1 else
                     f"fully_shard (reshard_after_forward={layout.zero == 3})")  # fmt: skip
    mesh = f"init_device_mesh {layout.dp}x{layout.tp}" if layout.dp > 1 and layout.tp > 1 else ""
    return " + ".join(parts) + (f" on {mesh}" if mesh else "") + ", gloo"
