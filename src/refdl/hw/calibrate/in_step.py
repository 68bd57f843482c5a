"""Operations inside a training step against the same operations alone (``[device.in_step]``).

An operation inside a training step does not run as it does alone: the step's other
operations share its caches and its thread pool, the pool sleeps while the host builds
the next batch, and a product's layout (a weight gradient contracts over the batch)
changes its speed. JAX's profiler shows it operation by operation: in a step of refdl's
mlp the products take ~3x their isolated time, and in lenet5's the 5x5 convolutions on
8x8 images run at ~2 GFLOP/s. ``in_step`` measures it on generic training steps -
plain-JAX MLPs and CNNs on a grid of widths, depths, kernels and batches, not refdl's
models - run the way the training loop runs them (a fresh host batch, ``device_put``,
the step, wait) and then under the profiler. Each group's factor is its operations'
in-step time over their isolated time, and the hand-off is the time between operations
that no operation accounts for (``fit_in_step``; ``refdl.perf.ops.InStep`` applies
them). Each figure is measured on its own: an earlier whole-step least-squares fit of
the same four figures traded them off against each other (a hand-off of 6 us where the
profiler shows ~20 us between operations) and predicted refdl's steps 20-55 % low.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.profiler import ProfileData

from refdl.hw.calibrate.ops import op_rates
from refdl.perf.ops import FLOP_KINDS, OpRate, OpWork, op_time, parse_hlo

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


def generic_steps() -> list[GenericStep]:
    """The calibration's generic training steps (``STEP_MLPS``, ``STEP_CNNS``)."""

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

    rates = {k: OpRate(v["t0_s"], v["rate"]) for k, v in table.items()}
    hw = types.SimpleNamespace(peak_flops=peak_flops, memory_bandwidth=memory_bandwidth)
    samples = []
    for g in generic_steps():
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
