"""``loss.png`` of a statistical validation: the framework's smoothed loss over refdl's
seeds (their mean and their range, all smoothed by the same trailing mean), the three
loss windows the rule compares shaded, a departing one in red with its figures; beside
it, the final test accuracies.

matplotlib's object interface (``Figure``) draws without a display and without choosing
a global backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from refdl.validate.statistical import WINDOWS


def loss_plot(r: dict[str, Any], path: Path) -> None:
    """Draw a statistical report ``r`` (``results_report``'s dict) into ``path``."""
    curves = r["seed_curves"]
    window = r["smoothing_window_steps"]
    mean, lo, hi = (np.asarray(curves[k], np.float64) for k in ("mean", "lo", "hi"))
    steps = np.arange(len(mean))
    fig = Figure(figsize=(10, 4.2))
    ax, acc_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [4, 1]})
    ax.fill_between(
        steps, lo, hi, color="tab:blue", alpha=0.2, label=f"refdl, {r['seeds']} seeds: range"
    )
    ax.plot(steps, mean, color="tab:blue", lw=1.5, label="refdl: mean")
    rows = r["band_rows"]
    ax.plot(
        [x["step"] for x in rows],
        [x["framework"] for x in rows],
        color="black",
        lw=1.2,
        label=f"{r['config'].get('framework', 'framework')} (smoothed over {window})",
    )
    stats = {s["name"]: s for s in r["statistics"]}
    n = len(mean)
    for name, a, b in WINDOWS:
        s = stats.get(name, {})
        bad = s.get("departs", False)
        ax.axvspan(a * n, b * n, color="tab:red" if bad else "grey", alpha=0.12 if bad else 0.04)
        if s.get("logged"):
            label = f"{name}\n{s['value']:.3g} vs {s['refdl_mean']:.3g}" + (
                f"\np {s['p_value']:.1g}" if bad else ""
            )
            ax.text(
                (a + b) / 2 * n,
                0.97,
                label,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=8,
                color="tab:red" if bad else "dimgrey",
            )
    finite = [x["framework"] for x in rows if np.isfinite(x["framework"])]
    top = max([*hi[np.isfinite(hi)], *finite] or [1.0])
    bottom = min([*lo[np.isfinite(lo)], *finite] or [1e-3])
    if bottom > 0 and top / bottom > 20:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    verdict = "PASSED" if r["passed"] else "FAILED: " + ", ".join(r["failed"])
    ax.set_title(f"{Path(r['log']).name}: {verdict}", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    acc = stats.get("test_accuracy", {})
    seeds = r["final_test_accuracy"]
    acc_ax.set_title("final test accuracy", fontsize=9)
    if seeds.get("refdl_min") is not None:
        acc_ax.errorbar(
            [0],
            [seeds["refdl_mean"]],
            yerr=[
                [seeds["refdl_mean"] - seeds["refdl_min"]],
                [seeds["refdl_max"] - seeds["refdl_mean"]],
            ],
            fmt="o",
            color="tab:blue",
            capsize=4,
            label="refdl",
        )
    if acc.get("logged"):
        color = "tab:red" if acc["departs"] else "black"
        acc_ax.plot([1], [acc["value"]], "s", color=color, label="framework")
        acc_ax.axhline(acc["interval"][0], color="grey", ls=":", lw=1)
    acc_ax.set_xlim(-0.7, 1.7)
    acc_ax.set_xticks([0, 1], ["refdl", "log"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
