"""Plots written to files: the executed pipeline schedule as a Gantt chart, predicted
scaling, and side-by-side throughput.

matplotlib's object interface (``Figure``) draws without a display and without
choosing a global backend, so importing this module changes nothing for a user
who also plots interactively.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

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
    # at most 16 in wide (1760 px): a bar too narrow for its label goes without it
    width = min(16.0, max(8.0, len(timeline) * 0.25))
    fig = Figure(figsize=(width, 0.6 * stages + 2.1))
    ax = fig.subplots()
    axes_px = 0.85 * width * 110  # the plot's width at the saved 110 dpi
    for stage, name, start, stop in timeline:
        ax.barh(stage, (stop - start) * 1e3, left=start * 1e3, color=OP_COLORS.get(name[0], "grey"),
                edgecolor="black", linewidth=0.5)  # fmt: skip
        if (stop - start) / end * axes_px >= 7 * len(name[1:]) + 2:  # 8 pt: ~7 px a character
            ax.text((start + stop) / 2 * 1e3, stage, name[1:], ha="center", va="center",
                    fontsize=8, color="white")  # fmt: skip
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1e3)
    ax.set_xlabel("time in step (ms)")
    kinds = sorted({name[0] for _, name, _, _ in timeline}, key="FBW".find)
    legend = {"F": "blue forward", "B": "orange backward", "W": "green weight gradient"}
    ax.set_title(  # the Recorder's timing (refdl.strategies.pipeline_walk)
        f"{title}  ({', '.join(legend.get(k, k) for k in kinds)}, white idle)\n"
        "label: microbatch[.chunk] (left out where a bar is too narrow); one traced step: the "
        "host waits for\nevery operation, so it is longer than an untimed step; a bar starts "
        "with its slot of the schedule\ntable and ends when it is seen done, stage by stage: "
        "it can look longer than it ran",
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
    """samples/s against devices, one line per framework (``bench compare``); one device
    count: a bar per framework. The axis starts at 0, so a ratio reads as drawn."""
    fig = Figure(figsize=(5, 3.5))
    ax = fig.subplots()
    devices = [r["devices"] for r in result["rows"]]
    shown = [f for f in frameworks if f"{f}_samples_per_s" in result["rows"][0]]
    if len(devices) == 1:
        values = [result["rows"][0][f"{f}_samples_per_s"] for f in shown]
        ax.bar(shown, values, color=[f"C{i}" for i in range(len(shown))])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_xlabel(f"{devices[0]} device{'s' * (devices[0] > 1)}")
        ax.set_ylim(0, 1.12 * max(values, default=1.0))  # (room for the numbers)
    else:
        for f in shown:
            ax.plot(devices, [r[f"{f}_samples_per_s"] for r in result["rows"]], marker="o",
                    label=f)  # fmt: skip
        ax.set_xlabel("devices / processes")
        ax.set_xticks(devices)
        ax.legend()
    ax.set_ylim(bottom=0)
    ax.set_ylabel("samples/s")
    when = f", {result['date']}" if "date" in result else ""
    ax.set_title(f"{result['model']} {result['strategy']}, batch {result['global_batch']}{when}")
    return save(fig, path)


def published(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Left: predicted / published time against published time (s), log-log, for
    collectives, single-device steps and parallel runs, so a ±20 % band is visible over
    nine decades. Right: scaling efficiencies, predicted against published. Held-out
    points filled, calibration hollow."""
    fig = Figure(figsize=(11, 4.8))
    a, b = fig.subplots(1, 2)
    colors = {"collective": "tab:blue", "step": "tab:orange", "scaling": "tab:green",
              "parallel": "tab:purple"}  # fmt: skip
    ratios = [1.0]
    for ax, kinds in ((a, ("collective", "step", "parallel")), (b, ("scaling",))):
        for kind in kinds:
            for part in ("calibration", "heldout"):
                pts = [(r["published"], r["predicted"]) for r in rows
                       if r["kind"] == kind and r["part"] == part and "error" in r]  # fmt: skip
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                if ax is a:
                    ys = tuple(y / x for x, y in pts)
                    ratios += ys
                ax.scatter(xs, ys, s=22, label=f"{kind} ({part})", edgecolors=colors[kind],
                           facecolors=colors[kind] if part == "heldout" else "none")  # fmt: skip
        ax.legend(fontsize=8, loc="upper left")
    a.set_xscale("log")
    a.set_yscale("log")
    for f, style in ((1.0, "k--"), (0.8, "k:"), (1.25, "k:")):
        a.axhline(f, color="k", ls=style[1:], lw=0.8)
    a.set_ylim(min(0.2, min(ratios) / 1.2), max(5.0, max(ratios) * 1.2))  # every point shown
    a.set_yticks([0.25, 0.5, 0.8, 1, 1.25, 2, 4], ["0.25", "0.5", "0.8", "1", "1.25", "2", "4"])
    a.yaxis.set_minor_formatter(NullFormatter())
    a.set_xlabel("published time (s)")
    a.set_ylabel("predicted / published time")
    a.set_title("collectives, single-device steps, parallel runs\n(dotted: ±20 %; above 1: "
                "refdl predicts slower than was published)", fontsize=10)  # fmt: skip
    b.plot([0, 1.1], [0, 1.1], "k--", lw=0.8)
    for f in (0.8, 1.25):
        b.plot([0, 1.1], [0, 1.1 * f], "k:", lw=0.6)
    b.set_xlim(0, 1.1)
    b.set_ylim(0, 1.1)
    b.set_xlabel("published efficiency")
    b.set_ylabel("predicted efficiency")
    b.set_title("data-parallel scaling efficiency (dotted: ±20 %)\nabove the diagonal: refdl "
                "predicts better scaling than was published", fontsize=10)  # fmt: skip
    b.text(0.98, 0.02, "a row of points near 1: one predicted efficiency for runs\n"
           "the source measured apart (its overheads are not in the model)",
           transform=b.transAxes, ha="right", va="bottom", fontsize=9)  # fmt: skip
    return save(fig, path)
