"""Measure this machine and write a hardware profile (``python -m refdl.hw calibrate``).

- device: float32 and bfloat16 matmul FLOP/s (best of several 2048^3 products,
  jitted), memory bandwidth (bytes read + written by a jitted copy of 256 MiB);
- ``links.intra``: alpha and beta of an allreduce between 2 simulated devices
  (``psum`` in ``shard_map``), fitted to the ring model over message sizes;
- ``links.inter``: the same between 2 MPI ranks (mpi4py allreduce on NumPy
  buffers under ``mpirun -n 2``), when MPI is available.

For a ring allreduce of n bytes on p = 2 ranks, ``t = 2(p-1)α + 2n(p-1)/p·β``
= ``2α + nβ``; the smallest and largest messages give α and β. The achievable
fraction is 1 (these are measured rates, not line rates).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SIZES = [2**k for k in range(12, 24, 2)]  # 4 KiB .. 4 MiB


def _best(fn, repeats: int = 5) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_flops(dtype: str, n: int = 2048) -> float:
    """Best FLOP/s of an ``n x n`` jitted matmul in ``dtype``."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    t = _best(lambda: f(a).block_until_ready())
    return 2 * n**3 / t


def memory_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes moved per second (read + write) by a jitted array copy."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: x + 1.0, donate_argnums=0)  # reuse the buffer: no page faults
    box = [jnp.ones(nbytes // 4, jnp.float32)]

    def step():
        box[0] = f(box[0])
        box[0].block_until_ready()

    return 2 * nbytes / _best(step, repeats=9)


def dispatch_time(repeats: int = 200) -> float:
    """Median host time of calling a compiled step that does almost nothing."""
    import jax
    import jax.numpy as jnp

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
    import jax
    import jax.numpy as jnp

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


def fit_alpha_beta(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """α, β from ring allreduce times on 2 ranks, ``t = 2α + nβ``: α from the smallest
    message, β from the slope between the smallest and the largest (a two-point fit:
    least squares lets the noisy large messages set the intercept).

    >>> a, b = fit_alpha_beta([0, 500, 1000], [2e-6, 2.6e-6, 3e-6])
    >>> round(a, 9), round(b, 12)
    (1e-06, 1e-09)
    """
    order = np.argsort(sizes)
    n0, n1 = float(sizes[order[0]]), float(sizes[order[-1]])
    t0, t1 = float(times[order[0]]), float(times[order[-1]])
    beta = max((t1 - t0) / (n1 - n0), 1e-15)
    return max((t0 - n0 * beta) / 2, 1e-9), beta


def simulated_devices_allreduce() -> tuple[list[int], list[float]]:
    """Allreduce times between 2 simulated devices (psum in shard_map) per message size."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 2:
        raise RuntimeError(
            "needs 2 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=2"
        )
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    f = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
    )
    times = []
    for n in SIZES:
        x = jax.device_put(jnp.ones(2 * n // 4, jnp.float32), NamedSharding(mesh, P("data")))
        times.append(_best(lambda x=x: f(x).block_until_ready(), repeats=9))
    return SIZES, times


MPI_SCRIPT = r"""
import json, time, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
out = []
for n in %s:
    buf = np.ones(n // 4, np.float32); res = np.empty_like(buf)
    best = 1e9
    for _ in range(9):
        comm.Barrier(); t0 = time.perf_counter()
        comm.Allreduce(buf, res, op=MPI.SUM)
        best = min(best, time.perf_counter() - t0)
    out.append(comm.allreduce(best, op=MPI.MAX))
if comm.Get_rank() == 0:
    print(json.dumps(out))
"""


def mpi_allreduce(timeout: float = 120) -> tuple[list[int], list[float]] | None:
    """Allreduce times between 2 MPI ranks, or None when mpirun / mpi4py are missing."""
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if mpirun is None:
        return None
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = [mpirun, "--oversubscribe", "-n", "2", sys.executable, "-c", MPI_SCRIPT % SIZES]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    return SIZES, json.loads(proc.stdout.strip().splitlines()[-1])


def calibrate(name: str = "local") -> dict:
    """Measure and return the profile as a dict (the TOML structure)."""
    import platform

    fp32, bf16 = matmul_flops("float32"), matmul_flops("bfloat16")
    sizes, sim = simulated_devices_allreduce()
    a_sim, b_sim = fit_alpha_beta(sizes, sim)
    when = time.strftime("%Y-%m-%d")
    links = {
        "intra": {
            "latency_s": a_sim,
            "bandwidth": 1.0 / b_sim,
            "achievable": 1.0,
            "source": f"refdl.hw calibrate {when}: psum between 2 simulated devices, "
            f"ring fit over {sizes[0]}..{sizes[-1]} bytes",
        }
    }
    mpi = mpi_allreduce()
    if mpi is not None:
        a_mpi, b_mpi = fit_alpha_beta(*mpi)
        links["inter"] = {
            "latency_s": a_mpi,
            "bandwidth": 1.0 / b_mpi,
            "achievable": 1.0,
            "source": f"refdl.hw calibrate {when}: mpi4py Allreduce between 2 ranks, "
            f"ring fit over {sizes[0]}..{sizes[-1]} bytes",
        }
    return {
        "name": name,
        "description": f"this machine ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs), measured by refdl.hw calibrate on {when}",
        "devices_per_node": 8,
        "device": {
            "name": f"CPU ({os.cpu_count()} cores) as seen by XLA",
            "peak_flops": {"float32": fp32, "bfloat16": bf16},
            "memory_bandwidth": memory_bandwidth(),
            "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
            "source": f"refdl.hw calibrate {when}: best jitted 2048^3 matmul; jitted 256 MiB "
            "copy; median call of a trivial jitted step; slope of a chain of tiny ops; the "
            "simulated devices share the host's cores",
            "dispatch_s": dispatch_time(),
            "op_overhead_s": op_overhead(),
            "shared_cores": True,
        },
        "links": links,
    }
