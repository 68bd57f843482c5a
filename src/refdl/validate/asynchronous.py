"""Asynchronous parameter servers compared by outcome, not step by step.

An asynchronous run has no single trajectory to match: which worker's gradient
lands when depends on the machine. ``--strategy ps --ps-mode async`` therefore
compares what such a run promises (``refdl.validate --framework tensorflow|mxnet``):

- **accuracy band**: the framework's final parameters, evaluated by refdl on the
  test set, against refdl's own asynchronous run (``ps --ps-mode async`` in the
  in-process simulator, same workers, steps, batches, initial weights) and the
  synchronous reference. Rule: passed when the framework's test accuracy is at
  least ``min(refdl async, refdl sync) - BAND`` and its last losses are finite;
- **throughput**: samples per second of the framework's run (wall time of all
  updates) beside refdl's synchronous step here;
- **staleness**: per update, how many other workers' updates were applied between
  its read and its own (from timestamps the framework's processes recorded,
  ``refdl.adapters.exchange.staleness``), beside the simulator's histogram.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from typing import Any

import jax
import numpy as np

from refdl.adapters import process
from refdl.adapters.exchange import staleness
from refdl.config.spec import RunSpec
from refdl.progress import phase
from refdl.run.build import build
from refdl.run.loop import fit
from refdl.run.report import evaluate
from refdl.validate.exact import (
    ValidationFailed,
    check_coverage,
    job_of,
    perturbed,
    reference_run,
)
from refdl.validate.request import Request

BAND = 0.05  # absolute test accuracy below refdl's that an asynchronous run may land


def unflatten(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    """``{"00_dense/kernel": a}`` -> ``{"00_dense": {"kernel": a}}`` (the inverse of
    ``refdl.adapters.torch.flatten``)."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = np.asarray(value)
    return tree


def accuracy_of(spec: RunSpec, flat: dict[str, np.ndarray]) -> dict[str, float]:
    """refdl's evaluation (test loss, accuracy) of parameters given in refdl's flat layout."""
    run = build(spec)
    state = jax.device_get(run.task.init_state(spec.seed))
    return evaluate(run, state.replace(params=unflatten(flat)))


def histogram(values: list[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}


def validate_async(args: Request) -> dict[str, Any]:
    """The framework's asynchronous parameter server against refdl's, by outcome."""
    check_coverage(args)
    fw, w = args.framework, args.workers or 2
    common = dict(model=args.model, steps=args.steps, batch_size=args.batch_size,
                  seed=args.seed, progress=False)  # fmt: skip
    for name in ("optimizer", "lr", "dataset"):
        if getattr(args, name) is not None:
            common[name] = getattr(args, name)
    spec = RunSpec(strategy="single", **common)  # refused settings: before any phase line
    ref = reference_run(spec, plain_layers=True, announce="refdl.validate: refdl's reference "
                        f"run of {args.model}, {args.steps} steps")  # fmt: skip
    if len(set(ref.lrs)) > 1 and fw == "tensorflow":
        raise ValidationFailed("TensorFlow's parameter-server run takes one learning rate; "
                               "this configuration's schedule changes it")  # fmt: skip
    try:
        phase(f"refdl.validate: {fw}'s asynchronous parameter-server run ({w} workers, its "
              "own processes)")  # fmt: skip
        result, params, _ = process.run(fw, job_of(ref, "ps", 1, w, "async"),
                                        perturbed(ref.init_params, args.perturb),
                                        ref.batches, args.timeout)  # fmt: skip
    except process.FrameworkFailed as e:
        raise ValidationFailed(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="refdl-async-") as out:
        mine = fit(RunSpec(strategy="ps", ps_mode="async", simulate=True, workers=w, out=out,
                           eval_every=0, checkpoint_every=0, **common))  # fmt: skip
    spec = RunSpec(strategy="single", **common)
    theirs = accuracy_of(spec, params)
    sync = accuracy_of(spec, ref.params)
    floor = min(mine["test_accuracy"], sync["test_accuracy"]) - BAND
    tail = result["update_losses"][-w:]
    finite = all(math.isfinite(v) for v in tail)
    passed = finite and theirs["test_accuracy"] >= floor
    samples = args.steps * args.batch_size
    stale = staleness([tuple(u) for u in result["updates"]])
    sync_sps = args.batch_size / float(np.median(ref.step_times[1:] or ref.step_times))
    return {
        "framework": fw,
        "framework_impl": result["impl"],
        "comparison": "accuracy band (asynchronous)",
        "strategy": "ps",
        "ps_mode": "async",
        "model": args.model,
        "workers": w,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "updates": len(result["updates"]),
        "test_accuracy": {
            "framework": theirs["test_accuracy"],
            "refdl_async": mine["test_accuracy"],
            "refdl_sync": sync["test_accuracy"],
        },
        "test_loss": {
            "framework": theirs["test_loss"],
            "refdl_async": mine["test_loss"],
            "refdl_sync": sync["test_loss"],
        },
        "accuracy_floor": floor,
        "band": BAND,
        "rule": f"passed when the framework's test accuracy >= min(refdl async, refdl sync) - "
        f"{BAND} and its last {w} update losses are finite",
        "samples_per_s": {"framework": samples / result["wall_s"], "refdl_sync_here": sync_sps},
        "wall_s": result["wall_s"],
        "staleness_histogram": {
            "framework": histogram(stale),
            "refdl_async_simulated": mine.get(
                "staleness_updates_histogram", mine.get("staleness_histogram")
            ),
        },
        "staleness_mean": float(np.mean(stale)) if stale else 0.0,
        "passed": bool(passed),
        "failed": [] if passed else (["finite"] if not finite else ["accuracy_band"]),
    }


def print_async(r: dict[str, Any]) -> None:
    """The asynchronous comparison as a few readable lines."""
    acc, sps = r["test_accuracy"], r["samples_per_s"]
    print(f"refdl vs {r['framework']} ({r['framework_impl']}): ps async {r['model']}, "
          f"{r['workers']} workers, {r['steps']} steps ({r['updates']} updates)")  # fmt: skip
    print(f"test accuracy: {r['framework']} {acc['framework']:.4f}; refdl async "
          f"{acc['refdl_async']:.4f}, sync {acc['refdl_sync']:.4f} (floor "
          f"{r['accuracy_floor']:.4f})")  # fmt: skip
    print(f"samples/s: {r['framework']} {sps['framework']:.4g} (wall {r['wall_s']:.2f} s); "
          f"refdl single here {sps['refdl_sync_here']:.4g}")  # fmt: skip
    print(f"staleness (updates): {r['framework']} {r['staleness_histogram']['framework']} "
          f"(mean {r['staleness_mean']:.2f}); refdl simulated "
          f"{r['staleness_histogram']['refdl_async_simulated']}")  # fmt: skip
    print(("PASSED: " if r["passed"] else "FAILED: ") + r["rule"])
