"""Plots written to files: the executed pipeline schedule as a Gantt chart, predicted
scaling, and side-by-side throughput.

matplotlib's object interface (``Figure``) draws without a display and without
choosing a global backend, so importing this module changes nothing for a user
who also plots interactively.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

Timeline = list[tuple[int, str, float, float]]  # (stage, op name, start s, end s)
OP_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def save(fig: Figure, path: str | Path, dpi: int = 120) -> Path:
    """Lay out and write ``fig``; the parent folder is made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return path


def gantt(timeline: Timeline, stages: int, path: str | Path, title: str = "") -> Path:
    """Stages as rows; forward (blue), backward (orange; with a split backward: input
    gradient B orange, weight gradient W green) bars with microbatch numbers; white is
    idle. Times in milliseconds from the step's start."""
    end = max((e for _, _, _, e in timeline), default=1.0)
    # at most 16 in wide (1760 px): a long schedule's labels shrink rather than the page grow
    width = min(16.0, max(8.0, len(timeline) * 0.25))
    fig = Figure(figsize=(width, 0.6 * stages + 2.1))
    ax = fig.subplots()
    for stage, name, start, stop in timeline:
        ax.barh(stage, (stop - start) * 1e3, left=start * 1e3, color=OP_COLORS.get(name[0], "grey"),
                edgecolor="black", linewidth=0.5)  # fmt: skip
        ax.text((start + stop) / 2 * 1e3, stage, name[1:], ha="center", va="center",
                fontsize=7 if width < 16 else 5, color="white")  # fmt: skip
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1e3)
    ax.set_xlabel("time in step (ms)")
    kinds = sorted({name[0] for _, name, _, _ in timeline})
    legend = {"F": "blue forward", "B": "orange backward", "W": "green weight gradient"}
    ax.set_title(  # the Recorder's timing (refdl.strategies.pipeline_walk)
        f"{title}  ({', '.join(legend.get(k, k) for k in kinds)}, white idle)\n"
        "label: microbatch[.chunk]; a bar starts with its slot of the schedule table\n"
        "and ends when it is seen done, stage by stage: it can look longer than it ran",
        fontsize=9,
    )
    return save(fig, path, dpi=110)


def run_schedule(summary: dict[str, Any], path: str | Path) -> Path | None:
    """A pipeline run's last executed step (its folder's ``timeline.json``) as a Gantt
    chart; None when the run recorded no pipeline timeline."""
    import json

    record = Path(summary["run_dir"]) / "timeline.json"
    if not record.is_file():
        return None
    data = json.loads(record.read_text())  # refdl's own record of the run
    title = (f"{summary.get('schedule')}, {summary.get('stages')} stages, "
             f"{summary.get('microbatches')} mb")  # fmt: skip
    return gantt(data["timeline"], data["stages"], path, title)


def scaling(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Predicted speed-up and efficiency against workers, with the ideal line."""
    ps = [r["workers"] for r in rows]
    fig = Figure(figsize=(9, 3.5))
    a, b = fig.subplots(1, 2)
    a.loglog(ps, [r["speedup"] for r in rows], "o-", label="predicted")
    a.loglog(ps, ps, "k--", lw=0.8, label="ideal")
    a.set_xlabel("workers")
    a.set_ylabel("speed-up")
    a.legend()
    b.semilogx(ps, [r["efficiency"] for r in rows], "o-")
    b.set_ylim(0, 1.05)
    b.set_xlabel("workers")
    b.set_ylabel("efficiency")
    r0 = rows[0]
    fig.suptitle(f"{r0['model']} / {r0['strategy']} on {r0['hw']}")
    return save(fig, path)


def throughput(result: dict[str, Any], frameworks: tuple[str, ...], path: str | Path) -> Path:
    """samples/s against devices, one line per framework (``bench compare``)."""
    fig = Figure(figsize=(5, 3.5))
    ax = fig.subplots()
    devices = [r["devices"] for r in result["rows"]]
    for f in frameworks:
        key = f"{f}_samples_per_s"
        if key in result["rows"][0]:
            ax.plot(devices, [r[key] for r in result["rows"]], marker="o", label=f)
    ax.set_xlabel("devices / processes")
    ax.set_ylabel("samples/s")
    ax.set_xticks(devices)
    ax.set_title(f"{result['model']} {result['strategy']}, batch {result['global_batch']}")
    ax.legend()
    return save(fig, path)


def published(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Predicted against published, log-log: collective, step and parallel-run times (s)
    on the left, scaling efficiencies on the right; held-out points filled, calibration
    hollow."""
    fig = Figure(figsize=(11, 4.8))
    a, b = fig.subplots(1, 2)
    colors = {"collective": "tab:blue", "step": "tab:orange", "scaling": "tab:green",
              "parallel": "tab:purple"}  # fmt: skip
    for ax, kinds in ((a, ("collective", "step", "parallel")), (b, ("scaling",))):
        lo, hi = math.inf, 0.0
        for kind in kinds:
            for part in ("calibration", "heldout"):
                pts = [(r["published"], r["predicted"]) for r in rows
                       if r["kind"] == kind and r["part"] == part and "error" in r]  # fmt: skip
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
                ax.scatter(xs, ys, s=22, label=f"{kind} ({part})", edgecolors=colors[kind],
                           facecolors=colors[kind] if part == "heldout" else "none")  # fmt: skip
        if ax is b:  # efficiencies lie in (0, 1]: linear axes show their spread
            lo, hi = 0.0, 1.1
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            for f in (0.8, 1.25):
                ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.6)
        if ax is a:
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
        ax.legend(fontsize=7, loc="upper left")
    a.set_xlabel("published time (s)")
    a.set_ylabel("predicted time (s)")
    a.set_title("collectives, single-device steps, parallel runs (dotted: ±20 %)")
    b.set_xlabel("published efficiency")
    b.set_ylabel("predicted efficiency")
    b.set_title("data-parallel scaling efficiency (dotted: ±20 %)")
    b.text(0.98, 0.02, "above the diagonal: refdl predicts better scaling than was published;\n"
           "a row of points: one predicted efficiency for runs the source measured apart",
           transform=b.transAxes, ha="right", va="bottom", fontsize=7)  # fmt: skip
    return save(fig, path)
