"""Plots: the executed pipeline schedule as a Gantt chart."""

from __future__ import annotations

from pathlib import Path

Timeline = list[tuple[int, str, float, float]]  # (stage, op name, start s, end s)


def gantt(timeline: Timeline, stages: int, path: str | Path, title: str = "") -> Path:
    """Stages as rows, forward (blue) / backward (orange) bars with microbatch numbers;
    white is idle. Times in milliseconds from the step's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max((e for _, _, _, e in timeline), default=1.0)
    fig, ax = plt.subplots(figsize=(max(8, len(timeline) * 0.25), 0.6 * stages + 1.5))
    for stage, name, start, stop in timeline:
        color = "tab:blue" if name.startswith("F") else "tab:orange"
        ax.barh(
            stage,
            (stop - start) * 1e3,
            left=start * 1e3,
            color=color,
            edgecolor="black",
            linewidth=0.5,
        )
        ax.text(
            (start + stop) / 2 * 1e3,
            stage,
            name[1:],
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1e3)
    ax.set_xlabel("time in step (ms)")
    ax.set_title(title + "  (blue forward, orange backward, white idle)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
