"""The links' alpha and beta as this machine delivers them: an allreduce between 2 simulated
devices (a chain of psums, as inside a step) and between 2 MPI ranks (mpi4py).

For a ring allreduce of n bytes on p = 2 ranks, ``t = 2(p-1)α + 2n(p-1)/p·β``
= ``2α + nβ``; the smallest and largest messages give α and β.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.hw.calibrate.timing import median_call

SIZES = [2**k for k in range(12, 24, 2)]  # 4 KiB .. 4 MiB


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


def simulated_devices_allreduce(chain: tuple[int, int] = (2, 12)) -> tuple[list[int], list[float]]:
    """Allreduce times between 2 simulated devices (psum in shard_map) per message size, as
    a step pays them: the slope of a program's time against the number of dependent psums
    it chains (from ``chain[0]`` to ``chain[1]``), so the call's dispatch is left out."""
    if len(jax.devices()) < 2:
        raise RuntimeError(
            "needs 2 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=2"
        )
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])

    def psums(k):
        def body(x):
            for _ in range(k):
                x = jax.lax.psum(x, "data") * 0.5
            return x

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

    short, long = psums(chain[0]), psums(chain[1])
    times = []
    for n in SIZES:
        x = jax.device_put(jnp.ones(2 * n // 4, jnp.float32), NamedSharding(mesh, P("data")))
        slopes = [(median_call(long, (x,), 15) - median_call(short, (x,), 15))
                  / (chain[1] - chain[0]) for _ in range(3)]  # fmt: skip
        times.append(max(float(np.median(slopes)), 1e-9))
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
