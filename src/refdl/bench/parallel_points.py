"""The published data set's ``parallel`` points: a transformer trained on a stated layout.

A point names a shape (a ``[[shape]]`` table of the data set, or a zoo transformer),
the layout (``mesh`` over data, model, pipe, context, expert; ``global_batch`` and
``microbatch`` in sequences; ``schedule`` and ``chunks``; ``sequence_parallel``,
``remat``, ``cp``; ``overlap``: the share of the compute the communication hides
behind where the source says its framework overlaps them, else 0; ``grad_reduce``: the
precision its data-parallel gradients were reduced in, read from the source's own
scripts and framework version, a ``[[source]]`` field its points inherit) and what the source
printed: ``time_s`` per step, ``tflops_per_gpu``
(FLOPs counted as ``flops_counted`` says: ``model``, or ``hardware`` with the full
recomputation's forward), ``mfu`` or ``tokens_per_s_per_gpu``. refdl predicts it with
``refdl predict --strategy hybrid`` on the same layout, Adam's state, and the device
fraction the calibration part fitted for large transformer layers (op class
``transformer``, ``fit``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from refdl import hw
from refdl.errors import UsageError
from refdl.perf import GRAD_REDUCE, PredictOptions
from refdl.perf.costs import formula_of
from refdl.perf.model_cost import model_cost
from refdl.perf.transformer import TransformerShape, model_flops
from refdl.perf.zoo import TRANSFORMERS, register_transformer
from refdl.strategies import traits_of

LAYOUT = ("mesh", "global_batch", "microbatch", "schedule", "chunks", "sequence_parallel",
          "remat", "cp", "flops_counted", "overlap", "grad_reduce")  # fmt: skip
SHAPE_KEYS = {f.name for f in dataclasses.fields(TransformerShape)}
METRICS = ("time_s", "tflops_per_gpu", "mfu", "tokens_per_s_per_gpu", "samples_per_s_per_gpu")
OP_CLASS = "transformer"  # the achieved fraction these points calibrate
ADAM_WORDS = 2  # every source trains with Adam


def register_shapes(raw: list[dict[str, Any]], path: str) -> None:
    """The data set's ``[[shape]]`` tables joined to the zoo under their ids (once)."""
    for table in raw:
        sid = table.get("id")
        fields = {k: v for k, v in table.items() if k in SHAPE_KEYS}
        if not sid or set(table) - SHAPE_KEYS - {"id", "source", "note"}:
            raise UsageError(f"--data {path}: shape {sid!r} has keys other than "
                             f"id, source, note, {', '.join(sorted(SHAPE_KEYS))}")  # fmt: skip
        shape = TransformerShape(**fields)
        if sid in TRANSFORMERS.names():
            if TRANSFORMERS.get(sid).shape != shape:
                raise UsageError(f"--data {path}: shape {sid!r} differs from the zoo's")
            continue
        register_transformer(sid, shape, f"published data set shape ({table.get('source')})")


def check_grad_reduce(table: dict[str, Any], where: str) -> None:
    """One line naming ``where`` (a data set's source, point or search) when its
    ``grad_reduce`` is not a precision refdl prices."""
    if table.get("grad_reduce", "fp32") not in GRAD_REDUCE:
        raise UsageError(f"{where}: grad_reduce must be one of {', '.join(GRAD_REDUCE)}")


def layout(p: Any) -> dict[str, Any]:
    """The point's layout with its defaults."""
    return {"schedule": "1f1b", "chunks": 1, "sequence_parallel": False, "remat": "none",
            "cp": "ring", "flops_counted": "model", "microbatch": 1, "overlap": 0.0,
            "grad_reduce": "fp32", **p.layout}  # fmt: skip


def describe(lay: dict[str, Any]) -> str:
    """A layout in a line (a search's candidate)."""
    sched = "" if "pipe=" not in lay.get("mesh", "") else (
        f", {lay['schedule']}" + (f"x{lay['chunks']}" if lay["chunks"] > 1 else ""))  # fmt: skip
    return (f"{lay.get('mesh')}, microbatch {lay['microbatch']}{sched}, remat {lay['remat']}"
            + (", sp" if lay["sequence_parallel"] else ""))  # fmt: skip


def skip(p: Any) -> str | None:
    """Why a parallel point cannot be predicted, or None."""
    lay = layout(p)
    if p.model not in TRANSFORMERS.names():
        return f"no transformer shape {p.model!r}"
    if p.metric not in METRICS:
        return f"metric {p.metric!r} not modelled"
    if "mesh" not in lay or "global_batch" not in lay:
        return "layout not stated (mesh, global_batch)"
    return None


def options(p: Any, precision: str) -> PredictOptions:
    """The prediction's options: the point's layout and Adam's two state words."""
    lay = layout(p)
    opts = PredictOptions(
        mesh=lay["mesh"], schedule=lay["schedule"], chunks=lay["chunks"],
        sequence_parallel=lay["sequence_parallel"], remat=lay["remat"], cp=lay["cp"],
        optimizer_words=ADAM_WORDS, precision=precision, overlap=float(lay["overlap"]),
        grad_reduce=lay["grad_reduce"],
    )  # fmt: skip
    mesh = opts.mesh.on(p.workers)
    replicas = mesh.replicas
    mb = lay["global_batch"] // (replicas * lay["microbatch"])
    if mb < 1 or mb * replicas * lay["microbatch"] != lay["global_batch"]:
        raise UsageError(f"point {p.index}: global_batch {lay['global_batch']} is not "
                         f"{replicas} replicas x microbatches of {lay['microbatch']}")  # fmt: skip
    return dataclasses.replace(opts, microbatches=mb)


def published_time(p: Any, precision: str) -> float:
    """The step time a point's metric implies (``tflops_per_gpu`` and ``mfu`` through the
    FLOPs the source counted, ``refdl.perf.transformer.model_flops``)."""
    lay = layout(p)
    shape = TRANSFORMERS.get(p.model).shape
    batch = lay["global_batch"]
    if p.metric == "time_s":
        return p.value
    if p.metric == "tokens_per_s_per_gpu":
        return batch * shape.seq / (p.workers * p.value)
    if p.metric == "samples_per_s_per_gpu":
        return batch / (p.workers * p.value)
    flops = model_flops(shape, batch, lay["flops_counted"])
    if p.metric == "tflops_per_gpu":
        return flops / (p.workers * p.value * 1e12)
    profile = hw.load(p.hw)
    peak = profile.need_device().peak_flops[profile.dtype_for(precision)]
    return flops / (p.workers * p.value * peak)


def step_time(p: Any, view: Any, precision: str) -> float:
    """The hybrid formula's step time of the point on the profile ``view``."""
    m = model_cost(p.model)
    return formula_of(traits_of("hybrid"))(m, view, layout(p)["global_batch"], p.workers,
                               options(p, precision)).step_time_s  # fmt: skip


def at_fraction(view: Any, peak: float, fraction: float) -> Any:
    """``view`` with the device running at ``fraction`` of ``peak``."""
    dev = view.device
    flops = {**dev.peak_flops, "float32": peak * fraction}
    return dataclasses.replace(view, device=dataclasses.replace(dev, peak_flops=flops))


def fit(points: list[Any], precisions: dict[str, str], library: Any) -> dict[tuple, dict]:
    """Per (device, ``transformer``, dtype): the fraction of peak that predicts the
    calibration part's parallel points best (least squares on log time over a grid of
    0.005, so the fit is reproducible), with the links' achieved figures as they are."""
    groups: dict[tuple, list[Any]] = {}
    for p in points:
        if p.part != "calibration" or p.kind != "parallel" or p.not_predicted or skip(p):
            continue
        if not p.fit:  # a search's point: judged, never fitted (refdl.bench.searches)
            continue
        profile = hw.load(p.hw)
        dtype = profile.dtype_for(precisions[p.precision])
        groups.setdefault((profile.need_device().name, OP_CLASS, dtype), []).append(p)
    out = {}
    for key, pts in sorted(groups.items()):
        cases = []
        for p in pts:
            profile, precision = hw.load(p.hw), precisions[p.precision]
            view = profile.view("expected", precision, OP_CLASS, library(p, profile))
            peak = profile.device.peak_flops[profile.dtype_for(precision)]
            cases.append((p, view, peak, math.log(published_time(p, precision)), precision))
        best = None
        for k in range(20, 201):
            f = k / 200
            loss = sum((math.log(step_time(p, at_fraction(v, pk, f), pr)) - t) ** 2
                       for p, v, pk, t, pr in cases)  # fmt: skip
            if best is None or loss < best[0]:
                best = (loss, f)
        out[key] = {"fraction": best[1], "points": len(pts),
                    "sources": sorted({p.source for p in pts})}  # fmt: skip
    return out
