"""The device's peaks as this machine delivers them: matmul FLOP/s, memory bandwidth, the
host's time to launch a compiled step, and the fixed cost of one executed operation."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from refdl.hw.calibrate.timing import best


def matmul_flops(dtype: str, n: int = 2048) -> float:
    """Best FLOP/s of an ``n x n`` jitted matmul in ``dtype``."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    t = best(lambda: f(a).block_until_ready())
    return 2 * n**3 / t


def memory_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes moved per second (read + write) by a jitted array copy."""
    f = jax.jit(lambda x: x + 1.0, donate_argnums=0)  # reuse the buffer: no page faults
    box = [jnp.ones(nbytes // 4, jnp.float32)]

    def step():
        box[0] = f(box[0])
        box[0].block_until_ready()

    return 2 * nbytes / best(step, repeats=9)


def dispatch_time(repeats: int = 200) -> float:
    """Median host time of calling a compiled step that does almost nothing."""
    f = jax.jit(lambda x: x + 1.0)
    x = jnp.ones(16, jnp.float32)
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def op_overhead(short: int = 10, long: int = 400) -> float:
    """Fixed cost per executed operation: the slope of the time of a chain of dependent,
    unfusable tiny operations (8x8 products) against the chain's length."""

    def chain(k):
        def f(x):
            for _ in range(k):
                x = jnp.sin(x) @ x
            return x

        g = jax.jit(f)
        x = jnp.full((8, 8), 0.1, jnp.float32)
        g(x).block_until_ready()
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            g(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    return max((chain(long) - chain(short)) / (2 * (long - short)), 0.0)
