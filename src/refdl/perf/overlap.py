"""The gradient allreduce overlapped with back-propagation as the frameworks do it.

PyTorch DDP (Li et al., VLDB 2020) and Horovod's tensor fusion (Sergeev & Del
Balso 2018) put gradients into buckets in reverse layer order (DDP's default
``bucket_cap_mb = 25``) and start each bucket's allreduce as soon as its last
gradient is ready; buckets go over the link one after another. The step ends
when the backward pass and the last bucket's allreduce have both finished.

Assumptions, stated: the backward pass takes ``backward_share`` of the step's
compute (2/3: twice the forward) and produces each parameter array's gradient
after an equal share of it, walking the arrays from last to first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

DDP_BUCKET_BYTES = 25 * 1024 * 1024
BACKWARD_SHARE = 2.0 / 3.0


@dataclasses.dataclass(frozen=True)
class Overlapped:
    """One step: its time, the communication left after the backward pass, the buckets."""

    step_s: float
    exposed_s: float
    buckets: tuple[tuple[float, float, float], ...]  # (bytes, start, end) per bucket


def buckets_of(layer_bytes: Sequence[float], cap: float) -> list[tuple[float, int]]:
    """``(bytes, index of the array that completes it)`` per bucket, filled from the last
    array back (reverse layer order) until a bucket holds at least ``cap`` bytes."""
    out, size = [], 0.0
    n = len(layer_bytes)
    for k, b in enumerate(reversed(layer_bytes)):
        size += b
        if size >= cap:
            out.append((size, k))
            size = 0.0
    if size > 0:
        out.append((size, n - 1))
    return out


def bucketed_step(
    compute_s: float,
    layer_bytes: Sequence[float],
    allreduce: Callable[[float], float],
    cap: float = DDP_BUCKET_BYTES,
    backward_share: float = BACKWARD_SHARE,
) -> Overlapped:
    """The step time with bucketed allreduces overlapping the backward pass.

    ``allreduce(n)`` is the time of one allreduce of ``n`` bytes; with no arrays given
    (a model of unknown layout) all gradients form one bucket at the end."""
    if not layer_bytes:
        t = allreduce(0.0)
        return Overlapped(compute_s + t, t, ())
    fwd = compute_s * (1.0 - backward_share)
    per_array = compute_s * backward_share / len(layer_bytes)
    end, out = 0.0, []
    for size, k in buckets_of(layer_bytes, cap):
        ready = fwd + (k + 1) * per_array
        start = max(ready, end)
        end = start + allreduce(size)
        out.append((size, start, end))
    step = max(compute_s, end)
    return Overlapped(step, step - compute_s, tuple(out))


def with_frameworks_overlap(profile: Any, opts: Any) -> Any:
    """``opts`` (``PredictOptions``) with the frameworks' bucketed overlap of data's gradient
    allreduce (DDP's buckets) where the profile has achieved figures and no overlap was
    asked: the expectation of a run as frameworks make it (``predict`` and ``plan``)."""
    if profile.achieved is not None and opts.overlap == 0 and opts.bucket_mb == 0:
        return dataclasses.replace(opts, bucket_mb=DDP_BUCKET_BYTES / 2**20)
    return opts
