"""A framework's own run against refdl's seeds: a band instead of one trajectory.

A run that starts from its own weights and draws its own batches cannot match
refdl step by step; it can be held to what refdl does over seeds. refdl reruns
the log's configuration K times (``--seeds``, default 5; each seed draws other
initial weights, from the log's declared initialisation, and another data
order) and forms, per step, a **band** for the smoothed loss - the seeds'
mean +- max(3 standard deviations, 5 % of the mean), each curve smoothed by a
trailing mean over ``window`` steps (a twentieth of the run) - and the
distribution of their final test accuracy.

The report says where the framework's smoothed loss leaves the band (first
step, by how much, and the step from which it stays out), where its final
accuracy falls in refdl's distribution, and how many steps it takes to reach
the loss refdl's mean curve reaches halfway (refdl: half the run). **Rule**
(``RULE``): passed when every logged loss is finite, the smoothed loss is
inside the band at every logged step of the last quarter of the run, and the
final test accuracy, when the log gives one, is at least refdl's lowest minus
max(3 standard deviations, 0.02). Departures earlier in the run are reported,
not failed: a different initial draw or data order moves the early curve.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from refdl.config.spec import RunSpec
from refdl.run.build import build
from refdl.run.report import evaluate
from refdl.run.trajectory import loss_value, trajectory

RULE = (
    "passed when every logged loss is finite, the smoothed loss is inside refdl's seed band "
    "at every logged step of the last quarter of the run, and the final test accuracy (when "
    "logged) is at least refdl's lowest minus max(3 standard deviations, 0.02)"
)


@dataclasses.dataclass
class Seeds:
    """refdl's runs of one configuration over seeds: losses ``[K, steps]``, final test
    accuracy per seed, and the median samples/s of the runs here."""

    losses: np.ndarray
    accuracy: list[float]
    samples_per_s: float


def seed_runs(spec: RunSpec, seeds: int) -> Seeds:
    """``spec`` run with seeds ``spec.seed .. spec.seed + seeds - 1`` (initialisation and
    data order both follow the seed)."""
    losses, accuracy, times = [], [], []
    for k in range(seeds):
        run = build(dataclasses.replace(spec, seed=spec.seed + k))
        state = run.strategy.init_state(run.spec.seed)
        curve = []
        for step in trajectory(run, state, 0, run.spec.steps, per_step=True):
            state = step.state
            curve.append(loss_value(step.metrics))
            if step.done > 1:
                times.append(step.seconds)
        losses.append(curve)
        host = jax.device_get(run.strategy.gather_state(state))
        accuracy.append(evaluate(run, host)["test_accuracy"])
    sps = spec.batch_size / float(np.median(times)) if times else float("nan")
    return Seeds(np.asarray(losses, np.float64), accuracy, sps)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (fewer at the start)."""
    c = np.cumsum(np.insert(np.asarray(values, np.float64), 0, 0.0))
    n = np.arange(1, len(values) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def compare(
    framework: dict[int, float], final_accuracy: float | None, seeds: Seeds
) -> dict[str, Any]:
    """The framework's logged losses (``step -> loss``, steps counted from 0) and final test
    accuracy against ``seeds``; the module docstring's band, departures and rule."""
    k, steps = seeds.losses.shape
    window = max(1, steps // 20)
    curves = np.stack([smooth(c, window) for c in seeds.losses])
    mean, std = curves.mean(0), curves.std(0, ddof=1) if k > 1 else np.zeros(steps)
    half = np.maximum(3 * std, 0.05 * np.abs(mean))
    lo, hi = mean - half, mean + half
    logged = sorted(t for t in framework if 0 <= t < steps)
    values = np.asarray([framework[t] for t in logged], np.float64)
    finite = bool(np.all(np.isfinite(values)))
    # the framework's curve smoothed over the same window of steps (its logged rows in it)
    theirs = np.asarray([np.mean([framework[u] for u in logged if t - window < u <= t])
                         for t in logged])  # fmt: skip
    outside = [(t, v) for t, v in zip(logged, theirs, strict=True)
               if not (lo[t] <= v <= hi[t])]  # fmt: skip
    first = None
    if outside:
        t, v = outside[0]
        edge = hi[t] if v > hi[t] else lo[t]
        first = {"step": t, "loss": float(v), "band": [float(lo[t]), float(hi[t])],
                 "beyond": float((v - edge) / max(abs(edge), 1e-12)),
                 "side": "above" if v > hi[t] else "below"}  # fmt: skip
    out_steps = {t for t, _ in outside}
    for_good = next((t for t in logged if all(u in out_steps for u in logged if u >= t)), None)
    tail = [t for t in logged if t >= steps - steps // 4 - 1]
    tail_inside = all(t not in out_steps for t in tail) and bool(tail)
    acc = np.asarray(seeds.accuracy)
    acc_floor = float(acc.min() - max(3 * acc.std(ddof=1) if len(acc) > 1 else 0.0, 0.02))
    acc_ok = final_accuracy is None or final_accuracy >= acc_floor
    target = float(mean[steps // 2])
    reach = next((t for t, v in zip(logged, theirs, strict=True) if v <= target), None)
    refdl_reach = int(np.argmax(mean <= target))
    failed = ([] if finite else ["finite"]) + ([] if tail_inside else ["end_in_band"]) + (
        [] if acc_ok else ["final_accuracy"])  # fmt: skip
    return {
        "seeds": k,
        "smoothing_window_steps": window,
        "band_rule": "mean +- max(3 std, 5 % of the mean) of the seeds' smoothed losses",
        "steps_compared": len(logged),
        "steps_outside_band": len(outside),
        "first_departure": first,
        "outside_from_step": for_good,
        "end_in_band": tail_inside,
        "final_loss": {
            "framework": float(theirs[-1]) if len(theirs) else None,
            "refdl_mean": float(mean[-1]),
            "band": [float(lo[-1]), float(hi[-1])],
        },
        "final_test_accuracy": {
            "framework": final_accuracy,
            "refdl_mean": float(acc.mean()),
            "refdl_min": float(acc.min()),
            "refdl_max": float(acc.max()),
            "refdl_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
            "floor": acc_floor,
            "z": (
                float((final_accuracy - acc.mean()) / acc.std(ddof=1))
                if final_accuracy is not None and len(acc) > 1 and acc.std(ddof=1) > 0
                else None
            ),
        },
        "time_to_target": {
            "target_loss": target,
            "framework_step": reach,
            "refdl_step": refdl_reach,
            "ratio": (reach / refdl_reach) if reach is not None and refdl_reach else None,
        },
        "band_rows": [
            {"step": t, "framework": float(v), "lo": float(lo[t]), "hi": float(hi[t])}
            for t, v in zip(logged, theirs, strict=True)
        ],
        "rule": RULE,
        "failed": failed,
        "passed": not failed,
        "finite": finite and all(math.isfinite(v) for v in values),
    }
