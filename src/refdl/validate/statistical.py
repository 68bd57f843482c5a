"""A framework's own run against refdl's seeds: a test with a known false-alarm rate.

A run that starts from its own weights and draws its own batches cannot match refdl
step by step; it can be held to what refdl does over seeds. refdl reruns the log's
configuration K times (``--seeds``; each seed draws other initial weights, from the
log's declared initialisation, and another data order) and compares **statistics
that do not depend on which batch came when** (``STATISTICS``): the mean loss over the
first quarter, the middle half and the last quarter of the run (on a log scale: a
loss is a positive quantity whose spread grows with it), and the final test accuracy
when the log gives one. Each is read over the steps the log has, for refdl's seeds
too, so a log written every tenth step is compared like with like.

**Rule** (``RULE``): a statistic departs when the framework's value lies outside
the seeds' prediction interval at ``ALPHA / m`` (m statistics; Bonferroni, so the
whole test's false-alarm rate is at most ``ALPHA`` when the framework's statistic
comes from refdl's distribution) **and** by more than ``MARGIN`` (a practical
margin: the framework may differ from refdl in what does not matter - sampler,
split, kernels - and K seeds estimate the spread only roughly). The prediction
interval of one new draw from K normal ones is ``mean +- t(K-1) * sd * sqrt(1 +
1/K)``; loss statistics are tested on both sides, the accuracy only below. A run
passes when no statistic departs and every logged loss is finite. The p-value
reported is the Bonferroni-adjusted smallest one. The rule's measured false-alarm
and detection rates, on healthy and buggy PyTorch and Keras runs it was not tuned
on, come from ``scripts/bench_validate.py`` (``rates.json``, docs/validation.md).

The seeds' smoothed curves also give a descriptive band (mean +- max(3 sd, 5 % of
the mean), trailing mean over a twentieth of the run): where the framework's curve
leaves it is reported and drawn, not judged.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from scipy import stats as sps

from refdl.assemble import load_data
from refdl.config.spec import RunSpec
from refdl.run.build import build
from refdl.run.report import eval_program, evaluate
from refdl.run.trajectory import loss_value, trajectory

ALPHA = 0.05  # the whole test's false-alarm rate when the framework is refdl's twin
# Practical margins: a loss statistic departs only when more than 25 % off refdl's
# geometric mean, the accuracy only when more than 0.02 below refdl's mean.
MARGIN = {"loss": math.log(1.25), "accuracy": 0.02}
# (name, first and last fraction of the run): the loss windows.
WINDOWS = (("loss_early", 0.0, 0.25), ("loss_middle", 0.25, 0.75), ("loss_end", 0.75, 1.0))
STATISTICS = (*(w[0] for w in WINDOWS), "test_accuracy")
RULE = (
    "passed when every logged loss is finite and no statistic departs from refdl's seeds: "
    "the mean loss of the first quarter, the middle half and the last quarter (log scale, "
    "two-sided) and the final test accuracy when logged (one-sided, below) each lie outside "
    "the seeds' t prediction interval at alpha 0.05 / (number of statistics) only if also "
    "more than 25 % (loss) or 0.02 (accuracy) away from refdl's mean"
)


def rule_fingerprint() -> str:
    """A short hash of what decides (alpha, margins, windows, statistics): measured error
    rates belong to one rule, and a test checks that ``rates.json`` is this rule's."""
    text = json.dumps([ALPHA, MARGIN, WINDOWS, STATISTICS], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclasses.dataclass
class Seeds:
    """refdl's runs of one configuration over seeds: losses ``[K, steps]``, final test
    accuracy per seed, and the median samples/s of the runs here."""

    losses: np.ndarray
    accuracy: list[float]
    samples_per_s: float


@functools.cache
def _source_hash() -> str:
    """A hash of refdl's own source: cached seeds are rerun when the code changes."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def _cache_key(spec: RunSpec, seeds: int, resplit: bool) -> str:
    """The cache file's name: the spec as run (seed included), the seeds, the code."""
    text = json.dumps(
        [dataclasses.asdict(spec), seeds, resplit, _source_hash(), jax.__version__],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def seed_runs(spec: RunSpec, seeds: int, cache: Path | None = None, resplit: bool = False) -> Seeds:
    """``spec`` run with seeds ``spec.seed .. spec.seed + seeds - 1`` (initialisation and
    data order both follow the seed; with ``resplit``, the data set's train/test split
    too: seed s takes ``--data-opt split=s+1``). The run is built and compiled once; each
    seed is a new initial state, data order (and split) on the same programs. With
    ``cache`` (a folder), the result is kept there as ``seeds-KEY.npz`` and read back for
    the same spec, count and code."""
    path = cache / f"seeds-{_cache_key(spec, seeds, resplit)}.npz" if cache else None
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as f:
                losses, acc, sps_ = f["losses"], f["accuracy"], float(f["samples_per_s"])
            if losses.shape == (seeds, spec.steps) and acc.shape == (seeds,):
                return Seeds(losses.astype(np.float64), [float(a) for a in acc], sps_)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is recomputed
    first = build(spec)
    eval_fn = eval_program(first)
    losses, accuracy, times = [], [], []
    for k in range(seeds):
        run = dataclasses.replace(first, spec=dataclasses.replace(first.spec, seed=spec.seed + k))
        if resplit:
            opts = (
                *(o for o in run.spec.data_opts if o[0] != "split"),
                ("split", str(spec.seed + k + 1)),
            )
            run.spec = dataclasses.replace(run.spec, data_opts=opts)
            run.dataset = load_data(run.spec)
        state = run.strategy.init_state(run.spec.seed)
        curve = []
        for step in trajectory(run, state, 0, run.spec.steps, per_step=True):
            state = step.state
            curve.append(loss_value(step.metrics))
            if step.done > 1:
                times.append(step.seconds)
        losses.append(curve)
        host = jax.device_get(run.strategy.gather_state(state))
        accuracy.append(evaluate(run, host, eval_fn)["test_accuracy"])
    rate = spec.batch_size / float(np.median(times)) if times else float("nan")
    out = Seeds(np.asarray(losses, np.float64), accuracy, rate)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, losses=out.losses, accuracy=np.asarray(accuracy), samples_per_s=rate)
        tmp.replace(path)
    return out


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (fewer at the start)."""
    c = np.cumsum(np.insert(np.asarray(values, np.float64), 0, 0.0))
    n = np.arange(1, len(values) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def window_steps(logged: list[int], steps: int) -> dict[str, list[int]]:
    """The logged steps of each loss window (``WINDOWS``) of a ``steps``-step run."""
    return {name: [t for t in logged if a * steps <= t < b * steps] for name, a, b in WINDOWS}


def judge(name: str, value: float | None, reference: np.ndarray, m: int) -> dict:
    """One statistic against the seeds' values: prediction-interval t test at ALPHA / m
    (two-sided for losses on a log scale, one-sided below for the accuracy) and the
    practical margin; ``departs`` when both say so."""
    k = len(reference)
    loss = name.startswith("loss")
    ref = np.log(reference) if loss else np.asarray(reference, np.float64)
    mean, sd = float(ref.mean()), float(ref.std(ddof=1))
    crit = float(sps.t.ppf(1 - ALPHA / m / (2 if loss else 1), k - 1)) * sd * math.sqrt(1 + 1 / k)
    out: dict[str, Any] = {
        "name": name,
        "value": value,
        "refdl_mean": float(np.exp(mean)) if loss else mean,
        "refdl_min": float(np.min(reference)),
        "refdl_max": float(np.max(reference)),
        "scale": "log" if loss else "linear",
        "refdl_sd": sd,
        "interval": [float(np.exp(mean - crit)), float(np.exp(mean + crit))]
        if loss
        else [mean - crit, 1.0],
        "margin": MARGIN["loss" if loss else "accuracy"],
    }
    if value is None:
        return {**out, "p_value": None, "departs": False, "logged": False}
    x = math.log(value) if loss and value > 0 else (-math.inf if loss else value)
    scale = sd * math.sqrt(1 + 1 / k)
    if scale > 0:
        t = (x - mean) / scale
        p = float(2 * sps.t.sf(abs(t), k - 1)) if loss else float(sps.t.cdf(t, k - 1))
    else:
        p = 1.0 if x == mean else 0.0
    effect = (x - mean) if loss else (value - mean)
    beyond = abs(effect) > out["margin"] if loss else -effect > out["margin"]
    departs = bool(p < ALPHA / m and beyond)
    return {**out, "p_value": p, "effect": effect, "departs": departs, "logged": True}


def compare(
    framework: dict[int, float], final_accuracy: float | None, seeds: Seeds
) -> dict[str, Any]:
    """The framework's logged losses (``step -> loss``, steps counted from 0) and final test
    accuracy against ``seeds``: the module docstring's statistics, rule and band."""
    k, steps = seeds.losses.shape
    logged = sorted(t for t in framework if 0 <= t < steps)
    values = np.asarray([framework[t] for t in logged], np.float64)
    finite = bool(np.all(np.isfinite(values))) and bool(logged)
    per_window = window_steps(logged, steps)
    m = sum(1 for ts in per_window.values() if ts) + (final_accuracy is not None)
    tested = []
    for name, ts in per_window.items():
        if not ts:
            tested.append({"name": name, "logged": False, "departs": False, "p_value": None})
            continue
        value = float(np.mean([framework[t] for t in ts])) if finite else None
        tested.append(judge(name, value, seeds.losses[:, ts].mean(1), max(m, 1)))
    acc = np.asarray(seeds.accuracy, np.float64)
    tested.append(judge("test_accuracy", final_accuracy, acc, max(m, 1)))
    ps = [s["p_value"] for s in tested if s.get("p_value") is not None]
    p_value = min(1.0, m * min(ps)) if ps else None
    missing_end = not per_window["loss_end"]
    failed = (
        ([] if finite else ["finite"])
        + (["loss_end_logged"] if missing_end else [])
        + [s["name"] for s in tested if s["departs"]]
    )
    out = {
        "seeds": k,
        "statistics": tested,
        "statistics_compared": m,
        "alpha": ALPHA,
        "p_value": p_value,
        "rule": RULE,
        "rule_fingerprint": rule_fingerprint(),
        "failed": failed,
        "passed": not failed,
        "finite": finite,
        "steps_compared": len(logged),
        "final_test_accuracy": {
            "framework": final_accuracy,
            "refdl_mean": float(acc.mean()),
            "refdl_min": float(acc.min()),
            "refdl_max": float(acc.max()),
            "refdl_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
        },
    }
    out.update(describe(framework, logged, seeds))
    return out


def describe(framework: dict[int, float], logged: list[int], seeds: Seeds) -> dict[str, Any]:
    """The descriptive band of the smoothed curves: where the framework's curve leaves it
    (first step, which side, by how much; the step from which it stays out) and the steps
    it takes to reach the loss refdl's mean curve reaches halfway. Reported, not judged."""
    k, steps = seeds.losses.shape
    window = max(1, steps // 20)
    curves = np.stack([smooth(c, window) for c in seeds.losses])
    mean, std = curves.mean(0), curves.std(0, ddof=1) if k > 1 else np.zeros(steps)
    half = np.maximum(3 * std, 0.05 * np.abs(mean))
    lo, hi = mean - half, mean + half
    theirs = np.asarray(
        [np.mean([framework[u] for u in logged if t - window < u <= t]) for t in logged]
    )
    outside = [(t, v) for t, v in zip(logged, theirs, strict=True) if not lo[t] <= v <= hi[t]]
    first = None
    if outside:
        t, v = outside[0]
        edge = hi[t] if v > hi[t] else lo[t]
        first = {
            "step": t,
            "loss": float(v),
            "band": [float(lo[t]), float(hi[t])],
            "beyond": float((v - edge) / max(abs(edge), 1e-12)),
            "side": "above" if v > hi[t] else "below",
        }
    out_steps = {t for t, _ in outside}
    for_good = next((t for t in logged if all(u in out_steps for u in logged if u >= t)), None)
    target = float(mean[steps // 2])
    reach = next((t for t, v in zip(logged, theirs, strict=True) if v <= target), None)
    return {
        "smoothing_window_steps": window,
        "band_rule": "mean +- max(3 std, 5 % of the mean) of the seeds' smoothed losses",
        "steps_outside_band": len(outside),
        "first_departure": first,
        "outside_from_step": for_good,
        "final_loss": {
            "framework": float(theirs[-1]) if len(theirs) else None,
            "refdl_mean": float(mean[-1]),
            "band": [float(lo[-1]), float(hi[-1])],
        },
        "time_to_target": {
            "target_loss": target,
            "framework_step": reach,
            "refdl_step": int(np.argmax(mean <= target)),
        },
        "band_rows": [
            {
                "step": t,
                "framework": float(v),
                "lo": float(lo[t]),
                "hi": float(hi[t]),
                "mean": float(mean[t]),
            }
            for t, v in zip(logged, theirs, strict=True)
        ],
    }
