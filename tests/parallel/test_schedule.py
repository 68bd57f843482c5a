"""Pipeline schedule tables: dependencies, the closed-form bubble, activation stash, and
the order of every operation against PyTorch's ``torch.distributed.pipelining``."""

from __future__ import annotations

import types

import pytest

from refdl.errors import UsageError
from refdl.parallel.schedule import Op, analytic_bubble, bubble, build

GRID = [(p, m) for p in range(1, 9) for m in range(1, 33)]


def _check_dependencies(s):
    """Re-derive the data dependencies from the table alone."""
    last = s.stages * s.chunks - 1
    when = {}
    for t, stage, op in s.ops():
        key = (op.kind, op.mb, s.virtual(stage, op))
        assert key not in when, f"{key} runs twice"
        when[key] = t
    for (kind, mb, k), t in when.items():
        if kind == "F" and k > 0:
            assert when[("F", mb, k - 1)] < t
        if kind == "B":
            assert when[("F", mb, k)] < t  # every forward precedes its backward
            if k < last:
                assert when[("B", mb, k + 1)] < t
        if kind == "W":
            assert when[("B", mb, k)] < t  # the weight gradient after the input gradient
    kinds = 3 if s.split_backward else 2
    assert len(when) == kinds * s.microbatches * s.stages * s.chunks  # every op exactly once
    assert {k for _, _, k in when} == set(range(last + 1))


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
    with pytest.raises(UsageError, match="needs --schedule interleaved or looped-bfs"):
        build("1f1b", 2, 4, 2)
    with pytest.raises(UsageError, match="needs --schedule interleaved or looped-bfs"):
        build("zbv", 2, 4, 2)


def test_zb_h1_has_a_third_of_1f1b_bubble_and_its_memory():
    for p, m in GRID:
        s = build("zb-h1", p, m)
        _check_dependencies(s)
        one = build("1f1b", p, m)
        if m >= p:
            assert s.slots == 3 * m + p - 1  # the closed form's slots: (p - 1) idle per stage
            assert s.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
            assert s.bubble_fraction == pytest.approx(analytic_bubble("zb-h1", p, m), abs=1e-12)
        else:
            assert analytic_bubble("zb-h1", p, m) is None
        assert bubble("zb-h1", p, m) == pytest.approx(s.bubble_fraction, abs=1e-12)
        if p > 1:
            assert s.bubble_fraction < one.bubble_fraction
        # A stash lives until its W; the deepest stash is 1F1B's (stage 0's min(p, m)).
        assert max(s.peak_stash(r) for r in range(p)) == min(p, m)
        assert s.p2p_messages() == 2 * m * (p - 1)


def test_dualpipev_is_a_v_whose_bubble_is_zbvs_in_compute_slots():
    """DualPipeV runs ZB-V's V with overlapped forward/backward pairs; counted in slots of
    compute it idles ``p - 1`` slots per device (the closed form), and it refuses fewer
    than ``2p`` microbatches, as PyTorch's does."""
    for p in (2, 3, 4, 8):
        for m in range(2 * p, 2 * p + 12):
            s = build("dualpipev", p, m)
            _check_dependencies(s)
            assert s.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
            assert analytic_bubble("dualpipev", p, m) == pytest.approx(s.bubble_fraction)
            assert [s.busy(r) for r in range(p)] == [6 * m] * p  # F, B, W of 2 chunks
            assert s.p2p_messages() == 2 * m * (2 * p - 2)
            # one chunk activation more than ZB-V's 2p: a pair's forward comes before the
            # backward that frees one
            assert [s.peak_stash(r) for r in range(p)] == [2 * p + 1] * p
    with pytest.raises(UsageError, match="at least 2 x stages = 8 microbatches"):
        build("dualpipev", 4, 7)


def test_zbv_puts_two_chunks_per_device_in_a_v():
    for p, m in GRID:
        s = build("zbv", p, m)
        _check_dependencies(s)
        assert s.chunks == 2
        for stage in range(p):  # chunk 0 descends the devices, chunk 1 climbs back
            assert s.virtual(stage, Op("F", 0, 0)) == stage
            assert s.virtual(stage, Op("F", 0, 1)) == 2 * p - 1 - stage
        closed = analytic_bubble("zbv", p, m)
        if 2 * m >= 3 * p - 1:
            assert s.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
            assert closed == pytest.approx(s.bubble_fraction, abs=1e-12)
        else:
            assert closed is None
        if p > 1:
            assert s.bubble_fraction < build("1f1b", p, m).bubble_fraction
        if m > p > 1:  # at m <= p, ZB-H1 ties or wins: the V's warm-up is 2p - 1 forwards deep
            assert s.bubble_fraction < build("zb-h1", p, m).bubble_fraction
        # 2p chunk activations (half a stage each) at most: 1F1B's p stage activations.
        assert max(s.peak_stash(r) for r in range(p)) == min(2 * p, 2 * m)
        # The V's turn (virtual stages p - 1 and p) stays on device p - 1.
        assert s.p2p_messages() == 2 * m * (2 * p - 2)


@pytest.mark.parametrize("v", [1, 2, 3])
def test_looped_bfs_runs_every_microbatch_through_a_chunk_first(v):
    for p, m in GRID:
        s = build("looped-bfs", p, m, v)
        _check_dependencies(s)
        if m >= p:
            assert s.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        assert bubble("looped-bfs", p, m, v) == pytest.approx(s.bubble_fraction, abs=1e-12)
        assert [s.peak_stash(r) for r in range(p)] == [v * m] * p  # GPipe's, per chunk


def _torch_orders(kind: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's actions as PyTorch computes them (``_calculate_single_rank_operations``
    of its schedule class, on the attributes that method reads), as (kind, mb, virtual
    stage); PyTorch's I (backward input) is refdl's B."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {
        "interleaved": schedules.ScheduleInterleaved1F1B,
        "looped-bfs": schedules.ScheduleLoopedBFS,
        "zb-h1": schedules.ScheduleInterleavedZeroBubble,
        "zbv": schedules.ScheduleZBVZeroBubble,
        "dualpipev": schedules.ScheduleDualPipeV,
    }[kind]
    rounds = max(1, m // p)
    attrs = types.SimpleNamespace(
        pp_group_size=p, _n_microbatches=m, n_local_stages=v, _stages=[None] * v,
        num_stages=p * v, number_of_rounds=rounds, microbatches_per_round=m // rounds,
    )  # fmt: skip
    letter = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}

    def units(a):  # DualPipeV's overlapped pair: its two actions; its full backward: B, W
        if a.computation_type.name == "OVERLAP_F_B":
            return [u for sub in a.sub_actions for u in units(sub)]
        one = (letter[a.computation_type.name], a.microbatch_index, a.stage_index)
        if kind == "dualpipev" and a.computation_type.name == "FULL_BACKWARD":
            return [one, ("W", *one[1:])]
        return [one]

    return [
        [u for a in cls._calculate_single_rank_operations(attrs, rank) if a is not None
         for u in units(a)]
        for rank in range(p)
    ]  # fmt: skip


TORCH_CASES = [("interleaved", 2), ("interleaved", 3), ("looped-bfs", 2), ("looped-bfs", 3),
               ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]  # fmt: skip


@pytest.mark.parametrize("kind,v", TORCH_CASES)
def test_orders_match_pytorch_pipelining_action_for_action(kind, v):
    """An independent implementation: every rank runs the same operations in the same
    order as PyTorch's schedule of that name (ZB-H1 is its interleaved zero-bubble
    schedule with one chunk per rank)."""
    for p in (2, 3, 4, 8):
        for m in (1, 2, 3, 4, 6, 8, 12, 16):
            if (kind == "interleaved" and m % p) or (kind == "dualpipev" and m < 2 * p):
                continue
            s = build(kind, p, m, v if kind in ("interleaved", "looped-bfs") else 1)
            ours: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
            for _, stage, op in s.ops():
                ours[stage].append((op.kind, op.mb, s.virtual(stage, op)))
            assert ours == _torch_orders(kind, p, m, s.chunks), (kind, p, m, v)
