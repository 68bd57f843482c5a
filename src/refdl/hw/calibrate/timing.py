"""Timing helpers every calibration shares: the median and the best of repeated calls."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_call(fn, args: tuple, repeats: int = 40) -> float:
    """Median wall time of ``fn(*args)`` to completion, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def best(fn, repeats: int = 5) -> float:
    """The shortest of ``repeats`` timed calls of ``fn()``, after one warm-up call."""
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
