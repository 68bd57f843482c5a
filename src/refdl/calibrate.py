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

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def simulated_devices_allreduce(chain: tuple[int, int] = (2, 12)) -> tuple[list[int], list[float]]:
    """Allreduce times between 2 simulated devices (psum in shard_map) per message size, as
    a step pays them: the slope of a program's time against the number of dependent psums
    it chains (from ``chain[0]`` to ``chain[1]``), so the call's dispatch is left out."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

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
        slopes = [(_median_call(long, (x,), 15) - _median_call(short, (x,), 15))
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


# ----------------------------------------------------------------- operation-level rates
#
# Each kind of operation XLA executes (``refdl.perf.ops``) is timed at a handful of
# generic sizes - a grid, not the shapes of any model - and Hockney's
# ``t = t0 + n / r_inf`` is fitted to it (``refdl.perf.ops.fit_hockney``). Products
# (dot, convolution) are timed as they run inside a step: a program chains K dependent
# copies (``x = x @ w``, ``x = conv(x, w)`` and their transposes), and one copy's cost is
# the slope of the program's time between K = 2 and a K long enough to last milliseconds,
# the call's dispatch excluded. Other kinds fuse with their neighbours when chained
# (XLA:CPU drops optimization barriers before fusing), so each is timed alone at large
# sizes, where its rate is the slope of time against bytes (dispatch and start-up cancel),
# and its start-up ``t0`` is the fixed cost per executed operation (``op_overhead``: the
# slope of a chain of tiny unfusable operations).

DOT_SHAPES = [(32, 32), (64, 64), (128, 128), (256, 256), (512, 512), (256, 32), (32, 256),
              (1024, 64)]  # fmt: skip  # (rows, features): x (rows, f) @ w (f, f)
CONV_SHAPES = [  # (batch, height = width, features, kernel)
    (32, 12, 2, 3), (32, 12, 16, 3), (32, 12, 32, 3), (32, 12, 2, 5), (32, 12, 16, 5),
    (8, 24, 4, 5), (64, 6, 8, 5), (16, 16, 8, 3),
]  # fmt: skip
ELEMENTS = [2**k for k in range(8, 21, 2)]  # 256 .. 1 M float32 elements
LEAVES = [1, 4, 16, 64]
REPEATS = (2, 10)


def _median_call(fn, args: tuple, repeats: int = 40) -> float:
    """Median wall time of ``fn(*args)`` to completion, after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def chained(step, k: int):
    """A jitted program ``x -> step(step(...step(x, w)..., w), w)`` (k dependent copies)."""
    import jax

    def prog(x, w):
        for _ in range(k):
            x = step(x, w)
        return x

    return jax.jit(prog)


def _chains() -> dict[str, list[tuple]]:
    """Per product kind, ``(step, x, w)`` with ``step(x, w)`` shaped like ``x``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip

    def conv_dx(g, w):  # the input gradient of conv: a convolution with a reversed kernel
        return jax.linear_transpose(lambda x: conv(x, w), g)(g)[0]

    out: dict[str, list[tuple]] = {"dot": [], "convolution": []}
    for m, f in DOT_SHAPES:
        x, w = jnp.full((m, f), 0.01), jnp.full((f, f), 0.01)
        out["dot"] += [(lambda x, w: x @ w, x, w), (lambda x, w: (w.T @ x.T).T, x, w)]
    for b, h, c, k in CONV_SHAPES:
        x, w = jnp.full((b, h, h, c), 0.01), jnp.full((k, k, c, c), 0.01)
        out["convolution"] += [(conv, x, w), (conv_dx, x, w)]
    return out


def _op_programs() -> dict[str, list[tuple]]:
    """Per memory-bound kind, generic single-operation programs ``(jitted fn, args)``, in
    the order the kinds are fitted (simple kinds first: they are subtracted later)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    ones = jnp.ones
    kinds = ("elementwise", "copy", "reduce", "reduce-window", "select-and-scatter", "scatter")
    progs: dict[str, list[tuple]] = {k: [] for k in kinds}
    pool = functools.partial(lax.reduce_window, window_dimensions=(1, 2, 2, 1),
                             window_strides=(1, 2, 2, 1), padding="VALID")  # fmt: skip
    mx = functools.partial(pool, init_value=-jnp.inf, computation=lax.max)
    for n in ELEMENTS:
        progs["elementwise"].append(
            (jax.jit(lambda a, b: jnp.tanh(a * b + 1.0)), (ones(n), ones(n)))
        )
        progs["reduce"].append((jax.jit(lambda a: a.sum(1)), (ones((max(n // 256, 1), 256)),)))
        side = math.isqrt(n)
        progs["copy"].append((jax.jit(lambda a: a.T), (ones((side, side + 1)),)))
        idx = jnp.arange(0, n, 4) % max(n // 8, 1)
        progs["scatter"].append(
            (jax.jit(lambda z, i, v: z.at[i].add(v)), (ones(max(n // 8, 1)), idx, ones(len(idx))))
        )
        hw = max(math.isqrt(n // 16) // 2 * 2, 2)
        x4 = ones((4, hw, hw, 4)) * jnp.arange(4.0).reshape(1, 1, 1, 4)
        avg = jax.jit(lambda x: pool(x, init_value=0.0, computation=lax.add))
        progs["reduce-window"].append((avg, (x4,)))
        g = ones((4, hw // 2, hw // 2, 4))
        sas = jax.jit(lambda x, g: jax.vjp(mx, x)[1](g)[0])
        progs["select-and-scatter"].append((sas, (x4, g)))
    return progs


def op_rates(when: str = "") -> dict[str, dict]:
    """Hockney ``t0_s`` and ``rate`` per operation kind, plus the host's ``dispatch``
    (n = argument leaves of a call) and ``transfer`` (n = bytes put on the device)."""
    from refdl.perf.ops import OpRate, fit_hockney, parse_hlo

    rates: dict[str, OpRate] = {}
    table: dict[str, dict] = {}
    per_op = op_overhead()
    for kind, programs in _op_programs().items():
        sizes, times = [], []
        for fn, args in programs[-3:]:  # the largest sizes: the rate, not the start-up
            mine = [o for o in parse_hlo(fn.lower(*args).compile().as_text()) if o.kind == kind]
            if mine:
                sizes.append(sum(o.size for o in mine))
                times.append(min(_median_call(fn, args) for _ in range(3)))
        if len(sizes) < 2 or np.polyfit(sizes, times, 1)[0] <= 0:
            continue
        rates[kind] = OpRate(per_op, 1.0 / float(np.polyfit(sizes, times, 1)[0]))
        source = (
            f"refdl.hw calibrate {when}: rate = slope of a lone {kind} program's time over "
            f"{sizes[0]:.3g}..{sizes[-1]:.3g} bytes; t0 = the fixed cost per operation"
        )
        table[kind] = {"t0_s": per_op, "rate": rates[kind].rate, "source": source}
    k1 = REPEATS[0]
    for kind, chains in _chains().items():
        sizes, times = [], []
        for step, x, w in chains:
            first = (
                _median_call(chained(step, REPEATS[1]), (x, w), 10)
                - _median_call(chained(step, k1), (x, w), 10)
            ) / (REPEATS[1] - k1)
            k2 = k1 + int(np.clip(np.ceil(3e-3 / max(first, 1e-6)), 8, 80))
            p1, p2 = chained(step, k1), chained(step, k2)
            mine = [o for o in parse_hlo(p2.lower(x, w).compile().as_text()) if o.kind == kind]
            if len(mine) < k2:
                continue
            slopes = [(_median_call(p2, (x, w), 15) - _median_call(p1, (x, w), 15)) / (k2 - k1)
                      for _ in range(3)]  # fmt: skip
            t = float(np.median(slopes)) * k2 / len(mine)
            if t > 0:
                sizes.append(sum(o.size for o in mine) / len(mine))
                times.append(t)
        if len(sizes) >= 2:
            t0, rate = fit_hockney(sizes, times)
            rates[kind] = OpRate(t0, rate)
            table[kind] = {"t0_s": t0, "rate": rate, "source": (
                f"refdl.hw calibrate {when}: Hockney fit, {len(sizes)} generic chains of "
                f"{kind}s (slope of time against chain length), "
                f"{min(sizes):.3g}..{max(sizes):.3g} FLOP")}  # fmt: skip
    table.update(host_rates(when, rates))
    return table


def host_rates(when: str = "", rates: dict | None = None) -> dict[str, dict]:
    """Host time of a jitted call by argument leaves (``dispatch``: a step that adds 1 to
    each donated argument, less those operations' predicted time; one argument is large
    enough (256 KiB) for its operation to wake XLA's thread pool, as a training step's
    operations do) and of
    ``jax.device_put`` of NumPy arrays by bytes (``transfer``)."""
    import jax

    from refdl.perf.ops import fit_hockney, parse_hlo

    sizes, times = [], []
    for n in LEAVES:
        tree = [np.ones(2**16, np.float32)] + [np.ones(4, np.float32) for _ in range(n - 1)]
        f = jax.jit(lambda t: [x + 1.0 for x in t], donate_argnums=0)
        box = [jax.device_put(tree)]

        def call(f=f, box=box):
            box[0] = f(box[0])
            return box[0]

        t = _median_call(call, (), repeats=60)
        for o in parse_hlo(f.lower(box[0]).compile().as_text()):
            if rates and o.kind in rates:
                t -= rates[o.kind].time(o.size)
        sizes.append(n)
        times.append(t)
    d0, d_rate = fit_hockney(sizes, times)
    put_sizes, put_times = [], []
    dev = jax.devices()[0]
    for n in ELEMENTS:
        batch = {"x": np.ones(n, np.float32), "y": np.ones(max(n // 64, 1), np.int32)}
        put_sizes.append(float(batch["x"].nbytes + batch["y"].nbytes))
        put_times.append(_median_call(lambda b=batch: jax.device_put(b, dev), (), repeats=60) / 2)
    p0, p_rate = fit_hockney(put_sizes, put_times)
    return {
        "dispatch": {"t0_s": d0, "rate": d_rate, "source": f"refdl.hw calibrate {when}: "
                     f"jitted call adding 1 to its donated arguments (one of 256 KiB), "
                     f"{LEAVES[0]}..{LEAVES[-1]} leaves, less the operations; n = leaves"},
        "transfer": {"t0_s": p0, "rate": p_rate, "source": f"refdl.hw calibrate {when}: "
                     "jax.device_put of 2 NumPy arrays, "
                     f"{put_sizes[0]:.3g}..{put_sizes[-1]:.3g} bytes; t0 per array"},
    }  # fmt: skip


# ----------------------------------------------------------------- operations inside a step
#
# An operation inside a training step does not run as it does alone: the step's other
# operations share its caches and its thread pool, the pool sleeps while the host builds
# the next batch, and a product's layout (a weight gradient contracts over the batch)
# changes its speed. JAX's profiler shows it operation by operation: in a step of refdl's
# mlp the products take ~3x their isolated time, and in lenet5's the 5x5 convolutions on
# 8x8 images run at ~2 GFLOP/s. ``in_step`` measures it on generic training steps -
# plain-JAX MLPs and CNNs on a grid of widths, depths, kernels and batches, not refdl's
# models - run the way the training loop runs them (a fresh host batch, ``device_put``,
# the step, wait) and then under the profiler. Each group's factor is its operations'
# in-step time over their isolated time, and the hand-off is the time between operations
# that no operation accounts for (``fit_in_step``; ``refdl.perf.ops.InStep`` applies
# them). Each figure is measured on its own: an earlier whole-step least-squares fit of
# the same four figures traded them off against each other (a hand-off of 6 us where the
# profiler shows ~20 us between operations) and predicted refdl's steps 20-55 % low.

STEP_REPEATS = 30  # plain timed steps of each generic training step
STEP_PROFILED = 20  # and as many under jax.profiler: each operation's time inside the step
# (input, hidden, depth, batch): tanh MLPs
STEP_MLPS = [(256, 128, 1, 32), (256, 512, 2, 128), (1024, 128, 3, 32), (1024, 512, 1, 64),
             (512, 256, 4, 16), (128, 1024, 2, 256), (2048, 64, 2, 128),
             (64, 64, 1, 512)]  # fmt: skip
# (input side, channels, kernel, features, batch, pool): two conv + relu + pool, one dense
STEP_CNNS = [(16, 1, 3, 4, 16, "max"), (16, 3, 3, 16, 32, "avg"), (24, 1, 5, 8, 16, "max"),
             (12, 4, 3, 8, 64, "avg"), (20, 2, 5, 6, 32, "max"), (32, 3, 3, 8, 8, "avg"),
             (8, 8, 3, 32, 128, "max")]  # fmt: skip


@dataclasses.dataclass
class GenericStep:
    """A generic training step: the jitted step, its state, and a host batch maker."""

    label: str
    step: Any
    state: Any
    x_shape: tuple[int, ...]
    classes: int = 10

    def batch(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {
            "x": rng.standard_normal(self.x_shape).astype(np.float32),
            "y": rng.integers(0, self.classes, self.x_shape[0]).astype(np.int32),
        }

    def loop_times(
        self, state: Any, rng: np.random.Generator, steps: int, warmup: int = 3
    ) -> tuple[Any, list[float]]:
        """Run ``warmup + steps`` steps as the training loop does (a fresh host batch,
        ``device_put``, the step, wait); the new (device) state and the timed steps' wall
        times."""
        import jax

        dev = jax.devices()[0]
        times = []
        for i in range(warmup + steps):
            batch = self.batch(rng)
            t0 = time.perf_counter()
            state, loss = self.step(state, jax.device_put(batch, dev))
            jax.block_until_ready((state, loss))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return state, times


def _generic_steps() -> list[GenericStep]:
    """The calibration's generic training steps (``STEP_MLPS``, ``STEP_CNNS``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax

    def train_step(loss):
        opt = optax.sgd(0.01, momentum=0.9)

        def step(state, batch):
            params, opt_state = state
            value, grads = jax.value_and_grad(loss)(params, batch["x"], batch["y"])
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        return opt, jax.jit(step, donate_argnums=0)

    def xent(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    out = []
    key = jax.random.key(0)
    for din, hidden, depth, batch in STEP_MLPS:
        sizes = [din] + [hidden] * depth + [10]
        params = [(jax.random.normal(key, (a, b)) * a**-0.5, jnp.zeros(b))
                  for a, b in itertools.pairwise(sizes)]  # fmt: skip

        def mlp_loss(params, x, y):
            for i, (w, b) in enumerate(params):
                x = x @ w + b
                x = jnp.tanh(x) if i < len(params) - 1 else x
            return xent(x, y)

        opt, step = train_step(mlp_loss)
        out.append(GenericStep(f"mlp {din}-{hidden}x{depth} b{batch}", step,
                               (params, opt.init(params)), (batch, din)))  # fmt: skip
    for side, c, k, f, batch, pool in STEP_CNNS:
        params = [jax.random.normal(key, (k, k, c, f)) * 0.1,
                  jax.random.normal(key, (k, k, f, f)) * 0.05,
                  jax.random.normal(key, ((side // 4) ** 2 * f, 10)) * 0.01]  # fmt: skip

        def cnn_loss(params, x, y, pool=pool):
            def conv(x, w):
                dims = ("NHWC", "HWIO", "NHWC")
                return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)

            def down(x):
                if pool == "max":
                    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                             "VALID")  # fmt: skip
                return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1),
                                         "VALID") / 4  # fmt: skip

            x = down(jax.nn.relu(conv(x, params[0])))
            x = down(jax.nn.relu(conv(x, params[1])))
            return xent(x.reshape(x.shape[0], -1) @ params[2], y)

        opt, step = train_step(cnn_loss)
        out.append(GenericStep(f"cnn {side}x{side}x{c} k{k} f{f} b{batch} {pool}", step,
                               (params, opt.init(params)), (batch, side, side, c)))  # fmt: skip
    return out


@contextlib.contextmanager
def traced_ops(names: set[str]) -> Iterator[dict[str, list[float]]]:
    """Run the block under ``jax.profiler`` (operations only: the Python tracer would slow
    the host) and, on leaving it, fill the yielded dict with the seconds of every event
    named like one of ``names``: XLA:CPU names each operation it executes by its HLO
    instruction, so these are the operations' own times inside whatever the block ran."""
    import jax
    from jax.profiler import ProfileData

    out: dict[str, list[float]] = {}
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, profiler_options=options)
        try:
            yield out
        finally:
            jax.profiler.stop_trace()
        found = sorted(Path(tmp).rglob("*.xplane.pb"))
        if not found:
            raise RuntimeError(f"jax.profiler wrote no trace under {tmp}")
        for plane in ProfileData.from_file(str(found[-1])).planes:
            for line in plane.lines:
                for ev in line.events:
                    if ev.name in names:
                        out.setdefault(ev.name, []).append(ev.duration_ns * 1e-9)


IN_STEP_GROUPS = ("dot", "convolution", "memory")


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One generic training step as the calibration measured it, per group
    (``IN_STEP_GROUPS``): the profiler's in-step time of the operations the trace saw
    (median over the profiled steps) and those operations' isolated prediction; every
    operation's isolated prediction; the operation count; and the device time (median
    wall time of a plain step less the predicted host time)."""

    measured: tuple[float, ...]
    alone: tuple[float, ...]
    alone_all: tuple[float, ...]
    ops: int
    device_s: float

    @property
    def gap_per_op_s(self) -> float:
        """Device time no operation accounts for, per operation (the hand-off)."""
        return (self.device_s - sum(self.measured)) / max(self.ops, 1)


def fit_in_step(samples: list[StepSample]) -> dict[str, float]:
    """``{dot, convolution, memory, handoff_s}`` measured, not fitted: each group's factor
    is its operations' total in-step time over their total isolated time, pooled over the
    steps (a group no step has keeps factor 1), and the hand-off is the median over the
    steps of the gap per operation (at least 0). Each figure comes from its own
    measurement, so they cannot trade off against each other as in a whole-step fit."""
    out = {}
    for j, group in enumerate(IN_STEP_GROUPS):
        alone = sum(s.alone[j] for s in samples)
        out[group] = sum(s.measured[j] for s in samples) / alone if alone > 0 else 1.0
    gaps = [s.gap_per_op_s for s in samples]
    return out | {"handoff_s": max(float(np.median(gaps)), 0.0) if gaps else 0.0}


def in_step_predict(sample: StepSample, fit: dict[str, float]) -> float:
    """A step's device time as ``[device.in_step]`` predicts it: each group's isolated
    time times its factor, plus the hand-off per operation."""
    groups = sum(fit[g] * a for g, a in zip(IN_STEP_GROUPS, sample.alone_all, strict=True))
    return groups + fit["handoff_s"] * sample.ops


def fit_error(samples: list[StepSample]) -> str:
    """Median and largest relative error on each step's device time of ``fit_in_step``
    made without that step (leave-one-out)."""
    err = [
        abs(in_step_predict(s, fit_in_step(samples[:i] + samples[i + 1 :])) / s.device_s - 1)
        for i, s in enumerate(samples)
    ]
    return f"leave-one-out error median {np.median(err):.0%}, max {max(err):.0%}"


def in_step(
    table: dict[str, dict], peak_flops: float, memory_bandwidth: float, when: str = ""
) -> dict[str, Any]:
    """``[device.in_step]`` from the generic training steps: each is timed the training
    loop's way (``STEP_REPEATS`` steps), then profiled (``STEP_PROFILED`` more) so that
    every operation's in-step time can be set beside its isolated prediction from
    ``table`` (``op_rates``); ``fit_in_step`` turns that into the factors and the
    hand-off."""
    import types

    import jax

    from refdl.perf.ops import FLOP_KINDS, OpRate, OpWork, op_time, parse_hlo

    rates = {k: OpRate(v["t0_s"], v["rate"]) for k, v in table.items()}
    hw = types.SimpleNamespace(peak_flops=peak_flops, memory_bandwidth=memory_bandwidth)
    samples = []
    for g in _generic_steps():
        rng = np.random.default_rng(0)
        state = jax.device_put(g.state, jax.devices()[0])
        batch = g.batch(rng)
        ops = parse_hlo(g.step.lower(state, batch).compile().as_text())
        state, walls = g.loop_times(state, rng, STEP_REPEATS)
        with traced_ops({op.name for op in ops}) as durations:
            state, profiled = g.loop_times(state, rng, STEP_PROFILED, warmup=0)
        leaves = len(jax.tree.leaves(state)) + len(batch)
        host = sum(
            rates[k].time(n, c)
            for k, n, c in (("dispatch", leaves, 1),
                            ("transfer", sum(v.nbytes for v in batch.values()), len(batch)))
            if k in rates
        )  # fmt: skip
        device = max(float(np.median(walls)) - host, 1e-6)
        # The profiler slows a step (~10 %): its operation times are scaled by the plain
        # step's device time over the profiled step's, so the gap is not read negative.
        scale = device / max(float(np.median(profiled)) - host, 1e-6)
        measured, alone, alone_all = ([0.0] * len(IN_STEP_GROUPS) for _ in range(3))
        for op in ops:
            j = IN_STEP_GROUPS.index(op.kind if op.kind in FLOP_KINDS else "memory")
            t = op_time(OpWork({op.kind: (1, op.size)}), rates, hw)
            alone_all[j] += t
            if op.name in durations:
                measured[j] += scale * float(np.median(durations[op.name]))
                alone[j] += t
        samples.append(StepSample(tuple(measured), tuple(alone), tuple(alone_all), len(ops),
                                  device))  # fmt: skip
    return fit_in_step(samples) | {"source": (
        f"refdl.hw calibrate {when}: {len(samples)} generic training steps (plain-JAX MLPs "
        "and CNNs) timed as the training loop times a step and profiled with jax.profiler; "
        "per group, the operations' in-step time (scaled by plain / profiled step time) over "
        "their isolated prediction (pooled); "
        "hand-off = median over the steps of (wall - predicted host - operations) per "
        "operation; " + fit_error(samples))}  # fmt: skip


def device_tables(peak_flops: float, memory_bandwidth: float, when: str = "") -> dict[str, Any]:
    """The operation-level part of a profile's ``[device]``: ``ops`` (``op_rates``) and
    ``in_step`` (``in_step``), measured together (about two minutes)."""
    ops = op_rates(when)
    return {"in_step": in_step(ops, peak_flops, memory_bandwidth, when), "ops": ops}
