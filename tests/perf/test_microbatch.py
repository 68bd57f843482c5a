"""μ-cuDNN's micro-batch selection (``refdl.perf.microbatch``) and its execution
(``core.conv.ConvPlan``): the dynamic program against exhaustive search, the shared-limit
integer program against brute force on 300 random instances (it is exact: no misses),
a convolution run in micro-batches equal to the undivided one (rtol 1e-5, gradients
too), and ``refdl bench microbatch`` end to end on a small model.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT
from refdl.core.conv import ConvPlan, conv2d, conv_plan
from refdl.errors import UsageError
from refdl.perf import microbatch as mb


def splits_of(n: int, choices: list) -> list[list]:
    """Every multiset of choices whose sizes sum to ``n`` (exhaustive, for small n)."""
    if n == 0:
        return [[]]
    out = []
    for i, c in enumerate(choices):
        if c[1] <= n:
            out += [[c, *rest] for rest in splits_of(n - c[1], choices[i:])]
    return out


def test_the_dynamic_program_finds_the_fastest_split_under_the_limit():
    rng = np.random.default_rng(0)
    for _ in range(50):
        batch = int(rng.integers(1, 13))
        sizes = mb.sizes(batch, "all")
        times = {(i, b): float(rng.uniform(0.2, 1.0) * b ** rng.uniform(0.5, 1.2))
                 for i in ("xla", "im2col") for b in sizes}  # fmt: skip
        work = {(i, b): (0 if i == "xla" else 10 * b) for i, b in times}
        limit = float(rng.integers(0, 10 * batch + 1))
        t, split = mb.best_split(batch, times, work, limit)
        allowed = [c for c in times if work[c] <= limit]
        brute = min(sum(times[c] for c in s) for s in splits_of(batch, allowed))
        assert t == pytest.approx(brute) and sum(b for _, b in split) == batch
        assert all(work[c] <= limit for c in split)
    assert mb.sizes(12, "powers") == [1, 2, 4, 8, 12]
    with pytest.raises(UsageError, match="no micro-batch fits"):
        mb.best_split(4, {("im2col", 4): 1.0}, {("im2col", 4): 40}, 10)


def test_the_shared_limit_program_is_exact_on_random_instances():
    """300 instances of 2-4 layers with 1-4 candidates each: the integer program's total
    equals the brute-force optimum every time (0 misses), and refuses what cannot fit."""
    rng = np.random.default_rng(1)
    misses = 0
    for _ in range(300):
        shape = [int(rng.integers(1, 5)) for _ in range(int(rng.integers(2, 5)))]
        layers = [[(float(rng.uniform(1, 10)), int(rng.integers(0, 50)), []) for _ in range(n)]
                  for n in shape]  # fmt: skip
        limit = float(rng.integers(0, 120))
        feasible = [
            sum(layers[i][j][0] for i, j in enumerate(pick))
            for pick in itertools.product(*(range(len(c)) for c in layers))
            if sum(layers[i][j][1] for i, j in enumerate(pick)) <= limit
        ]
        if not feasible:
            with pytest.raises(UsageError, match="do not fit"):
                mb.shared_limit(layers, limit)
            continue
        chosen = mb.shared_limit(layers, limit)
        got = sum(layers[i][j][0] for i, j in enumerate(chosen))
        assert sum(layers[i][j][1] for i, j in enumerate(chosen)) <= limit
        misses += not math.isclose(got, min(feasible), rel_tol=1e-9)
    assert misses == 0


def test_candidates_form_a_pareto_front():
    times = {("xla", 4): 4.0, ("im2col", 4): 2.0, ("im2col", 2): 1.5, ("xla", 2): 2.5}
    work = {c: (0 if c[0] == "xla" else 100 * c[1]) for c in times}
    front = mb.candidates(4, times, work)
    assert [(t, w) for t, w, _ in front] == [(4.0, 0), (3.0, 200), (2.0, 400)]


@pytest.mark.slow  # slow since 2026-11-26 (the default suite's 15 min)
def test_a_convolution_in_micro_batches_equals_the_undivided_one():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 6, 6, 3)).astype(np.float32)
    k = rng.normal(size=(3, 3, 3, 5)).astype(np.float32)

    def loss(x, k, plan):
        with conv_plan(plan):
            return (conv2d(x, k, (1, 1), "SAME") ** 2).sum()

    whole = jax.value_and_grad(loss, argnums=(0, 1))(x, k, ConvPlan())
    plan = ConvPlan([[("im2col", 3), ("xla", 4), ("im2col", 1)]])
    split = jax.value_and_grad(loss, argnums=(0, 1))(x, k, plan)
    assert plan.calls == [((8, 6, 6, 3), (3, 3, 3, 5), (1, 1), "SAME")]
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert mb.workspace_bytes(plan.calls[0], "im2col", 3) == 4 * 3 * 36 * 27
    assert mb.workspace_bytes(plan.calls[0], "xla", 8) == 0


@pytest.mark.slow  # the default suite's time (15 min on 2 cores; 19 min 23 s measured 2026-11-26)
def test_bench_microbatch_runs_and_keeps_the_gradients(tmp_path):
    out = tmp_path / "mb.json"
    cmd = [sys.executable, "-m", "refdl", "bench", "microbatch", "--model", "lenet5",
           "--batch-size", "4", "--memory-limit", "8KiB", "--mode", "shared", "--repeats", "1",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["gradients_equal_rtol_1e-5"] and len(r["layers"]) == 2
    assert r["gradients_precision"] == "highest" and r["gradients_max_relative_difference"] < 1e-5
    assert 0 <= r["gradients_max_relative_difference_default_precision"] < 1e-5  # a CPU: fp32
    assert r["workspace_bytes_total"] <= 8 * 1024
    assert all(sum(b for _, b in x["split"]) == 4 for x in r["layers"])
    assert "predicted" in proc.stdout and r["step_predicted_s"] > 0
    bad = subprocess.run([*cmd[:5], "--mode", "both"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "choose layer or shared" in bad.stderr


def test_the_predicted_step_never_goes_below_zero():
    from refdl.bench.microbatch import predicted_step

    assert predicted_step(10.0, 4.0, 3.0) == pytest.approx(9.0)  # 6 of the rest + 3
    assert predicted_step(1.0, 4.0, 2.0) == pytest.approx(0.5)  # all conv: scaled by 2/4
