"""``refdl bench published``: predict every published measurement, judged on points held out.

The data set (``docs/published/measurements.toml``) holds collective times, single-
device step times and multi-GPU scaling efficiencies with their citations, split by
publication into a calibration part and a held-out part before anything was fitted
(its ``[split]`` says how). ``fit`` derives the achieved figures the profiles carry
(``[achieved]``, written by ``scripts/fit_achieved.py``) from the calibration part
alone; ``evaluate`` predicts every point with the profiles as they are and reports
the errors of each part separately, by kind:

- collective, step: relative error of the published metric (time or throughput);
- scaling: the difference of efficiencies (0.05 = 5 points), both relative to the
  series' smallest worker count.

A point names a profile (``hw``); points without one, without a stated precision or
batch the model needs, or of a kind the model does not cover, are listed with the
reason and left out of the errors. No published point may be faster than its bound
(peaks, full overlap): ``violations`` lists any.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from statistics import median
from typing import Any

from refdl import hw
from refdl.bench import memory_format
from refdl.cli import Parser
from refdl.config.files import load_toml
from refdl.config.values import Float, Int
from refdl.errors import UsageError
from refdl.hw import stacks
from refdl.perf import architectures, intervals
from refdl.perf.collectives import BUS_FACTOR, Link, collective_time
from refdl.progress import Progress

PROG = "refdl.bench published"
DATA = Path(__file__).resolve().parents[3] / "docs" / "published" / "measurements.toml"
PRECISION = {"fp32": "fp32", "tf32": "tf32", "amp": "fp16", "fp16": "fp16", "bf16": "bf16"}
OPS = {"allreduce": "allreduce", "allgather": "allgather", "reduce_scatter": "reduce-scatter",
       "p2p": "p2p"}  # fmt: skip
LIBRARY = ("nccl", "mpi", "gloo")
SCALING_NOISE = 0.02  # run-to-run spread of a published efficiency (1.002 at 8 -> 16 K80s)
ASSUMED_BATCH = 256  # DeepLearningExamples' main.py default, where a table omits it


@dataclasses.dataclass(frozen=True)
class Point:
    """One published measurement, as the data set gives it."""

    index: int
    source: str
    part: str
    kind: str
    hw: str
    library: str
    metric: str
    value: float
    workers: int
    nodes: int
    op: str = ""
    bytes: float = 0.0
    model: str = ""
    precision: str | None = None
    batch: int | None = None
    where: str = ""
    not_predicted: str = ""  # the data set's own reason, where refdl models no such run
    layout: dict = dataclasses.field(default_factory=dict)  # parallel: refdl.bench.parallel_points
    search: str = ""  # a configuration search it belongs to (refdl.bench.searches)
    fit: bool = True  # False: no fit reads it (a search's points on the calibration part)
    stack: str = ""  # a dated collective stack the source ran (refdl.hw.stacks); "": current
    year: int | None = None  # the source's year, where it states one
    memory_format: str = ""  # a convolutional step's stated layout (refdl.bench.memory_format)


# A point's numbers: a published figure is positive and finite, a message size finite
POINT_VALUES = {
    "value": Float(min=0.0, min_open=True, max=1e30),
    "bytes": Float(min=0.0, max=1e30),
    "workers": Int(min=1, max=1 << 24),
    "nodes": Int(min=1, max=1 << 24),
}


def _check_point(p: Any, where: str) -> None:
    """A point's required keys and numbers, before any is used (one line each)."""
    if not isinstance(p, dict):
        raise UsageError(f"{where} is not a table")
    missing = [k for k in ("kind", "metric", "value") if k not in p]
    if missing:
        raise UsageError(f"{where} lacks {', '.join(missing)}")
    for key, kind in POINT_VALUES.items():
        if key in p and (problem := kind.problem(p[key])):
            raise UsageError(f"{where}: {key} must be {problem}")


def load(path: str | Path = DATA) -> tuple[list[Point], dict[str, Any]]:
    """The points and the ``[split]`` table of a measurements file."""
    path = Path(path)
    raw = load_toml(path, "--data")  # a regular file, bounded in size and nesting
    if not raw.get("point"):
        raise UsageError(f"--data {path}: no [[point]] tables; give a measurements file "
                         f"such as {DATA}")  # fmt: skip
    from refdl.bench import memory_points, parallel_points, searches  # (JAX: after a bad file)

    parts = {s["id"]: s["part"] for s in raw.get("source", [])}
    years = {s["id"]: s.get("year") for s in raw.get("source", [])}
    inherited = {s["id"]: {"grad_reduce": s["grad_reduce"]} if "grad_reduce" in s else {}
                 for s in raw.get("source", [])}  # fmt: skip
    for sid, lay in inherited.items():
        parallel_points.check_grad_reduce(lay, f"--data {path}: source {sid!r}")
    parallel_points.register_shapes(raw.get("shape", []), str(path))
    points = []
    for i, p in enumerate(raw.get("point", [])):
        if p.get("source") not in parts:
            raise UsageError(f"--data {path}: point {i} names an unknown source")
        parallel_points.check_grad_reduce(p, f"--data {path}: point {i}")
        _check_point(p, f"--data {path}: point {i}")
        if p.get("memory_format", "") not in ("", *memory_format.FORMATS):
            raise UsageError(f"--data {path}: point {i}: memory_format "
                             f"{p['memory_format']!r} is not one of "
                             f"{', '.join(memory_format.FORMATS)}")  # fmt: skip
        if p.get("stack", "") and p["stack"] not in stacks.table():
            raise UsageError(f"--data {path}: point {i}: stack {p['stack']!r} is not one of "
                             f"{', '.join(stacks.table())}")  # fmt: skip
        points.append(
            Point(
                index=i,
                source=p["source"],
                part=parts[p["source"]],
                kind=p["kind"],
                hw=p.get("hw", ""),
                library=p.get("library", ""),
                metric=p["metric"],
                value=float(p["value"]),
                workers=int(p.get("workers", 1)),
                nodes=int(p.get("nodes", 1)),
                op=p.get("op", ""),
                bytes=float(p.get("bytes", 0)),
                model=p.get("model", ""),
                precision=p.get("precision"),
                batch=p.get("batch_per_worker"),
                where=p.get("where", ""),
                not_predicted=p.get("not_predicted", ""),
                layout={
                    **(inherited[p["source"]] if p["kind"] == "parallel" else {}),
                    **{k: p[k] for k in parallel_points.LAYOUT if k in p},
                },
                search=p.get("search", ""),
                fit=bool(p.get("fit", True)),
                stack=p.get("stack", ""),
                year=years[p["source"]],
                memory_format=p.get("memory_format", ""),
            )
        )
    stated = searches.load_stated(raw.get("search", []), parts, str(path), inherited)
    memory = memory_points.load_memory(raw.get("memory", []), parts, str(path))
    split = {**raw.get("split", {}), "stated_searches": stated, "memory": memory}
    return points, split


# ------------------------------------------------------------------ the published side


def published_time(p: Point) -> float:
    """A collective's or a step's time in seconds, from the metric the source printed."""
    if p.metric == "time_s":
        return p.value
    if p.kind == "collective":
        if p.metric == "busbw_GBps":
            factor = BUS_FACTOR[OPS[p.op]](p.workers) if p.op != "p2p" else 1.0
            return p.bytes * factor / (p.value * 1e9)
        if p.metric == "algbw_GBps":
            return p.bytes / (p.value * 1e9)
    if p.metric == "samples_per_s":
        return (p.batch or ASSUMED_BATCH) * p.workers / p.value
    raise ValueError(f"no time for {p.metric}")


def _library(p: Point, profile) -> str:
    """The stack a point is priced with: its dated stack, else its library's current one."""
    if p.stack:
        return p.stack
    for lib in LIBRARY:
        if lib in p.library:
            return lib
    return profile.default_library()


def _level(p: Point, profile) -> str:
    level = "inter" if p.nodes > 1 else "intra"
    return level if level in profile.links else next(iter(profile.links))


# ------------------------------------------------------------------ the model side


def collective_times(p: Point, profile) -> tuple[float, float]:
    """(expected, bound) seconds of a published collective (``refdl.predict``'s pair; a
    point-to-point exchange is one message each way around the ring, concurrently)."""
    from refdl.predict import collective_pair

    if p.op == "p2p":
        level = _level(p, profile)
        lk = profile.view("expected", library=_library(p, profile)).links[level].alpha_beta()
        top = profile.view("bound").links[level].alpha_beta()
        return lk.alpha + p.bytes * lk.beta, top.alpha + p.bytes * top.beta
    return collective_pair(profile, OPS[p.op], "ring", p.bytes, p.workers,
                           _library(p, profile), nodes=p.nodes)  # fmt: skip


def nchw_cost(p: Point, profile) -> tuple[float, bool, str]:
    """The factor a step pays for its stated NCHW layout on tensor cores, whether it is
    borrowed, and its source (``refdl.bench.memory_format``; 1 for any other step)."""
    dtype = profile.dtype_for(PRECISION.get(p.precision or "fp32", "fp32"))
    return memory_format.nchw_cost(profile.need_device().name, dtype, p.memory_format)


def step_times(p: Point) -> tuple[float, float]:
    """(expected, bound) seconds of one single-device step at the point's batch; the
    expectation pays a stated NCHW layout's transposes (the bound, peaks, does not)."""
    from refdl.perf.prediction import predict_steps
    from refdl.strategies import traits_of

    row = predict_steps(p.hw, "single", traits_of("single"), p.model, p.batch or ASSUMED_BATCH, [1],
                        precision=PRECISION[p.precision])[0]  # fmt: skip
    factor = nchw_cost(p, hw.load(p.hw))[0]
    return row["step_time_s"] * factor, row["bound_step_time_s"]


def parallel_times(p: Point) -> tuple[float, tuple[float, float]]:
    """(published, (expected, bound)) seconds of a parallel point's step: the hybrid
    formula on its layout (``refdl.bench.parallel_points``) with the profile's achieved
    figures, and with peaks and full overlap."""
    from refdl.bench import parallel_points
    from refdl.perf.prediction import predict_steps
    from refdl.strategies import traits_of

    precision = PRECISION[p.precision]
    opts = parallel_points.options(p, precision)
    row = predict_steps(p.hw, "hybrid", traits_of("hybrid"), p.model,
                        parallel_points.layout(p)["global_batch"], [p.workers], opts=opts,
                        precision=precision,
                        library=_library(p, hw.load(p.hw)))[0]  # fmt: skip
    return parallel_points.published_time(p, precision), (
        row["step_time_s"],
        row["bound_step_time_s"],
    )


def efficiencies(p: Point, base_workers: int) -> dict[str, float]:
    """Predicted weak-scaling efficiency at ``p.workers`` relative to ``base_workers``:
    expected (bucketed overlap), and the no-overlap / full-overlap extremes; full overlap
    is the bound (no framework hides more communication than all of it)."""
    from refdl.perf.prediction import predict_steps
    from refdl.strategies import traits_of

    profile = hw.load(p.hw)
    rows = predict_steps(p.hw, "data", traits_of("data"), p.model, p.batch or ASSUMED_BATCH,
                         [base_workers, p.workers], scaling="weak",
                         precision=PRECISION[p.precision],
                         library=_library(p, profile))  # fmt: skip
    b, r = rows

    def eff(key: str) -> float:  # weak scaling: (thr_P / P) / (thr_b / b) = t_b / t_P
        return b[key] / r[key]

    return {
        "expected": eff("step_time_s"),
        "no_overlap": eff("step_time_no_overlap_s"),
        "full_overlap": eff("step_time_full_overlap_s"),
        "bound": eff("step_time_full_overlap_s"),
    }


def _skip(p: Point) -> str | None:
    """Why a point cannot be predicted, or None."""
    from refdl.bench import parallel_points

    if p.not_predicted:
        return p.not_predicted
    if not p.hw:
        return "no refdl profile for this machine"
    if p.kind == "collective" and p.op not in OPS:
        return f"collective {p.op!r} not modelled"
    if p.kind in ("step", "scaling", "parallel") and p.precision not in PRECISION:
        return "precision not stated"
    if p.kind == "parallel":
        return parallel_points.skip(p)
    if p.kind == "scaling" and p.metric not in ("samples_per_s", "efficiency"):
        return "a time at one worker count: no base to scale from"
    return None


def _base(p: Point, points: list[Point]) -> Point | None:
    """The series' smallest worker count: same source, machine (profile), model, precision
    and batch. Never another machine's row: a DGX A100's 1-GPU figure is no base for a
    DGX-2's 16, nor a GCE K80's for an EC2 cluster's."""
    same = [q for q in points
            if q.source == p.source and q.hw == p.hw and q.model == p.model
            and q.precision == p.precision and q.batch == p.batch
            and q.metric == "samples_per_s" and q.workers < p.workers
            and q.kind in ("step", "scaling")]  # fmt: skip
    return min(same, key=lambda q: (q.workers, q.index), default=None)


def borrowed(p: Point, profile) -> bool:
    """Whether the achieved figure a point's prediction rests on is borrowed (its link's
    or its device's; ``HardwareProfile.borrowed_link`` / ``borrowed_device``)."""
    from refdl.bench import parallel_points

    if p.kind == "collective":
        return profile.borrowed_link(_library(p, profile), _level(p, profile))
    if p.kind == "parallel":  # no fraction fitted for large transformer layers
        dtype = profile.dtype_for(PRECISION[p.precision])
        return profile.borrowed_device(dtype, parallel_points.OP_CLASS)
    return profile.borrowed_device(profile.dtype_for(PRECISION.get(p.precision or "fp32", "fp32")))


def _interval(row: dict[str, Any], kind: str, is_borrowed: bool, own: Any = None,
              widen: float = 0.0) -> None:  # fmt: skip
    """The stated interval of a predicted row, and whether the published value is in it
    (``own``: a dated stack's figures on the row's link, with their residuals' bounds;
    ``widen``: a log widening on both sides, for a borrowed factor of the row's own)."""
    if kind == "scaling":
        iv = intervals.efficiency_interval(row["predicted"])
    else:
        iv = intervals.time_interval(kind, row["predicted"], is_borrowed, own)
        if iv is not None and widen:
            iv = iv[0] * math.exp(-widen), iv[1] * math.exp(widen)
    if iv is not None:
        row.update(low=iv[0], high=iv[1], borrowed=is_borrowed,
                   inside=iv[0] <= row["published"] <= iv[1])  # fmt: skip


def evaluate(points: list[Point], progress: bool = False) -> list[dict[str, Any]]:
    """Every point predicted (or the reason it is not), with its stated interval;
    ``progress``: a bar on a terminal, a line every 10 s in a log."""
    from refdl.bench import parallel_points

    out = []
    bar = Progress(len(points), PROG, unit="point") if progress else None
    for p in points:
        if bar is not None:
            bar.update(1)
        row: dict[str, Any] = {"index": p.index, "source": p.source, "part": p.part,
                               "kind": p.kind, "hw": p.hw, "where": p.where,
                               "model": p.model or p.op, "workers": p.workers}  # fmt: skip
        reason = _skip(p)
        try:
            if reason:
                pass
            elif p.kind == "collective":
                profile = hw.load(p.hw)
                t_pub = published_time(p)
                t, bound = collective_times(p, profile)
                row.update(published=t_pub, predicted=t, bound=bound, error=t / t_pub - 1,
                           bytes=p.bytes, faster_than_bound=t_pub < bound * (1 - 1e-9),
                           stack=_library(p, profile), year=p.year)  # fmt: skip
                own = profile.stack_figures(row["stack"], _level(p, profile))
                _interval(row, "collective", borrowed(p, profile), own)
            elif p.kind == "parallel":
                t_pub, (t, bound) = parallel_times(p)
                row.update(published=t_pub, predicted=t, bound=bound, error=t / t_pub - 1,
                           faster_than_bound=t_pub < bound * (1 - 1e-9))  # fmt: skip
                profile = hw.load(p.hw)
                dtype = profile.dtype_for(PRECISION[p.precision])
                kind, _own = intervals.step_kind(profile, dtype, parallel_points.OP_CLASS)
                _interval(row, kind, borrowed(p, profile))
                if p.search:
                    lay = parallel_points.layout(p)
                    row["search_key"] = f"{p.search}@{p.workers}x{lay['global_batch']}"
                    row["layout_text"] = parallel_points.describe(lay)
                    row["layout"] = {k: lay[k] for k in ("mesh", "schedule", "remat")}
            elif p.kind == "step":
                t_pub = published_time(p)
                t, bound = step_times(p)
                # throughputs: predicted / published - 1 (= t_pub / t - 1); times: t / t_pub
                err = t_pub / t - 1 if p.metric == "samples_per_s" else t / t_pub - 1
                row.update(published=t_pub, predicted=t, bound=bound, error=err,
                           faster_than_bound=t_pub < bound * (1 - 1e-9))  # fmt: skip
                profile = hw.load(p.hw)
                factor, lent, _source = nchw_cost(p, profile)
                if factor != 1.0:
                    row.update(memory_format=p.memory_format, nchw_factor=factor,
                               nchw_borrowed=lent)  # fmt: skip
                widen = memory_format.borrowed_log_spread() if lent else 0.0
                _interval(row, "step", borrowed(p, profile), widen=widen)
            else:
                if p.metric == "efficiency":
                    base_w, pub = 1, p.value
                else:
                    base = _base(p, points)
                    if base is None:
                        reason = "no smaller worker count of the same series"
                    else:
                        base_w = base.workers
                        pub = (p.value / p.workers) / (base.value / base.workers)
                if not reason:
                    e = efficiencies(p, base_w)
                    row.update(published=pub, predicted=e["expected"],
                               no_overlap=e["no_overlap"], full_overlap=e["full_overlap"],
                               base_workers=base_w, error=e["expected"] - pub,
                               bound=e["bound"],
                               faster_than_bound=pub > e["bound"] + SCALING_NOISE)  # fmt: skip
                    _interval(row, "scaling", False)
        except UsageError as e:
            reason = str(e)
        if reason:
            row["skipped"] = reason
        out.append(row)
    if bar is not None:
        bar.close()
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per part and kind: n, median and max |error|; and the points faster than a bound."""
    out: dict[str, Any] = {}
    for part in ("calibration", "heldout"):
        out[part] = {}
        for kind in ("collective", "step", "scaling", "parallel"):
            errs = [abs(r["error"]) for r in rows
                    if r["part"] == part and r["kind"] == kind and "error" in r]  # fmt: skip
            stated = [r for r in rows if r["part"] == part and r["kind"] == kind and "low" in r]
            out[part][kind] = {
                "n": len(errs),
                "median_abs_error": median(errs) if errs else None,
                "max_abs_error": max(errs) if errs else None,
                **coverage(stated, kind),
            }
    out["violations"] = [r["index"] for r in rows if r.get("faster_than_bound")]
    out["skipped"] = sum(1 for r in rows if "skipped" in r)
    return out


def stack_summary(rows: list[dict[str, Any]], points: list[Point]) -> dict[str, Any]:
    """Per dated collective stack and part: its points' median |error| and interval
    coverage, beside the same points priced with their library's current figures (what
    refdl said before it knew the stack)."""
    from refdl.predict import collective_pair

    by_index = {p.index: p for p in points}
    out: dict[str, Any] = {}
    for r in rows:
        if "predicted" not in r or r["kind"] != "collective" or stacks.get(r["stack"]).current:
            continue
        p, profile = by_index[r["index"]], hw.load(r["hw"])
        base = stacks.get(p.stack).library
        t = collective_pair(profile, OPS[p.op], "ring", p.bytes, p.workers, base, p.nodes)[0]
        iv = intervals.time_interval(
            "collective", t, profile.borrowed_link(base, _level(p, profile))
        )
        cell = out.setdefault(p.stack, {}).setdefault(r["part"], {"rows": []})
        cell["rows"].append((r["error"], r.get("inside"), t / r["published"] - 1,
                             iv is not None and iv[0] <= r["published"] <= iv[1]))  # fmt: skip
    for parts in out.values():
        for part, cell in parts.items():
            rs = cell.pop("rows")
            parts[part] = {"n": len(rs), "median_abs_error": median(abs(x[0]) for x in rs),
                           "inside": sum(bool(x[1]) for x in rs),
                           "current_median_abs_error": median(abs(x[2]) for x in rs),
                           "current_inside": sum(x[3] for x in rs)}  # fmt: skip
    return out


def goals(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 52's goals for the held-out part, each with its value and whether it is met:
    the source's fastest among refdl's first 3 in >= 95 % of searches, the median step
    error <= 10 %, the steps' 80 % interval at most x2 wide while it still holds >= 80 %."""
    searches, step = s["searches"]["heldout"], s["heldout"]["step"]
    top3, err = searches["best_in_top3"], step["median_abs_error"]
    width, cov = step["median_interval_width"], step["coverage"]
    return [
        {"goal": "the source's fastest in refdl's first 3", "value": top3, "target": ">= 95 %",
         "met": top3 is not None and top3 >= 0.95},
        {"goal": "median step error", "value": err, "target": "<= 10 %",
         "met": err is not None and err <= 0.10},
        {"goal": "80 % interval's median width (steps), coverage >= 80 %", "value": width,
         "coverage": cov, "target": "<= x2",
         "met": width is not None and width <= 2.0 and cov is not None and cov >= 0.8},
        *_layout_goals(s["heldout"].get("parallel")),
    ]  # fmt: skip


def _layout_goals(par: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The step goals again on the transformers on stated layouts (``parallel``), the
    runs ``refdl plan`` chooses among; reported beside the steps', not instead of them."""
    if not par:
        return []
    err, width, cov = par["median_abs_error"], par["median_interval_width"], par["coverage"]
    return [
        {"goal": "median step error (transformers on layouts)", "value": err,
         "target": "<= 10 %", "met": err is not None and err <= 0.10},
        {"goal": "80 % interval's width (transformers), coverage >= 80 %",
         "value": width, "coverage": cov, "target": "<= x2",
         "met": width is not None and width <= 2.0 and cov is not None and cov >= 0.8},
    ]  # fmt: skip


def goal_lines(gs: list[dict[str, Any]]) -> list[str]:
    """``goals`` in words."""
    out = ["issue 52's goals on the held-out part:"]
    for g in gs:
        v = g["value"]
        shown = "-" if v is None else (f"x{v:.2f} (holds {_fmt(g['coverage'])})"
                                       if "coverage" in g else _fmt(v))  # fmt: skip
        out.append(f"  {g['goal']:56s} {shown:>22s}  goal {g['target']:8s} "
                   f"{'met' if g['met'] else 'not met'}")  # fmt: skip
    return out


def stack_lines(s: dict[str, Any]) -> list[str]:
    """``stack_summary`` in words."""
    out = ["dated collective stacks (refdl.hw.stacks; priced with the stack the source ran, "
           "and as before with today's figures of its library):"]  # fmt: skip
    for name, parts in s.items():
        for part, v in parts.items():
            out.append(f"  {name:16s} {part:12s} {v['n']:3d} points: median |err| "
                       f"{_fmt(v['median_abs_error'])}, {v['inside']} inside their interval; "
                       f"with today's {stacks.get(name).library}: "
                       f"{_fmt(v['current_median_abs_error'])}, "
                       f"{v['current_inside']} inside")  # fmt: skip
    return out


def coverage(rows: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The share of ``rows`` whose published value is inside their stated interval, and
    the interval's median width (high / low for times; points for efficiencies); the
    same for the rows whose figures were borrowed."""
    if not rows:
        return {"coverage": None, "median_interval_width": None}

    def width(r: dict[str, Any]) -> float:
        return r["high"] - r["low"] if kind == "scaling" else r["high"] / r["low"]

    lent = [r for r in rows if r.get("borrowed")]
    return {
        "coverage": sum(r["inside"] for r in rows) / len(rows),
        "median_interval_width": median(width(r) for r in rows),
        "borrowed": {"n": len(lent),
                     "coverage": sum(r["inside"] for r in lent) / len(lent) if lent else None},
    }  # fmt: skip


def conformal(residuals: list[float], level: float = 0.8) -> tuple[float, float]:
    """The split-conformal bounds of a ``level`` interval from ``n`` residuals: the
    floor((n+1)(1-level)/2)-th and ceil((n+1)(1+level)/2)-th smallest (1-based), so a new
    exchangeable residual falls between them with probability >= level whatever their
    distribution (plain 10th/90th percentiles of 15 residuals cover only ~70 %)."""
    x = sorted(residuals)
    n = len(x)
    # rounded first: (9 + 1) x (1 - 0.8) / 2 is 0.999... in binary, whose floor is 0
    lo = math.floor(round((n + 1) * (1 - level) / 2, 9))
    hi = math.ceil(round((n + 1) * (1 + level) / 2, 9))
    return (x[lo - 1] if lo >= 1 else -math.inf), (x[hi - 1] if hi <= n else math.inf)


def fit_intervals(rows: list[dict[str, Any]], points: list[Point]) -> dict[str, dict]:
    """Per kind, from the calibration part's predictions only: the conformal 80 % bounds
    (``conformal``) of log(published / predicted) (times; steps predicted leaving their
    source out of the fit, ``step_cv_residuals``) or published - predicted (scaling),
    and for borrowed figures half the log-range of the fitted figures they are borrowed
    from (collectives: the fitted links' fractions; steps: the fitted device fractions)."""
    out: dict[str, dict] = {}
    for kind in ("collective", "step", "transformer", "scaling"):
        if kind == "transformer":  # out of sample, as the steps
            res = transformer_cv_residuals(points)
            lo, hi = conformal(res)
            out[kind] = {"log_q10": lo, "log_q90": hi, "points": len(res)}
            continue
        cal = [r for r in rows if r["part"] == "calibration" and r["kind"] == kind
               and "predicted" in r and stacks.get(r.get("stack", "nccl")).current]  # fmt: skip
        if kind == "scaling":
            lo, hi = conformal([r["published"] - r["predicted"] for r in cal])
            out[kind] = {"q10": lo, "q90": hi, "points": len(cal)}
            continue
        res = [math.log(r["published"] / r["predicted"]) for r in cal]
        if kind == "step":  # out of sample: the fit's own residuals are too kind
            res = step_cv_residuals(points)
        lo, hi = conformal(res)
        out[kind] = {"log_q10": lo, "log_q90": hi, "points": len(res)}
    fracs = [v["fraction"] for v in fit_links(points).values()]
    out["collective"]["borrowed_log_spread"] = 0.5 * math.log(max(fracs) / min(fracs))
    devs = [v["fraction"] for v in fit_steps(points)[0].values()]
    out["step"]["borrowed_log_spread"] = 0.5 * math.log(max(devs) / min(devs))
    return out


# ------------------------------------------------------------------ fitting (calibration only)


def fit_links(points: list[Point]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Per (profile, library, level): the latency and fraction of line rate that fit the
    calibration part's collectives best (least squares on log time; a grid, so the fit
    is reproducible), the latency no lower than the profile's. Points of a dated stack
    are ``fit_stacks``'s."""
    groups: dict[tuple[str, str, str], list[Point]] = {}
    for p in points:
        if p.part == "calibration" and p.kind == "collective" and not _skip(p) and not p.stack:
            profile = hw.load(p.hw)
            groups.setdefault((p.hw, _library(p, profile), _level(p, profile)), []).append(p)
    fits = {}
    for (name, lib, level), pts in sorted(groups.items()):
        if len(pts) < 2:  # one point cannot separate latency from bandwidth
            continue
        link = hw.load(name).links[level]
        _, a, f = _grid_fit(pts, lambda p, link=link: link)
        fits[(name, lib, level)] = {"latency_s": a, "fraction": f, "points": len(pts),
                                    "sources": sorted({p.source for p in pts})}  # fmt: skip
    return fits


def fit_stacks(points: list[Point]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (dated stack, link kind): the latency and fraction of line rate that fit the
    calibration part's collectives of that stack (as ``fit_links``, each point on its own
    profile's link), and the split-conformal 80 % bounds of the fit's residuals."""
    groups: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        if p.part == "calibration" and p.kind == "collective" and not _skip(p) and p.stack:
            profile = hw.load(p.hw)
            kind = profile.link_kind(_level(p, profile))
            groups.setdefault((p.stack, kind), []).append(p)
    fits = {}
    for (stack, kind), pts in sorted(groups.items()):
        if len(pts) < 2:
            continue
        links = {p.index: (lambda pr, p=p: pr.links[_level(p, pr)])(hw.load(p.hw)) for p in pts}
        link_of = lambda p, links=links: links[p.index]  # noqa: E731
        _, a, f = _grid_fit(pts, link_of)
        res = [math.log(published_time(p) / _link_time(p, a, f, link_of(p))) for p in pts]
        lo, hi = conformal(res)
        fits[(stack, kind)] = {"latency_s": a, "fraction": f, "points": len(pts),
                               "log_q10": lo, "log_q90": hi,
                               "sources": sorted({p.source for p in pts})}  # fmt: skip
    return fits


def _link_time(p: Point, alpha: float, fraction: float, link) -> float:
    lk = Link(alpha=alpha, beta=1.0 / (link.bandwidth * fraction))
    if p.op == "p2p":
        return lk.alpha + p.bytes * lk.beta
    return collective_time(OPS[p.op], "ring", p.bytes, p.workers, lk)


def _grid_fit(pts: list[Point], link_of) -> tuple[float, float, float]:
    """(loss, latency, fraction) of the grid's least squares on log time over ``pts``, each
    on ``link_of(point)``; latencies from the smallest link latency up by 10^(k/20)."""
    base = min(link_of(p).latency_s for p in pts)
    alphas = [base * 10 ** (k / 20) for k in range(0, 61)]
    fracs = [k / 200 for k in range(4, 201)]
    best = None
    for a in alphas:
        for f in fracs:
            loss = sum(math.log(_link_time(p, a, f, link_of(p)) / published_time(p)) ** 2
                       for p in pts)  # fmt: skip
            if best is None or loss < best[0]:
                best = (loss, a, f)
    return best


REFERENCE_MODEL = "resnet50"  # the architecture whose factor is 1 (refdl.perf.architectures)


def _step_rows(points: list[Point]) -> list[tuple]:
    """The calibration part's single-device steps as (device key, model or None, log of
    the achieved fraction of peak, point)."""
    from refdl.perf.model_cost import model_cost

    rows = []
    for p in points:
        if p.part != "calibration" or p.kind != "step" or _skip(p):
            continue
        profile = hw.load(p.hw)
        m = model_cost(p.model)
        dtype = profile.dtype_for(PRECISION[p.precision])
        peak = profile.device.peak_flops.get(dtype, profile.peak_flops)  # as view("expected")
        nhwc_time = published_time(p) / nchw_cost(p, profile)[0]  # the layout the fit knows
        achieved = m.flops(p.batch or ASSUMED_BATCH) / (peak * nhwc_time)
        model = architectures.fitted_as(p.model) if m.op_class == "conv" else None
        rows.append(((profile.device.name, m.op_class, dtype), model, math.log(achieved), p))
    return rows


def _alternate(rows: list[tuple], iterations: int = 200) -> tuple[dict, dict]:
    """Log device fractions and architecture factors by alternating least squares."""
    dev: dict[tuple[str, str, str], float] = {}
    arch: dict[str, float] = {}

    def mean_by(key, value) -> dict:
        groups: dict[Any, list[float]] = {}
        for r in rows:
            if key(r) is not None:
                groups.setdefault(key(r), []).append(value(r))
        return {k: sum(v) / len(v) for k, v in groups.items()}

    for _ in range(iterations):
        dev = mean_by(lambda r: r[0], lambda r, a=arch: r[2] - a.get(r[1], 0.0))
        arch = mean_by(lambda r: r[1], lambda r, d=dev: r[2] - d[r[0]])
        ref = arch.get(REFERENCE_MODEL, 0.0)  # ResNet-50 is 1: shift its log into dev
        arch = {k: v - ref for k, v in arch.items()}
    return dev, arch


def transformer_cv_residuals(points: list[Point]) -> list[float]:
    """log(published / predicted) step times of the calibration part's transformers on
    stated layouts (``parallel``), each source predicted with the transformer fractions
    fitted without it (leave one source out, as ``step_cv_residuals``); a point whose
    device and dtype have no other source is left out."""
    from refdl.bench import parallel_points as pp

    cal = [p for p in points if p.part == "calibration" and p.kind == "parallel"
           and not _skip(p)]  # fmt: skip
    out = []
    for source in sorted({p.source for p in cal}):
        fits = pp.fit([p for p in points if p.source != source], PRECISION, _library)
        for p in (q for q in cal if q.source == source):
            profile, precision = hw.load(p.hw), PRECISION[p.precision]
            dtype = profile.dtype_for(precision)
            key = (profile.need_device().name, pp.OP_CLASS, dtype)
            if key not in fits:
                continue
            view = profile.view("expected", precision, pp.OP_CLASS, _library(p, profile))
            peak = profile.need_device().peak_flops[dtype]
            t = pp.step_time(p, pp.at_fraction(view, peak, fits[key]["fraction"]), precision)
            out.append(math.log(pp.published_time(p, precision) / t))
    return out


def step_cv_residuals(points: list[Point]) -> list[float]:
    """log(published / predicted) step times of the calibration part, each source
    predicted by the fit without it (leave one source out): the error a new source's
    step sees, which the fit's own residuals understate. A point whose device or model
    has no other source is left out (nothing to predict it from)."""
    rows = _step_rows(points)
    out = []
    for source in sorted({r[3].source for r in rows}):
        dev, arch = _alternate([r for r in rows if r[3].source != source])
        for key, model, log_achieved, _p in (r for r in rows if r[3].source == source):
            if key in dev and (model is None or model in arch):
                out.append(dev[key] + arch.get(model, 0.0) - log_achieved)
    return out


def fit_steps(
    points: list[Point], iterations: int = 200
) -> tuple[dict[tuple[str, str, str], dict[str, Any]], dict[str, dict[str, Any]]]:
    """Fit the calibration part's single-device steps as ``time = FLOPs / (peak x
    fraction[device, op class, dtype] x factor[model])``: least squares in log space,
    alternating between the two factors, ResNet-50's factor 1. Only convolutional
    models get a factor (a GEMM-class device fraction is fitted on its models alone).
    Returns (per device key: fraction, points, sources; per model: factor, points,
    sources)."""
    rows = _step_rows(points)
    dev, arch = _alternate(rows, iterations)
    devices = {
        k: {"fraction": min(1.0, math.exp(v)),
            "points": sum(1 for r in rows if r[0] == k),
            "sources": sorted({r[3].source for r in rows if r[0] == k})}
        for k, v in sorted(dev.items())
    }  # fmt: skip
    models = {
        k: {"factor": math.exp(v),
            "points": sum(1 for r in rows if r[1] == k),
            "sources": sorted({r[3].source for r in rows if r[1] == k})}
        for k, v in sorted(arch.items())
    }  # fmt: skip
    return devices, models


def stated_time(search: Any, layout: dict[str, Any]) -> float:
    """The predicted step of one candidate of a stated search (``refdl.bench.searches``):
    a parallel point of that layout, priced as every other."""
    p = Point(index=-1, source=search.source, part=search.part, kind="parallel",
              hw=search.hw, library=search.library, metric="time_s", value=0.0,
              workers=search.workers, nodes=search.nodes, model=search.model,
              precision=search.precision, layout=layout)  # fmt: skip
    reason = _skip(p)
    if reason:
        raise UsageError(reason)
    return parallel_times(p)[1][0]


# ------------------------------------------------------------------ the command


def _fmt(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f} %" if pct else f"{100 * x:.1f} pts"


def main(argv: list[str] | None = None) -> int:
    ap = Parser(name=PROG.replace("refdl.", "refdl ", 1),
                                 description=__doc__.splitlines()[0])  # fmt: skip
    ap.add_argument("--data", default=str(DATA), help="measurements TOML")
    ap.add_argument("--json", action="store_true", help="summary and every point as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="predicted vs published, log-log")
    args = ap.parse_args(argv)
    try:
        if args.plot:
            from refdl.config.paths import writable_file

            writable_file(args.plot, "--plot", (".png", ".pdf", ".svg"))
        points, _split = load(args.data)
        rows = evaluate(points, progress=True)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from refdl.bench import memory_points, searches

    s = summary(rows)
    ranked = searches.measured(rows) + searches.stated(_split["stated_searches"], stated_time)
    s["searches"] = {**searches.summary(ranked), "cases": ranked}
    memory = memory_points.evaluate(_split["memory"])
    s["memory"] = {**memory_points.summary(memory), "rows": memory}
    s["stacks"] = stack_summary(rows, points)
    s["goals"] = goals(s)
    if args.plot:
        from refdl import plots

        plots.published(rows, args.plot)
    if args.json:
        print(json.dumps({**s, "points": rows}, indent=1))
        return 0
    print(f"{len(rows)} published points, {s['skipped']} not predicted (see --json)")
    print(f"{'part':12s} {'kind':11s} {'n':>4s} {'median |err|':>13s} {'max |err|':>11s} "
          f"{'80 % interval holds':>20s} {'median width':>13s}")  # fmt: skip
    for part in ("calibration", "heldout"):
        for kind, v in s[part].items():
            pct = kind != "scaling"
            cov, w = v["coverage"], v["median_interval_width"]
            width = "-" if w is None else (f"{100 * w:.1f} pts" if not pct else f"x{w:.2f}")
            print(f"{part:12s} {kind:11s} {v['n']:4d} {_fmt(v['median_abs_error'], pct):>13s} "
                  f"{_fmt(v['max_abs_error'], pct):>11s} "
                  f"{'-' if cov is None else f'{100 * cov:.0f} %':>20s} {width:>13s}")  # fmt: skip
    print(f"points faster than their bound: {len(s['violations'])} {s['violations'] or ''}")
    print("configuration searches (the source's fastest among its candidates: refdl's first, "
          "in its first 3):")  # fmt: skip
    for part in ("calibration", "heldout"):
        v = s["searches"][part]
        tau = v["mean_kendall_tau_b"]
        print(f"  {part:12s} {v['searches']:3d} searches ({v['measured']} measured, "
              f"{v['stated']} stated): first {_fmt(v['best_is_first'])}, top 3 "
              f"{_fmt(v['best_in_top3'])}; of the {v['wide_searches']} with more than 3 "
              f"candidates, top 3 {_fmt(v['wide_best_in_top3'])}; mean Kendall tau "
              f"{'-' if tau is None else f'{tau:.2f}'}")  # fmt: skip
        print(
            f"  {'':12s} in plan's order (its ties simplest first): first "
            f"{_fmt(v['plain_best_is_first'])}, top 3 {_fmt(v['plain_best_in_top3'])}"
        )
    t = s["searches"]["ties"]
    print(f"ties (plan's band x{t['tie_band']:g}, set from {t['set_from']}'s searches) on the "
          f"{t['searches']} others: the source's fastest in the tie set "
          f"{_fmt(t['best_in_tie_set'])}, the set {_fmt(t['mean_tie_set_share'])} of the "
          f"candidates; {_fmt(t['pairs_within_band'])} of {t['pairs']} measured pairs' ratios "
          "within the band")  # fmt: skip
    if memory:
        print("\n".join(memory_points.lines(memory, memory_points.summary(memory))))
    print("\n".join(stack_lines(s["stacks"])))
    print("\n".join(goal_lines(s["goals"])))
    return 0
