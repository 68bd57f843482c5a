"""What a program under ``jax.jit`` shardings is traced under on a mesh, for the axes that
change how the model computes (``hybrid``, and each of its pipeline stages on its
sub-mesh): the token order a ``context`` axis holds, and the hooks of sequence
parallelism, context parallelism and expert parallelism. One place, so a whole-mesh
program and a stage's program see the same model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from refdl.core.layers import residual_layout, sequence_shard
from refdl.core.moe import expert_shard
from refdl.parallel.context import context_attention, sequence_split, zigzag_order
from refdl.parallel.expert import expert_parallel


def token_order(plan: Any, sample_x: Any) -> np.ndarray | None:
    """``[context, T/context]``: the zig-zag order a ``context`` axis holds the tokens in
    (``refdl.parallel.context.zigzag_order``); None without one."""
    c = plan.mesh.context
    return zigzag_order(np.shape(sample_x)[1], c) if c > 1 else None


def batch_dims(plan: Any, order: np.ndarray | None) -> tuple[Any, ...]:
    """The batch's ``PartitionSpec`` entries: examples over the plan's batch axes, and the
    sequence over ``context`` when there is one."""
    return (plan.batch_axes, "context") if order is not None else (plan.batch_axes,)


def in_order(batch: dict[str, Any], order: np.ndarray | None) -> dict[str, Any]:
    """The host batch with each device's zig-zag chunks contiguous (unchanged without)."""
    if order is None:
        return batch
    return {k: np.asarray(v)[:, order.reshape(-1)] for k, v in batch.items()}


@contextlib.contextmanager
def traced_on(mesh: Any, plan: Any, spec: Any, order: np.ndarray | None) -> Iterator[None]:
    """While tracing on ``mesh``: the residual stream split along the sequence
    (``--sequence-parallel``), attention over ``context`` (``--cp``) and the experts over
    ``expert``, each only where the plan has it."""
    axes = plan.batch_axes
    layout = sequence_split(mesh, axes) if spec.sequence_parallel else None
    split = context_attention(spec.cp, mesh, axes, order) if order is not None else None
    experts = expert_parallel(mesh, axes) if plan.mesh.expert > 1 else None
    with residual_layout(layout), sequence_shard(split), expert_shard(experts):
        yield
