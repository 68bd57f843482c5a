"""Per operation kind, Hockney's start-up time and asymptotic rate on this machine
(``[device.ops.<kind>]``), and the host's dispatch and transfer rates.

Each kind of operation XLA executes (``refdl.perf.ops``) is timed at a handful of
generic sizes - a grid, not the shapes of any model - and Hockney's
``t = t0 + n / r_inf`` is fitted to it (``refdl.perf.ops.fit_hockney``). Products
(dot, convolution) are timed as they run inside a step: a program chains K dependent
copies (``x = x @ w``, ``x = conv(x, w)`` and their transposes), and one copy's cost is
the slope of the program's time between K = 2 and a K long enough to last milliseconds,
the call's dispatch excluded. Other kinds fuse with their neighbours when chained
(XLA:CPU drops optimization barriers before fusing), so each is timed alone at large
sizes, where its rate is the slope of time against bytes (dispatch and start-up cancel),
and its start-up ``t0`` is the fixed cost per executed operation (``op_overhead``: the
slope of a chain of tiny unfusable operations).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from refdl.hw.calibrate.device import op_overhead
from refdl.hw.calibrate.timing import median_call
from refdl.perf.ops import OpRate, fit_hockney, parse_hlo

DOT_SHAPES = [(32, 32), (64, 64), (128, 128), (256, 256), (512, 512), (256, 32), (32, 256),
              (1024, 64)]  # fmt: skip  # (rows, features): x (rows, f) @ w (f, f)
CONV_SHAPES = [  # (batch, height = width, features, kernel)
    (32, 12, 2, 3), (32, 12, 16, 3), (32, 12, 32, 3), (32, 12, 2, 5), (32, 12, 16, 5),
    (8, 24, 4, 5), (64, 6, 8, 5), (16, 16, 8, 3),
]  # fmt: skip
ELEMENTS = [2**k for k in range(8, 21, 2)]  # 256 .. 1 M float32 elements
LEAVES = [1, 4, 16, 64]
REPEATS = (2, 10)


def chained(step, k: int):
    """A jitted program ``x -> step(step(...step(x, w)..., w), w)`` (k dependent copies)."""

    def prog(x, w):
        for _ in range(k):
            x = step(x, w)
        return x

    return jax.jit(prog)


def _chains() -> dict[str, list[tuple]]:
    """Per product kind, ``(step, x, w)`` with ``step(x, w)`` shaped like ``x``."""

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
    rates: dict[str, OpRate] = {}
    table: dict[str, dict] = {}
    per_op = op_overhead()
    for kind, programs in _op_programs().items():
        sizes, times = [], []
        for fn, args in programs[-3:]:  # the largest sizes: the rate, not the start-up
            mine = [o for o in parse_hlo(fn.lower(*args).compile().as_text()) if o.kind == kind]
            if mine:
                sizes.append(sum(o.size for o in mine))
                times.append(min(median_call(fn, args) for _ in range(3)))
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
                median_call(chained(step, REPEATS[1]), (x, w), 10)
                - median_call(chained(step, k1), (x, w), 10)
            ) / (REPEATS[1] - k1)
            k2 = k1 + int(np.clip(np.ceil(3e-3 / max(first, 1e-6)), 8, 80))
            p1, p2 = chained(step, k1), chained(step, k2)
            mine = [o for o in parse_hlo(p2.lower(x, w).compile().as_text()) if o.kind == kind]
            if len(mine) < k2:
                continue
            slopes = [(median_call(p2, (x, w), 15) - median_call(p1, (x, w), 15)) / (k2 - k1)
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

    sizes, times = [], []
    for n in LEAVES:
        tree = [np.ones(2**16, np.float32)] + [np.ones(4, np.float32) for _ in range(n - 1)]
        f = jax.jit(lambda t: [x + 1.0 for x in t], donate_argnums=0)
        box = [jax.device_put(tree)]

        def call(f=f, box=box):
            box[0] = f(box[0])
            return box[0]

        t = median_call(call, (), repeats=60)
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
        put_times.append(median_call(lambda b=batch: jax.device_put(b, dev), (), repeats=60) / 2)
    p0, p_rate = fit_hockney(put_sizes, put_times)
    return {
        "dispatch": {"t0_s": d0, "rate": d_rate, "source": f"refdl.hw calibrate {when}: "
                     f"jitted call adding 1 to its donated arguments (one of 256 KiB), "
                     f"{LEAVES[0]}..{LEAVES[-1]} leaves, less the operations; n = leaves"},
        "transfer": {"t0_s": p0, "rate": p_rate, "source": f"refdl.hw calibrate {when}: "
                     "jax.device_put of 2 NumPy arrays, "
                     f"{put_sizes[0]:.3g}..{put_sizes[-1]:.3g} bytes; t0 per array"},
    }  # fmt: skip
