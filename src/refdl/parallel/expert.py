"""Expert parallelism: the experts of every mixture-of-experts layer split over the
``expert`` mesh axis, the tokens' buffers sent to them and back by all-to-all.

The ``expert`` axis also splits the batch (for every other layer it is one more data
axis, as in GShard and DeepSpeed-MoE). A device routes its own sequences into buffers
``[B/b, E, C, D]`` for all ``E`` experts (``refdl.core.moe``); one all-to-all over
``expert`` sends each device the buffers of its ``E/ep`` experts from every device of its
group, ``[B·ep/b, E/ep, C, D]``; the experts run; one all-to-all returns the results.
The backward pass is the same two all-to-alls on the cotangents.

Bytes per mixture-of-experts layer and step, summed over all ``n`` devices (fp32, 4 bytes,
forward and backward): ``4 · n · (ep-1)/ep · 4·(B/b)·E·C·D`` - each of the four
all-to-alls keeps ``1/ep`` of a device's buffer and sends the rest.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from refdl.core.moe import Experts, ExpertShard

Array = jax.Array
AXIS = "expert"


def _names(axes: Any) -> set[str]:
    return {axes} if isinstance(axes, str) else set(axes or ())


def expert_parallel(mesh: Any, batch_axes: Any) -> ExpertShard:
    """Experts split over ``expert`` of ``mesh``, the buffers' batch over ``batch_axes``
    (which include ``expert``); the other mesh axes stay with XLA's partitioner."""

    def run(experts: Experts, buffers: Array, params: Any) -> Array:
        def local(buffers: Array, params: Any) -> Array:
            mine = jax.lax.all_to_all(buffers, AXIS, 1, 0, tiled=True)  # [B·ep/b, E/ep, C, D]
            out = experts(mine, params)
            return jax.lax.all_to_all(out, AXIS, 0, 1, tiled=True)  # [B/b, E, C, D]

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(batch_axes), jax.tree.map(lambda _: P(AXIS), params)),
            out_specs=P(batch_axes),
            axis_names=_names(batch_axes) | {AXIS},
        )(buffers, params)

    return ExpertShard(run=run)


def expert_widths(params: Any) -> list[tuple[int, int]]:
    """``(experts, d_model)`` of every mixture-of-experts layer of ``params`` (its first
    weights ``w1``, ``[E, d_model, F]``), in order."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [w.shape[:2] for path, w in flat if getattr(path[-1], "key", None) == "w1"]


def expert_bytes(
    devices: int, ep: int, local_buffer_values: int, layers: int, itemsize: int = 4
) -> int:
    """Bytes the all-to-alls of ``layers`` mixture-of-experts layers move per step, summed
    over ``devices``, for one device's buffer of ``local_buffer_values = (B/b)·E·C·D``."""
    if ep == 1:
        return 0
    return layers * 4 * devices * (ep - 1) * local_buffer_values * itemsize // ep
