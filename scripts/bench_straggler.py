"""A persistent straggler, measured under mpirun against ``refdl.perf.straggler``'s price.

For each mode (ps sync, async, ssp, softsync; decentralized) the same short run twice
under real MPI processes, without and with ``--straggler RANK:SECONDS``. The run without
gives ``t``, the median time of a step's worth of gradients (the server's ``ps_step_s``,
W gradients; decentralized's step); the run with gives the measured step, the mean (a
rate, as the prediction is) of its steady part (``steady``: not the start, nor the tail
where the fast workers of an async run have finished their clocks and only the
straggler is left). The prediction is
``straggled(t, s, n)`` with the mode's ``n`` (``refdl.perf.straggler.groups``): the
mechanism (who waits for whom), not this machine's compute, is what is checked.

    .venv/bin/python scripts/bench_straggler.py --out docs/bench/straggler

Writes ``straggler.json`` and ``straggler.png`` in ``--out``. On the 2-core box each run
starts 4-5 processes: about 10 minutes in all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from refdl.perf.straggler import groups, straggled  # noqa: E402

VENV = ROOT / ".venv" / "bin"
# (name, ranks, flags, cost formula, ps mode, softsync n, workers)
MODES = [
    ("ps sync", 5, ["--strategy", "ps", "--ps-mode", "sync"], "parameter_server", "sync", None),
    ("ps async", 5, ["--strategy", "ps", "--ps-mode", "async"], "parameter_server", "async", None),
    ("ps ssp S=2", 5, ["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "2"],
     "parameter_server", "ssp", None),
    ("ps softsync n=2", 5, ["--strategy", "ps", "--ps-mode", "softsync", "--softsync-n", "2"],
     "parameter_server", "softsync", 2),
    ("decentralized ring", 4, ["--strategy", "decentralized"], "gossip", "sync", None),
]  # fmt: skip


def run(ranks: int, flags: list[str], steps: int, out: Path) -> list[dict]:
    """One ``refdl train`` under ``mpirun -n ranks``; its metrics.jsonl lines."""
    cmd = [str(VENV / "refdl"), "launch", "-n", str(ranks), "train", *flags,
           "--steps", str(steps), "--batch-size", "48", "--log-every", "1",
           "--no-progress", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True, text=True)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


def step_times(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics if key in m]


def steady(steps: list[float], slowest: float) -> list[float]:
    """The steady part of a run with a straggler: without its first two steps (compiling,
    starting) and its tail, where the fast workers have run their clocks and the
    straggler alone supplies a step's W gradients (each step then over 2.5 x its own
    ``t + s``); of what is left, the middle half (the warm-up's transient out)."""
    body = steps[2:]
    while len(body) > 4 and body[-1] > 2.5 * slowest:
        body.pop()
    return body[len(body) // 4 : max(len(body) // 4 + 1, 3 * len(body) // 4)]


def shared_cores(t: float, seconds: float, n: int) -> float:
    """The prediction where the workers share this machine's cores (a reading of the
    measurements, not the model): ``t`` was measured with all W computing, but in the
    steady state of ``n`` > 1 groups the straggler's group of W/n waits, so the others
    compute on the cores it leaves: ``t (1 - 1/n)`` each."""
    return straggled(t * (1 - 1 / n), seconds, n) if n > 1 else straggled(t, seconds, n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/bench/straggler")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=0.1, help="the straggler's delay")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    began = time.time()
    for name, ranks, flags, cost, mode, n_soft in MODES:
        key = "ps_step_s" if cost == "parameter_server" else "step_time_s"
        first = 1 if cost == "parameter_server" else 0
        workers = ranks - first
        with tempfile.TemporaryDirectory() as tmp:
            plain = step_times(run(ranks, flags, args.steps, Path(tmp) / "a"), key)
            lagged = step_times(
                run(ranks, [*flags, "--straggler", f"{first + 1}:{args.seconds}"], args.steps,
                    Path(tmp) / "b"), key)  # fmt: skip
        t = statistics.median(plain[2:])
        window = steady(lagged, t + args.seconds)
        measured = statistics.fmean(window)  # a rate: the window's time over its steps
        n = groups(cost, mode, n_soft, workers)
        predicted = straggled(t, args.seconds, n)
        rows.append({"mode": name, "ranks": ranks, "workers": workers, "groups": n,
                     "t_s": t, "straggler_s": args.seconds, "measured_s": measured,
                     "measured_median_s": statistics.median(window),
                     "predicted_s": predicted, "error": predicted / measured - 1,
                     "predicted_shared_cores_s": shared_cores(t, args.seconds, n),
                     "sync_would_be_s": t + args.seconds,
                     "steps_s": plain, "steps_with_straggler_s": lagged})  # fmt: skip
        print(f"{name:20s} t {t * 1e3:7.2f} ms  with straggler: measured {measured * 1e3:7.2f} "
              f"ms, predicted {predicted * 1e3:7.2f} ms ({predicted / measured - 1:+.1%}; "
              f"{shared_cores(t, args.seconds, n) * 1e3:.2f} ms on shared cores)",
              flush=True)  # fmt: skip
    result = {
        "command": "scripts/bench_straggler.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, CPU only",
        "seconds": time.time() - began,
        "rows": rows,
        "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
        "median_abs_error_shared_cores": statistics.median(
            abs(r["predicted_shared_cores_s"] / r["measured_s"] - 1) for r in rows
        ),
    }
    (out / "straggler.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, out / "straggler.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = range(len(rows))
    w = 0.27
    for i, (key, label) in enumerate((("t_s", "no straggler (t)"),
                                      ("measured_s", "straggler: measured"),
                                      ("predicted_s", "straggler: predicted"))):  # fmt: skip
        ax.bar([j + (i - 1) * w for j in x], [r[key] * 1e3 for r in rows], w, label=label)
    ax.set_xticks(list(x), [r["mode"] for r in rows], fontsize=8)
    ax.set_ylabel("ms per step of W gradients")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
