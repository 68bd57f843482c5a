"""Measure this machine and write a hardware profile (``python -m refdl.hw calibrate``).

- ``device``: float32 and bfloat16 matmul FLOP/s (best of several 2048^3 products,
  jitted), memory bandwidth (bytes read + written by a jitted copy of 256 MiB),
  dispatch and per-operation overhead (``device.py``);
- ``[device.ops.*]``: Hockney fits per operation kind (``ops.py``);
- ``[device.in_step]``: operations inside generic training steps against the same
  alone (``in_step.py``);
- ``links.intra``: alpha and beta of an allreduce between 2 simulated devices
  (``psum`` in ``shard_map``); ``links.inter``: the same between 2 MPI ranks
  (mpi4py allreduce on NumPy buffers under ``mpirun -n 2``), when MPI is
  available (``links.py``). The achievable fraction is 1 (these are measured
  rates, not line rates).
"""

from __future__ import annotations

import os
import platform
import time

from refdl.hw.calibrate.device import dispatch_time, matmul_flops, memory_bandwidth, op_overhead
from refdl.hw.calibrate.in_step import device_tables
from refdl.hw.calibrate.links import (
    fit_alpha_beta,
    mpi_allreduce,
    simulated_devices_allreduce,
)


def calibrate(name: str = "local") -> dict:
    """Measure and return the profile as a dict (the TOML structure)."""
    fp32, bf16 = matmul_flops("float32"), matmul_flops("bfloat16")
    sizes, sim = simulated_devices_allreduce()
    a_sim, b_sim = fit_alpha_beta(sizes, sim)
    when = time.strftime("%Y-%m-%d")
    links = {
        "intra": {
            "latency_s": a_sim,
            "bandwidth": 1.0 / b_sim,
            "achievable": 1.0,
            "source": f"refdl.hw calibrate {when}: psum between 2 simulated devices (slope "
            f"of a chain of psums: as inside a step), ring fit over {sizes[0]}..{sizes[-1]} "
            "bytes",
        }
    }
    bandwidth = memory_bandwidth()
    tables = device_tables(fp32, bandwidth, when)
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
            "memory_bandwidth": bandwidth,
            "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
            "source": f"refdl.hw calibrate {when}: best jitted 2048^3 matmul; jitted 256 MiB "
            "copy; median call of a trivial jitted step; slope of a chain of tiny ops; the "
            "simulated devices share the host's cores; [device.ops.*]: Hockney fits per "
            "operation kind (refdl.perf.ops); [device.in_step]: operations inside generic "
            "training steps against the same alone",
            "dispatch_s": dispatch_time(),
            "op_overhead_s": op_overhead(),
            "shared_cores": True,
            **tables,
        },
        "links": links,
    }
