"""Benchmark ZeRO stages 1-3 (``--strategy fsdp``) against plain data parallelism.

Part 1, measured: the five refdl models (their default sizes) on ``--devices``
simulated CPU devices with Adam, for ``data`` and ``fsdp --zero 1|2|3``: bytes
per step counted from the compiled program next to each stage's formula, bytes of
the live parameter and optimizer-state arrays on one device next to the paper's
split, XLA's temporary buffers of the step, and the median step time (the
configurations interleaved round-robin in this one process).

Part 2, predicted (``refdl.predict``'s cost model): memory per device and bytes
per step of the shape-only models at paper scale (``--paper-workers`` GPUs on
``--hw``), with Adam and fp32 state.

    .venv/bin/python scripts/bench_fsdp.py --out bench_out/fsdp

Writes ``bench_fsdp.json``, ``memory.png`` and ``table.md`` (the tables of
``docs/strategies.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

MODELS = ("mlp", "lenet5", "resnet", "transformer", "lstm_lm")
SHAPE_MODELS = ("alexnet", "vgg16", "resnet50", "inception_v3", "gpt2", "lstm_lm_medium")
VARIANTS = (("data", None), ("fsdp", 1), ("fsdp", 2), ("fsdp", 3))


def measure(args) -> list[dict]:
    import jax

    from refdl.config.spec import RunSpec
    from refdl.run.build import build

    runs = []
    for model in args.models.split(","):
        for strategy, zero in VARIANTS:
            kw = {"zero": zero} if zero else {}
            spec = RunSpec(
                strategy=strategy, model=model, devices=args.devices, optimizer="adam",
                batch_size=args.batch_size, progress=False, **kw,
            )  # fmt: skip
            run = build(spec)
            state = run.strategy.init_state(0)
            batch = run.batch(0)
            state, _ = run.strategy.train_step(state, batch)  # compiled already; warm
            jax.block_until_ready(state)
            runs.append({"model": model, "strategy": strategy, "zero": zero, "run": run,
                         "state": state, "times": []})  # fmt: skip
    for _ in range(args.rounds):
        for r in runs:
            for i in range(args.steps):
                t = time.perf_counter()
                r["state"], _ = r["run"].strategy.train_step(r["state"], r["run"].batch(i))
                jax.block_until_ready(r["state"])
                r["times"].append(time.perf_counter() - t)
    rows = []
    for r in runs:
        strat = r["run"].strategy
        summary = strat.summary({})
        row = {
            "model": r["model"],
            "strategy": r["strategy"],
            "zero": r["zero"],
            "devices": args.devices,
            "step_time_median_s": statistics.median(r["times"]),
            "comm_bytes_per_step": summary["comm_bytes_per_step"],
            "comm_bytes_per_step_analytic": summary.get("comm_bytes_per_step_analytic"),
        }
        if r["strategy"] == "fsdp":
            live = strat.extra_metrics(r["state"])
            row.update(
                memory_per_device={
                    "params": live["param_bytes_per_device"],
                    "optimizer_state": live["optimizer_bytes_per_device"],
                    "step_temp": strat.temp_bytes,
                },
                memory_per_device_analytic=strat.analytic_memory(),
                padded_param_bytes=strat.padded_param_bytes(),
            )
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "memory_per_device_analytic"}),
              file=sys.stderr)  # fmt: skip
    return rows


def predict(args) -> list[dict]:
    from refdl.perf import PredictOptions
    from refdl.perf.prediction import predict_steps
    from refdl.strategies import traits_of

    rows = []
    for model in SHAPE_MODELS:
        for strategy, zero in VARIANTS:
            opts = PredictOptions(optimizer_words=2, microbatches=1, zero=zero or 3)
            (row,) = predict_steps(args.hw, strategy, traits_of(strategy), model, args.paper_batch,
                                   [args.paper_workers], "strong", opts)  # fmt: skip
            rows.append({"model": model, "strategy": strategy, "zero": zero,
                         "workers": args.paper_workers, "params": row["params"],
                         "memory_bytes": row["memory_bytes"], "step_ms": row["step_time_s"] * 1e3,
                         "comm_ms": row["comm_s"] * 1e3})  # fmt: skip
    return rows


def table(measured: list[dict], predicted: list[dict], args) -> str:
    mb = 1 / 2**20
    lines = [
        f"Measured on {args.devices} simulated CPU devices, Adam, batch {args.batch_size} "
        "(MiB per device: parameters / optimizer state live; XLA temp of the step; "
        "bytes per step: measured = analytic for the reduce-scatters and all-gathers):",
        "",
        "| model | Psi (MiB) | stage | params | opt. state | step temp | comm/step (MiB) "
        "| analytic | step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in measured:
        if r["strategy"] == "data":
            lines.append(f"| {r['model']} | | data | | | | {r['comm_bytes_per_step'] * mb:.2f} "
                         f"| {r['comm_bytes_per_step_analytic'] * mb:.2f} "
                         f"| {r['step_time_median_s'] * 1e3:.1f} |")  # fmt: skip
            continue
        m = r["memory_per_device"]
        temp = f"{m['step_temp'] * mb:.2f}" if m["step_temp"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['padded_param_bytes'] * mb:.2f} | {r['zero']} "
            f"| {m['params'] * mb:.2f} | {m['optimizer_state'] * mb:.2f} | {temp} "
            f"| {r['comm_bytes_per_step'] * mb:.2f} | {r['comm_bytes_per_step_analytic'] * mb:.2f} "
            f"| {r['step_time_median_s'] * 1e3:.1f} |"
        )
    gb = 1 / 1e9
    lines += [
        "",
        f"Predicted at paper scale: {args.paper_workers} GPUs ({args.hw}), global batch "
        f"{args.paper_batch}, Adam, fp32 (GB per device: state + activations):",
        "",
        "| model | parameters | data | ZeRO-1 | ZeRO-2 | ZeRO-3 |",
        "|---|---|---|---|---|---|",
    ]
    for model in SHAPE_MODELS:
        rs = [r for r in predicted if r["model"] == model]
        cells = " | ".join(f"{r['memory_bytes'] * gb:.2f}" for r in rs)
        lines.append(f"| {model} | {rs[0]['params'] / 1e6:.1f} M | {cells} |")
    return "\n".join(lines) + "\n"


def paper_title(args) -> str:
    return (f"Predicted, not measured: {args.paper_workers} GPUs ({args.hw}), global batch "
            f"{args.paper_batch}, Adam, fp32")  # fmt: skip


def plot(predicted: list[dict], out: Path, title: str = "") -> None:
    """Each model's predicted memory per device under ZeRO-1/2/3 as a share of plain data
    parallelism's (whose GB the tick labels give): linear, so near-equal stages look so."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    width = 0.2
    base = {r["model"]: r["memory_bytes"] for r in predicted if r["strategy"] == "data"}
    for i, (strategy, zero) in enumerate(VARIANTS):
        rs = [r for r in predicted if r["strategy"] == strategy and r["zero"] == zero]
        xs = [j + (i - 1.5) * width for j in range(len(rs))]
        ax.bar(xs, [r["memory_bytes"] / base[r["model"]] for r in rs], width,
               label=f"ZeRO-{zero}" if zero else "data")  # fmt: skip
    ax.set_xticks(range(len(SHAPE_MODELS)),
                  [f"{m}\n(data: {base[m] / 1e9:.1f} GB)" for m in SHAPE_MODELS])  # fmt: skip
    ax.set_ylabel("predicted memory per device,\nshare of data parallelism's")
    ax.set_ylim(0, 1.1)
    ax.set_title(title or "Predicted memory per device (refdl predict)", fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/fsdp")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hw", default="a100-nvlink-ib-hdr")
    ap.add_argument("--paper-workers", type=int, default=64)
    ap.add_argument("--paper-batch", type=int, default=1024)
    ap.add_argument("--replot", action="store_true",
                    help="redraw memory.png from --out's bench_fsdp.json (no runs)")  # fmt: skip
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads((out / "bench_fsdp.json").read_text())
        plot(saved["predicted"], out, f"{paper_title(args)} ({saved['meta']['date']})")
        return 0
    measured, predicted = measure(args), predict(args)
    meta = {"command": " ".join(["scripts/bench_fsdp.py", *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}  # fmt: skip
    (out / "bench_fsdp.json").write_text(
        json.dumps({"meta": meta, "measured": measured, "predicted": predicted}, indent=1)
    )
    (out / "table.md").write_text(table(measured, predicted, args))
    plot(predicted, out, f"{paper_title(args)} ({meta['date']})")
    print((out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
