"""Benchmark pipeline schedules: measured vs analytic bubble, step time, activation memory.

For P in {2, 4} stages and M in {1, 2, 4, 8, 16} microbatches, GPipe, 1F1B,
interleaved 1F1B (2 chunks per device; needs M divisible by P), looped BFS (2
chunks), ZB-H1 and ZB-V (the zero-bubble schedules, backward split into B and W) and
DualPipeV (ZB-V's V with overlapped forward/backward pairs, M >= 2P)
train LeNet-5 on digits on simulated CPU devices, all in this one process. Each
configuration runs ``--steps`` steps after a compile step; the measured bubble
is the median over them.

    .venv/bin/python scripts/bench_pipeline.py --out bench_out/pipeline

Writes ``bench_pipeline.json``, ``bubble.png`` (measured vs analytic),
``step_time.png``, ``memory.png`` and ``gantt_P4_M8_{1f1b,zb-h1,zbv,dualpipev}.png`` (F blue,
B orange, W green).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

SCHEDULES = (
    ("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped-bfs", 2), ("zb-h1", 1), ("zbv", 1),
    ("dualpipev", 1),
)  # fmt: skip
GANTT = ("1f1b", "zb-h1", "zbv", "dualpipev")  # drawn for P = 4, M = 8
# |measured - analytic| bubble allowed on simulated CPU devices (README explains the gap).
TOLERANCE = 0.12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/pipeline")
    ap.add_argument("--model", default="lenet5")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES),
                    help="comma-separated schedules to run (default: all)")  # fmt: skip
    ap.add_argument("--gantt-only", action="store_true",
                    help="run only P = 4, M = 8 and redraw its Gantt charts (no JSON)")  # fmt: skip
    ap.add_argument("--replot", action="store_true",
                    help="redraw bubble/step_time/memory.png from --out's bench_pipeline.json "
                         "(nothing is run)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.replot:
        plots(json.loads((Path(args.out) / "bench_pipeline.json").read_text())["results"],
              Path(args.out))  # fmt: skip
        return 0
    chosen = args.schedules.split(",")
    unknown = sorted(set(chosen) - {s for s, _ in SCHEDULES})
    if unknown:
        ap.error(f"--schedules: unknown {', '.join(unknown)}; choose from "
                 f"{', '.join(s for s, _ in SCHEDULES)}")  # fmt: skip

    from refdl.config.spec import RunSpec
    from refdl.parallel.schedule import analytic_bubble
    from refdl.plots import gantt
    from refdl.run.build import build
    from refdl.run.trajectory import trajectory

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for p in (4,) if args.gantt_only else (2, 4):
        for m in (8,) if args.gantt_only else (1, 2, 4, 8, 16):
            for sched, v in SCHEDULES:
                if args.gantt_only and sched not in GANTT:
                    continue
                if sched not in chosen or (sched == "interleaved" and m % p):
                    continue
                if sched == "dualpipev" and m < 2 * p:  # its least, as in PyTorch
                    continue
                spec = RunSpec(
                    strategy="pipeline",
                    devices=p,
                    microbatches=m,
                    schedule=sched,
                    chunks=v,
                    model=args.model,
                    batch_size=args.batch_size,
                    progress=False,
                )
                run = build(spec)
                strat = run.strategy
                history = {"bubble_fraction_measured": []}
                times = []
                state = strat.init_state(0)
                for step in trajectory(run, state, 0, args.steps + 1, per_step=True):
                    state, metrics = step.state, step.metrics
                    if "bubble_fraction_measured" in metrics:  # a step timed op by op
                        history["bubble_fraction_measured"].append(
                            metrics["bubble_fraction_measured"]
                        )
                        timeline = metrics["timeline"]
                    history["peak_activation_bytes_per_stage"] = metrics[
                        "peak_activation_bytes_per_stage"
                    ]
                    if step.done > 1:  # the first step compiles
                        times.append(step.seconds)
                s = strat.summary(history)
                row = {
                    "schedule": sched,
                    "stages": p,
                    "microbatches": m,
                    "chunks": strat.schedule.chunks,
                    "bubble_analytic": s["bubble_fraction_analytic"],
                    "bubble_closed_form": analytic_bubble(sched, p, m, strat.schedule.chunks),
                    "bubble_measured": s["bubble_fraction_measured"],
                    "step_time_median_s": statistics.median(times),
                    "peak_stash_per_stage": s["peak_stash_per_stage"],
                    "peak_activation_bytes_per_stage": s["peak_activation_bytes_per_stage"],
                    "slots": strat.schedule.slots,
                }
                results.append(row)
                print(
                    f"P={p} M={m:2d} {sched:11s} bubble analytic {row['bubble_analytic']:.3f} "
                    f"measured {row['bubble_measured']:.3f}  step "
                    f"{row['step_time_median_s'] * 1e3:7.1f} ms  peak act "
                    f"{max(row['peak_activation_bytes_per_stage'])} B",
                    file=sys.stderr,
                )
                if (p, m) == (4, 8) and sched in GANTT:
                    gantt(
                        timeline,
                        p,
                        out / f"gantt_P4_M8_{sched}.png",
                        f"{sched}, 4 stages, 8 microbatches (executed)",
                    )
    if args.gantt_only:
        return 0
    errors = [abs(r["bubble_measured"] - r["bubble_analytic"]) for r in results]
    meta = {
        "model": args.model,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "cpus": os.cpu_count(),
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "tolerance_abs": TOLERANCE,
        "within_tolerance": all(e <= TOLERANCE for e in errors),
    }
    (out / "bench_pipeline.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1)
    )
    plots(results, out)
    print(json.dumps(meta), file=sys.stderr)
    return 0


def plots(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"gpipe": "tab:blue", "1f1b": "tab:orange", "interleaved": "tab:green",
              "looped-bfs": "tab:brown", "zb-h1": "tab:red", "zbv": "tab:purple",
              "dualpipev": "tab:olive"}  # fmt: skip
    for key, ylabel, fname in (
        ("bubble", "bubble fraction (dashed: analytic, solid: measured)", "bubble.png"),
        ("step_time_median_s", "median step time (ms)", "step_time.png"),
        (
            "peak_activation_bytes_per_stage",
            "peak held activations, most loaded stage (bytes)",
            "memory.png",
        ),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, p in zip(axes, (2, 4), strict=True):
            for sched, color in colors.items():
                rows = [r for r in results if r["stages"] == p and r["schedule"] == sched]
                if not rows:  # (a run of some schedules: the others are not in the legend)
                    continue
                ms = [r["microbatches"] for r in rows]
                if key == "bubble":
                    ax.plot(
                        ms,
                        [r["bubble_analytic"] for r in rows],
                        "--",
                        color=color,
                        label="_nolegend_",
                    )
                    ax.plot(
                        ms,
                        [r["bubble_measured"] for r in rows],
                        "o-",
                        color=color,
                        label=sched,
                    )
                elif key == "step_time_median_s":
                    ax.plot(ms, [r[key] * 1e3 for r in rows], "o-", color=color, label=sched)
                else:
                    ax.plot(ms, [max(r[key]) for r in rows], "o-", color=color, label=sched)
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
            ax.set_xlabel("microbatches M")
            ax.set_ylabel(ylabel)
            ax.set_title(f"P = {p} stages")
            ax.legend(fontsize=8, ncol=2 if key == "bubble" else 1)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
