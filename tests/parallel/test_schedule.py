"""Pipeline schedule tables: dependencies, the closed-form bubble, activation stash."""

from __future__ import annotations

import pytest

from refdl.errors import UsageError
from refdl.parallel.schedule import analytic_bubble, build

GRID = [(p, m) for p in range(1, 9) for m in range(1, 33)]


def _check_dependencies(s):
    """Re-derive the data dependencies from the table alone."""
    p, last = s.stages, s.stages * s.chunks - 1
    when = {}
    for t, stage, op in s.ops():
        key = (op.kind, op.mb, op.chunk * p + stage)
        assert key not in when, f"{key} runs twice"
        when[key] = t
    for (kind, mb, k), t in when.items():
        if kind == "F" and k > 0:
            assert when[("F", mb, k - 1)] < t
        if kind == "B":
            assert when[("F", mb, k)] < t  # every forward precedes its backward
            if k < last:
                assert when[("B", mb, k + 1)] < t
    assert len(when) == 2 * s.microbatches * s.stages * s.chunks  # every op exactly once


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_tables(kind):
    for p, m in GRID:
        s = build(kind, p, m)
        _check_dependencies(s)
        assert s.slots == 2 * (m + p - 1)
        assert s.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert s.bubble_fraction == pytest.approx(analytic_bubble(kind, p, m), abs=1e-12)
        stash = [s.peak_stash(r) for r in range(p)]
        if kind == "gpipe":
            assert stash == [m] * p
        else:  # 1F1B: stage r stashes at most p - r (and never more than m)
            assert stash == [min(p - r, m) for r in range(p)]
        assert s.p2p_messages() == 2 * m * (p - 1)


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_tables_divide_the_bubble_by_v(v):
    for p, m in GRID:
        if m % p or p == 1:
            continue
        s = build("interleaved", p, m, v)
        _check_dependencies(s)
        assert s.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        assert s.bubble_fraction < build("1f1b", p, m).bubble_fraction
        assert s.p2p_messages() == 2 * m * (p * v - 1)  # v x more point-to-point traffic


def test_bad_schedules():
    with pytest.raises(UsageError, match="unknown --schedule 'zb'"):
        build("zb", 2, 4)
    with pytest.raises(UsageError, match="divisible by stages"):
        build("interleaved", 4, 6, 2)
    with pytest.raises(UsageError, match="needs --schedule interleaved"):
        build("1f1b", 2, 4, 2)
