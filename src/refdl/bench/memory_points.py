"""Published per-device memory against refdl's: does ``refdl predict``'s ``memory_bytes``
hold where a source printed what a configuration took?

``[[memory]]`` tables of the published data set name a model by its shape (the text
``--model-shape`` takes), the mesh, the global batch and sequence, microbatches, schedule,
recomputation and precision, the source's figure in GiB, what the figure measures in the
source's words (peak reserved memory, the largest over ranks, ...), and how the run
differs from what refdl prices (``differs``: torch.compile, float8 linear layers, per-op
selective recomputation, unsharded stage weights ...). Nothing here is fitted: the memory
model is Korthikanti et al.'s closed form and the states' bytes (``refdl.perf.transformer``);
these rows check it. A row whose run differs in a way that changes memory is reported
apart from the plain ones (``plain``).
"""

from __future__ import annotations

import dataclasses
from statistics import median
from typing import Any

from refdl.errors import UsageError

GIB = float(1 << 30)
MEMORY_KEYS = {"id", "source", "where", "quote", "hw", "shape", "workers", "mesh",
               "global_batch", "seq", "microbatches", "schedule", "chunks", "remat",
               "sequence_parallel", "precision", "measured_gib", "measures", "eager",
               "differs", "note"}  # fmt: skip
REQUIRED = ("id", "source", "hw", "shape", "workers", "mesh", "global_batch", "seq",
            "remat", "precision", "measured_gib", "measures", "eager")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """A configuration whose source printed its memory per device (a ``[[memory]]`` table)."""

    id: str
    source: str
    part: str
    hw: str
    shape: str
    workers: int
    mesh: str
    global_batch: int
    seq: int
    remat: str
    precision: str
    measured_gib: float
    measures: str
    eager: bool
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    sequence_parallel: bool = False
    differs: tuple[str, ...] = ()


def load_memory(raw: list[dict[str, Any]], parts: dict[str, str], path: str
                ) -> list[MemoryPoint]:  # fmt: skip
    """The data set's ``[[memory]]`` tables, checked (one line names a bad one)."""
    out = []
    for t in raw:
        mid = t.get("id", "?")
        extra, missing = set(t) - MEMORY_KEYS, [k for k in REQUIRED if k not in t]
        if extra or missing or t.get("source") not in parts:
            why = (f"unknown keys {sorted(extra)}" if extra else f"no {missing[0]}"
                   if missing else f"unknown source {t.get('source')!r}")  # fmt: skip
            raise UsageError(f"--data {path}: [[memory]] {mid}: {why}")
        given = {k: t[k] for k in MEMORY_KEYS & set(t) if k not in ("where", "quote", "note")}
        given["differs"] = tuple(t.get("differs", ()))
        out.append(MemoryPoint(part=parts[t["source"]], **given))
    return out


def predicted_bytes(p: MemoryPoint) -> float:
    """``refdl predict``'s ``memory_bytes`` for the point's configuration (its busiest
    device), as ``refdl predict --model-shape SHAPE --mesh MESH ...`` prints it."""
    from refdl.perf import OPTIMIZER_WORDS, PredictOptions
    from refdl.perf.prediction import predict_steps
    from refdl.perf.shapes import model_named
    from refdl.strategies import traits_of

    model, _ = model_named(None, p.shape, None, p.seq)
    opts = PredictOptions(mesh=p.mesh, microbatches=p.microbatches, schedule=p.schedule,
                          chunks=p.chunks, remat=p.remat,
                          sequence_parallel=p.sequence_parallel,
                          # torchtitan's runs train with AdamW: two words (its llama3 train
                          # configs, [optimizer] name = "AdamW", pytorch/torchtitan 08a5a9f3;
                          # one, momentum's, until 2026-11-28), predict's default for them
                          optimizer_words=OPTIMIZER_WORDS["adam"])  # fmt: skip
    (row,) = predict_steps(p.hw, "hybrid", traits_of("hybrid"), model, p.global_batch,
                           [p.workers], "strong", opts, precision=p.precision)  # fmt: skip
    return float(row["memory_bytes"])


def evaluate(points: list[MemoryPoint]) -> list[dict[str, Any]]:
    """Each point with refdl's prediction and its error (predicted over published - 1)."""
    rows = []
    for p in points:
        got = predicted_bytes(p) / GIB
        rows.append({"id": p.id, "source": p.source, "part": p.part, "mesh": p.mesh,
                     "workers": p.workers, "global_batch": p.global_batch, "seq": p.seq,
                     "remat": p.remat, "eager": p.eager, "differs": list(p.differs),
                     "measures": p.measures, "published_gib": p.measured_gib,
                     "predicted_gib": round(got, 2),
                     "error": got / p.measured_gib - 1})  # fmt: skip
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and largest |error|: the eager runs', and the compiled or float8 ones'."""
    out: dict[str, Any] = {}
    for name, keep in (("eager", True), ("compiled or float8", False)):
        errs = [r["error"] for r in rows if r["eager"] is keep]
        out[name] = {
            "n": len(errs),
            "median_abs_error": median(abs(e) for e in errs) if errs else None,
            "max_abs_error": max((abs(e) for e in errs), default=None),
            "median_error": median(errs) if errs else None,
            "within_20_percent": sum(abs(e) <= 0.2 for e in errs),
        }  # fmt: skip
    return out


def lines(rows: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    """The section ``refdl bench published`` prints."""
    out = ["memory per device (refdl predict's memory_bytes against the source's GiB):"]
    for r in rows:
        tag = "" if r["eager"] else "  (compiled/float8)"
        out.append(f"  {r['id']:34s} {r['mesh']:28s} published {r['published_gib']:6.1f}  "
                   f"refdl {r['predicted_gib']:6.1f}  {100 * r['error']:+6.1f} %{tag}")  # fmt: skip
    for name, v in s.items():
        if v["n"]:
            out.append(f"  {name}, {v['n']} rows: median |err| "
                       f"{100 * v['median_abs_error']:.1f} %, max "
                       f"{100 * v['max_abs_error']:.1f} %, median "
                       f"{100 * v['median_error']:+.1f} %, within 20 %: "
                       f"{v['within_20_percent']} of {v['n']}")  # fmt: skip
    return out
