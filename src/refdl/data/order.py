"""The deterministic data order every strategy shares.

Training examples are read as one endless stream: epoch ``e`` is the
permutation ``perm(seed, e)`` of ``0..n-1``, and the stream is epoch 0, then
epoch 1, ... The global batch at step ``t`` is stream positions
``[t*B, (t+1)*B)``: a pure function of ``(seed, t)`` (the epoch is
``t*B // n``). A batch that crosses an epoch boundary takes the tail of one
epoch and the head of the next, so every batch is full and no example is
dropped. A worker's share is a contiguous slice of the global batch, a pure
function of ``(global batch, worker, workers)``. Strategies never reorder data.
"""

from __future__ import annotations

import functools

import numpy as np

from refdl.errors import UsageError


@functools.lru_cache(maxsize=8)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the ``n`` training examples in ``epoch`` (NumPy's PCG64, platform-stable)."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    perm.flags.writeable = False
    return perm


def epoch_of(step: int, batch_size: int, n: int) -> int:
    """The epoch in which the global batch of ``step`` starts."""
    return (step * batch_size) // n


def global_batch_indices(seed: int, step: int, batch_size: int, n: int) -> np.ndarray:
    """Indices of the examples in the global batch of ``step``.

    >>> a = global_batch_indices(0, 0, 4, 10); b = global_batch_indices(0, 1, 4, 10)
    >>> len(set(a) | set(b))
    8
    """
    return stream_indices(seed, step * batch_size, batch_size, n)


def stream_indices(seed: int, start: int, batch_size: int, n: int) -> np.ndarray:
    """Indices of the ``batch_size`` examples at stream positions ``start ..`` (a batch of
    any size anywhere in the stream: a growing batch's, ``refdl.config.batches``)."""
    if batch_size <= 0 or n <= 0:
        raise UsageError(f"batch size and data set size must be > 0 (got {batch_size}, {n})")
    out = np.empty(batch_size, np.int64)
    filled = 0
    while filled < batch_size:
        epoch, offset = divmod(start + filled, n)
        take = min(batch_size - filled, n - offset)
        out[filled : filled + take] = epoch_permutation(seed, epoch, n)[offset : offset + take]
        filled += take
    return out


def worker_slice(batch_size: int, worker: int, workers: int) -> slice:
    """The contiguous slice of a global batch that belongs to ``worker`` of ``workers``."""
    if workers <= 0 or not 0 <= worker < workers:
        raise UsageError(f"worker {worker} of {workers} is out of range")
    if batch_size % workers:
        raise UsageError(
            f"global batch {batch_size} does not divide over {workers} workers; "
            f"use a --batch-size that is a multiple of {workers}"
        )
    per = batch_size // workers
    return slice(worker * per, (worker + 1) * per)


def worker_share(global_batch: dict[str, np.ndarray], worker: int, workers: int):
    """The worker's share of a global batch (``{"x", "y"}`` sliced on axis 0)."""
    size = len(next(iter(global_batch.values())))
    sl = worker_slice(size, worker, workers)
    return {k: v[sl] for k, v in global_batch.items()}
