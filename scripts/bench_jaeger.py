"""Jaeger et al.'s experiment at this machine's scale: asynchronous parameter servers in
TensorFlow, MXNet and refdl, side by side.

LeNet-5 on 28x28 images (the embedded digits, each pixel enlarged 3x3 and centred
in MNIST's frame: ``--data-opt size=28``), asynchronous data parallelism with one
parameter server and W = 1, 2, 3 workers, every one a process on loopback:

- TensorFlow ``ParameterServerStrategy`` (a ps task, W worker tasks, the chief's
  ``ClusterCoordinator``), through ``refdl.adapters.tensorflow``;
- MXNet KVStore ``dist_async`` (a scheduler, a server, W workers), through
  ``refdl.adapters.mxnet`` in ``.venv-mxnet``;
- refdl ``ps --ps-mode async`` under ``mpirun`` (rank 0 the server, W workers).

Each worker takes ``--batch`` samples per update and the run stops after the same
number of samples for every W (``--samples``), so test accuracy compares at equal
work. Throughput is samples over the wall time of the updates; speedup is
``throughput_W / throughput_1`` and efficiency speedup / W (Jaeger et al.'s
definitions). refdl's prediction for the ``local`` profile stands beside them.
Everything runs in this one invocation, framework by framework for each W.

    .venv/bin/python scripts/bench_jaeger.py --out docs/bench/jaeger

Writes ``jaeger.json``, ``jaeger.md`` and ``jaeger.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
DATA_OPTS = (("size", "28"),)
ROOT = Path(__file__).resolve().parents[1]


def framework_row(fw: str, w: int, args, ref) -> dict:
    from refdl.adapters import process
    from refdl.adapters.exchange import staleness
    from refdl.validate.asynchronous import accuracy_of, histogram
    from refdl.validate.exact import job_of

    steps = args.samples // (w * args.batch)
    job = job_of(ref, "ps", 1, w, "async")
    job["lrs"] = job["lrs"][:steps]
    t0 = time.perf_counter()
    result, params, _ = process.run(fw, job, ref.init_params, ref.batches[:steps], args.timeout)
    total = time.perf_counter() - t0
    spec = spec_of(args, w, steps, "single")
    acc = accuracy_of(spec, params)
    samples = steps * w * args.batch
    return {
        "system": fw, "workers": w, "updates": len(result["updates"]), "samples": samples,
        "samples_per_s": samples / result["wall_s"], "wall_s": result["wall_s"],
        "process_s": total, "test_accuracy": acc["test_accuracy"],
        "staleness": histogram(staleness([tuple(u) for u in result["updates"]])),
        "impl": result["impl"],
    }  # fmt: skip


def spec_of(args, w: int, steps: int, strategy: str, **kw):
    from refdl.config.spec import RunSpec

    return RunSpec(strategy=strategy, model="lenet5", data_opts=DATA_OPTS, steps=steps,
                   batch_size=w * args.batch, optimizer="momentum", lr=args.lr, progress=False,
                   **kw)  # fmt: skip


def refdl_row(w: int, args) -> dict:
    """refdl ps async under mpirun: 1 server + w workers."""
    steps = args.samples // (w * args.batch)
    with tempfile.TemporaryDirectory(prefix="refdl-jaeger-") as out:
        cmd = [str(ROOT / ".venv" / "bin" / "refdl"), "launch", "-n", str(w + 1), "train",
               "--strategy", "ps", "--ps-mode", "async", "--model", "lenet5",
               "--data-opt", "size=28", "--batch-size", str(w * args.batch), "--steps", str(steps),
               "--optimizer", "momentum", "--lr", str(args.lr), "--eval-every", "0",
               "--checkpoint-every", "0", "--log-every", "0", "--out", out]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"refdl launch failed: {proc.stderr.strip().splitlines()[-1:]}")
        s = json.loads((Path(out) / "summary.json").read_text())
    return {
        "system": "refdl", "workers": w, "updates": steps * w, "samples": steps * w * args.batch,
        "samples_per_s": s["samples_per_second"], "wall_s": s.get("wall_time_s"),
        "test_accuracy": s["test_accuracy"],
        "staleness": s.get("staleness_updates_histogram", s.get("staleness_histogram")),
        "impl": f"refdl ps async under mpirun (1 server, {w} workers)",
    }  # fmt: skip


def predicted_row(w: int, args) -> dict:
    from refdl.hw.profile import load as load_profile
    from refdl.perf import PredictOptions
    from refdl.perf.costs import formula_of
    from refdl.perf.model_cost import model_cost
    from refdl.strategies import traits_of

    m = model_cost("lenet5", DATA_OPTS)
    opts = PredictOptions(ps_mode="async", servers=1, optimizer_words=1)
    c = formula_of(traits_of("ps"))(m, load_profile("local"), w * args.batch, w, opts)
    return {"system": "refdl predicted (local)", "workers": w,
            "samples_per_s": w * args.batch / c.step_time_s}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/jaeger")
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--batch", type=int, default=32, help="samples per worker per update")
    ap.add_argument("--samples", type=int, default=19200, help="samples trained, every W")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--systems", default="tensorflow,mxnet,refdl")
    args = ap.parse_args(argv)
    workers = [int(x) for x in args.workers.split(",")]
    systems = args.systems.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from refdl.validate.exact import reference_run

    rows = []
    for w in workers:
        steps = args.samples // (w * args.batch)
        ref = reference_run(spec_of(args, w, steps, "single"), plain_layers=True)
        for system in systems:
            row = refdl_row(w, args) if system == "refdl" else framework_row(system, w, args, ref)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("system", "workers", "samples_per_s",
                                                   "test_accuracy")}), file=sys.stderr)  # fmt: skip
        rows.append(predicted_row(w, args))
    for system in {r["system"] for r in rows}:
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r["workers"])
        base = mine[0]["samples_per_s"] / mine[0]["workers"]
        for r in mine:
            r["speedup"] = r["samples_per_s"] / base
            r["efficiency"] = r["speedup"] / r["workers"]
    meta = {"command": "scripts/bench_jaeger.py " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "batch": args.batch,
            "samples": args.samples, "lr": args.lr}  # fmt: skip
    (out / "jaeger.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "jaeger.md").write_text(table(rows))
    plot(rows, out / "jaeger.png")
    print(table(rows))
    return 0


def staleness_text(histogram: dict | None) -> str:
    """``mean / max`` of a staleness histogram ``{"k": count}``."""
    if not histogram:
        return "-"
    n = sum(histogram.values())
    mean = sum(int(k) * v for k, v in histogram.items()) / n
    return f"{mean:.2f} / {max(int(k) for k in histogram)}"


def table(rows: list[dict]) -> str:
    lines = ["| system | W | samples/s | speedup | efficiency | test accuracy "
             "| staleness mean / max (updates) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["system"], r["workers"])):
        acc = f"{r['test_accuracy']:.3f}" if "test_accuracy" in r else "-"
        lines.append(f"| {r['system']} | {r['workers']} | {r['samples_per_s']:.0f} | "
                     f"{r['speedup']:.2f} | {r['efficiency']:.2f} | {acc} | "
                     f"{staleness_text(r.get('staleness'))} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    a, b = fig.subplots(1, 2)
    for system in sorted({r["system"] for r in rows}):
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r["workers"])
        ws = [r["workers"] for r in mine]
        style = "--" if "predicted" in system else "o-"
        a.plot(ws, [r["samples_per_s"] for r in mine], style, label=system)
        b.plot(ws, [r["efficiency"] for r in mine], style, label=system)
    every = sorted({r["workers"] for r in rows})  # a count: whole ticks only
    for ax in (a, b):
        ax.set_xticks(every)
    a.set_ylim(bottom=0)  # (from 0, so a difference reads as drawn)
    a.set_xlabel("workers W")
    a.set_ylabel("samples/s")
    b.set_xlabel("workers W")
    b.set_ylabel("efficiency (speedup / W)")
    b.set_ylim(0, 1.3)
    a.legend(fontsize=8)
    fig.suptitle("LeNet-5 28x28, asynchronous parameter server, 1 server + W workers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
