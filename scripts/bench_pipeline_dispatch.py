"""The pipeline executor dispatching the whole table before waiting, against waiting slot by
slot (issue 21 item 3): step time and measured bubble beside the analytic one.

Both modes run in this process, alternating ``--rounds`` times, on simulated CPU
devices (one per stage); the slot-by-slot mode is the executor with
``Pipeline.dispatch_ahead`` forced off, as it ran before.

    .venv/bin/python scripts/bench_pipeline_dispatch.py --out docs/bench/pipeline/dispatch.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from refdl.parallel.processes import simulate_devices


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,lenet5")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    simulate_devices(max(stages))

    from refdl.config.spec import RunSpec
    from refdl.run.build import build
    from refdl.run.trajectory import trajectory
    from refdl.strategies.pipeline import Pipeline

    def measure(model: str, p: int, schedule: str, ahead: bool) -> tuple[list, list, float]:
        Pipeline.dispatch_ahead = property(lambda self: ahead)  # type: ignore[assignment]
        spec = RunSpec(strategy="pipeline", model=model, devices=p, stages=p, schedule=schedule,
                       steps=args.steps, batch_size=64, progress=False)  # fmt: skip
        run = build(spec)
        state = run.strategy.init_state(0)
        times, bubbles = [], []
        for out in trajectory(run, state, 0, args.steps, per_step=True):
            if out.done > 5:
                times.append(out.seconds)
                if "bubble_fraction_measured" in out.metrics:  # the steps it timed op by op
                    bubbles.append(float(out.metrics["bubble_fraction_measured"]))
        return times, bubbles, run.strategy.schedule.bubble_fraction

    rows = []
    for model in args.models.split(","):
        for p in stages:
            for schedule in args.schedules.split(","):
                got: dict[str, tuple[list, list]] = {"ahead": ([], []), "slot": ([], [])}
                analytic = 0.0
                for _ in range(args.rounds):
                    for mode in ("slot", "ahead"):
                        t, b, analytic = measure(model, p, schedule, mode == "ahead")
                        got[mode][0].extend(t)
                        got[mode][1].extend(b)
                row = {"model": model, "stages": p, "schedule": schedule,
                       "bubble_analytic": analytic}  # fmt: skip
                for mode, (t, b) in got.items():
                    row[f"{mode}_step_ms"] = 1e3 * statistics.median(t)
                    row[f"{mode}_bubble_measured"] = statistics.median(b)
                row["speedup"] = row["slot_step_ms"] / row["ahead_step_ms"]
                rows.append(row)
                print(f"{model} x{p} {schedule}: slot {row['slot_step_ms']:.2f} ms, ahead "
                      f"{row['ahead_step_ms']:.2f} ms ({row['speedup']:.2f}x); bubble analytic "
                      f"{analytic:.3f}, measured slot {row['slot_bubble_measured']:.3f}, ahead "
                      f"{row['ahead_bubble_measured']:.3f}", flush=True)  # fmt: skip
    command = "python scripts/bench_pipeline_dispatch.py " + " ".join(argv or sys.argv[1:])
    result = {"date": datetime.date.today().isoformat(), "command": command, "batch": 64,
              "rows": rows}  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
