"""``refdl plan``: the best parallel configuration for a model on a machine.

    refdl plan --hw a100-nvlink-ib-hdr --model gpt3-175b --devices 1024 --batch-size 1536 \\
        --seq-len 2048 --top 5
    refdl plan --hw h100-nvlink-ib-ndr --model llama3-70b --devices 256 --batch-size 512 --json
    refdl plan --hw local --model mlp --devices 8 --batch-size 64 --run --steps 100

Every configuration the model allows on ``--devices`` - the mesh over data, fsdp, model,
context, expert and pipe, the ZeRO stage, microbatches, pipeline schedule and chunks,
recomputation, precision (``refdl.perf.search``) - is priced by the cost model of
``refdl predict``, those whose memory per device exceeds the device's (or
``--memory-limit``) are dropped, and the fastest ``--top`` are printed with their step
time's stated 80 % interval, memory per device, the term that dominates each (compute,
the bubble, or an axis's exposed communication), and why the first beats the second.
``--run`` trains the best configuration ``refdl train`` can run, on the devices present.
How often such a choice holds against published configuration searches and against
this machine: ``refdl bench published``, ``scripts/bench_plan.py``
(docs/performance-model.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from refdl.cli import Parser
from refdl.config.paths import writable_file
from refdl.config.values import Int, memory_size
from refdl.errors import UsageError
from refdl.hw import load, stacks
from refdl.perf import add_transformer_flags
from refdl.progress import Progress

# The model zoo, the step model and the strategies (JAX and Flax: about 1 s) are imported
# after the arguments are checked, where they are used: a mistake answers at once.

PROG = "refdl plan"


def parser() -> argparse.ArgumentParser:
    p = Parser(name="refdl.plan", prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--hw", required=True, help="profile name or .toml path")
    p.add_argument("--model", help="a zoo transformer or shape, or a refdl model")
    p.add_argument("--model-shape", metavar="KEY=VALUE,...",
                   help="a transformer by its shape: layers=L,d_model=D,heads=H[,kv_heads=G]"
                        "[,ffn=F][,vocab=V][,experts=E,top_k=K,shared_experts=S][,glu=1] "
                        "(docs/performance-model.md)")  # fmt: skip
    p.add_argument("--model-shape-file", metavar="config.json",
                   help="a transformer by a Hugging Face config.json")  # fmt: skip
    p.add_argument("--devices", type=int, required=True, help="devices to lay the run over")
    p.add_argument("--batch-size", type=int, required=True, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, help="transformers: tokens per sequence")
    p.add_argument("--memory-limit", help="bytes per device (default: the device's memory)")
    p.add_argument("--top", type=int, default=5, help="configurations printed (default 5)")
    p.add_argument("--precision", help="fp32 or bf16 (default: every one the device has)")
    p.add_argument("--optimizer",
                   help="sgd, momentum or adam (its state's size; default: a refdl model's "
                   "own optimizer, adam for a shape)")  # fmt: skip
    p.add_argument("--library", help=stacks.help_text())
    add_transformer_flags(p)
    p.add_argument("--ties", default="simplest",
                   help="the order of configurations within the model's paired error of the "
                   "fastest: simplest (headroom, exact before compressed gradients, fewer "
                   "mesh axes, plainer schedule, less recomputation; default) or time")  # fmt: skip
    p.add_argument("--lossy", action="store_true",
                   help="also price data's compressed gradient exchanges (top-1 %% by "
                        "SparCML's sparse allreduce, with 4-bit values too, QSGD, TernGrad, "
                        "sign), which change the training")  # fmt: skip
    p.add_argument("--json", action="store_true", help='{"configurations": [...]}, best first')
    p.add_argument("--plot", metavar="FILE.png", help="the top configurations' terms")
    p.add_argument("--run", action="store_true",
                   help="train the best configuration refdl train can run")  # fmt: skip
    p.add_argument("--steps", type=int, help="with --run: training steps (default 100)")
    p.add_argument("--out", help="with --run: the run folder")
    p.add_argument("--overwrite", action="store_true",
                   help="with --run: replace an --out folder that holds another run")  # fmt: skip
    return p


def _count(n: float) -> str:
    """A parameter count a person reads: 85,738 / 124 M / 175 B."""
    if n >= 1e9:
        return f"{n / 1e9:.3g} B"
    return f"{n / 1e6:.3g} M" if n >= 1e6 else f"{int(n):,}"


def show(record: dict[str, Any]) -> None:
    """The table ``refdl plan`` prints."""
    seq = f" x {record['seq_len']} tokens" if record["seq_len"] else ""
    limit = record["memory_limit_bytes"]
    limit_text = f", memory limit {limit / 1e9:.3g} GB" if limit else ""
    if "model_shape" in record:
        print(f"the shape: {record['model_shape']}")
    print(f"{record['model']} ({_count(record['params'])} parameters) on {record['hw']}, "
          f"{record['devices']} devices, batch {record['global_batch']}{seq}"
          f"{limit_text}")  # fmt: skip
    found = record["configurations"]
    print(f"priced {record['priced']:,} configurations on {record['meshes']:,} meshes in "
          f"{record['seconds']:.1f} s ({record['did_not_fit']:,} did not fit); "
          f"the first {len(found)}:")  # fmt: skip
    print(f"{'#':>2s}  {'step s [80 % interval]':<24s} {'mem GB':>7s}  {'dominant':<18s} "
          "configuration")  # fmt: skip
    for i, c in enumerate(found, 1):
        lo, hi = c["step_time_low_s"], c["step_time_high_s"]
        t = f"{c['step_time_s']:.4g}" + (f" [{lo:.4g}, {hi:.4g}]" if lo is not None else "")
        dom = f"{c['dominant_term']} {c['dominant_share']:.0%}"
        print(f"{i:2d}  {t:<24s} {c['memory_bytes_per_device'] / 1e9:7.3g}  {dom:<18s} "
              f"{c['description']}")  # fmt: skip
    if "why_first" in record:
        print(f"#1 is {record['why_first']}")
    tied = record.get("indistinguishable_from_best_count", 0)
    if tied > 1:
        print(f"{tied:,} configurations lie within {record['tie_band'] - 1:.0%} of the "
              "fastest, the model's paired error: it cannot rank them by time; they come "
              f"first, by {record['tie_order']} (--ties {record['ties']})")  # fmt: skip


def draw(record: dict[str, Any], path: str) -> None:
    """The top configurations' step time split into its terms, with the 80 % interval."""
    from matplotlib.figure import Figure

    from refdl.plots import save

    found = record["configurations"]
    names = sorted({k for c in found for k in c["terms_s"]})
    fig = Figure(figsize=(11, 0.9 * len(found) + 1.5))
    ax = fig.subplots()
    left = [0.0] * len(found)
    for k in names:
        widths = [c["terms_s"].get(k, 0.0) for c in found]
        ax.barh(range(len(found)), widths, height=0.5, left=left, label=k)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, c in enumerate(found):
        if c["step_time_low_s"] is not None:
            ax.plot([c["step_time_low_s"], c["step_time_high_s"]], [i, i], "k-", lw=1)
    # short tick labels; each configuration's words printed under its bar, never cut off
    ax.set_yticks(range(len(found)), [f"#{i + 1}" for i in range(len(found))], fontsize=8)
    for i, c in enumerate(found):
        ax.text(0, i + 0.3, c["description"], fontsize=7, va="top")  # under its bar
    ax.set_ylim(len(found) - 0.2, -0.6)  # room for the words under the last bar
    ax.set_xlabel("seconds per step (terms; line: stated 80 % interval)")
    ax.set_title(f"{record['model']} on {record['devices']} x {record['hw']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    save(fig, path, dpi=110)  # (checked writable before the search)


def run_best(args: argparse.Namespace, record: dict[str, Any]) -> int:
    """``refdl train`` with the best configuration (a process of its own: it sets the
    simulated device count before JAX starts)."""
    best = record["configurations"][0]
    cmd = [sys.executable, "-m", "refdl.train", "--model", args.model, "--batch-size",
           str(args.batch_size), *best["train_flags"], "--steps", str(args.steps),
           "--optimizer", record["optimizer"]]  # fmt: skip
    if args.seq_len:
        cmd += ["--data-opt", f"seq_len={args.seq_len}"]
    if args.out is not None:
        cmd += ["--out", args.out]
    cmd += ["--overwrite"] * args.overwrite
    print(f"{PROG}: running #1: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    sys.stdout.flush()  # (the table or the JSON first)
    # with --json, standard output holds the JSON alone: the run's own line goes to stderr
    return subprocess.call(cmd, stdout=sys.stderr if args.json else None)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:  # what needs no model first
        load(args.hw)
        if args.library:
            stacks.get(args.library)  # one line for an unknown library or stack
        if args.plot:
            writable_file(args.plot, "--plot", (".png", ".pdf", ".svg"))
        if args.out is not None and not args.out.strip():
            raise UsageError("--out is empty; give a folder, or drop it (runs/<timestamp>/)")
        for key in ("steps", "out", "overwrite"):  # what only a run uses
            if getattr(args, key) not in (None, False) and not args.run:
                raise UsageError(f"--{key} is an option of --run (training the best "
                                 "configuration); add --run, or drop it")  # fmt: skip
        args.steps = 100 if args.steps is None else args.steps
        if problem := Int(min=1, max=1 << 30).problem(args.steps):
            raise UsageError(f"--steps must be {problem}")
        if args.lossy and (args.model_shape or args.model_shape_file):  # (named: planning's)
            raise UsageError("--lossy prices data's compressed exchanges for models priced by "
                             "their compiled step (mlp, lenet5, resnet, vgg ...); a shape is "
                             "priced by the transformer formula, which has none")  # fmt: skip
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from refdl.perf.planning import plan_configurations
    from refdl.perf.shapes import describe, model_named
    from refdl.strategies import declared_traits

    try:
        args.model, shape = model_named(args.model, args.model_shape, args.model_shape_file,
                                        args.seq_len)  # fmt: skip
        defaults = parser()
        given = [k for k in ("compute", "grad_reduce")  # (a transformer's, as predict's)
                 if getattr(args, k) != defaults.get_default(k)]  # fmt: skip
        if given:
            from refdl.perf.model_cost import model_cost

            if model_cost(args.model).transformer is None:
                raise UsageError(f"--{given[0].replace('_', '-')} prices a transformer's "
                                 f"layers, and {args.model} "
                                 "is priced by its compiled step, which has no such term; "
                                 "drop it")  # fmt: skip
            from refdl.perf.costs import compute_unpriced

            if "compute" in given and (why := compute_unpriced(model_cost(args.model))):
                raise UsageError(f"--compute {args.compute} changes nothing: {why}; drop "
                                 "it")  # fmt: skip
        if args.run:
            from refdl.models import MODELS

            if args.model not in MODELS.names():
                raise UsageError(f"--run trains refdl's models ({', '.join(MODELS.names())}); "
                                 f"{args.model} is a shape only")  # fmt: skip
        precisions = None
        if args.precision is not None:  # fp32, bf16 or both, each once
            precisions = tuple(x.strip() for x in args.precision.split(","))
            if not all(precisions) or len(set(precisions)) != len(precisions):
                raise UsageError(f"--precision {args.precision!r}: give fp32, bf16 or "
                                 "fp32,bf16 (each once)")  # fmt: skip
        bar: list[Progress] = []

        def tick(done: int, total: int) -> None:
            """A long search's progress (a bar on a terminal, a line every 10 s else)."""
            if not bar:
                bar.append(Progress(total, PROG, unit="layout", leave=False))  # no 2nd line
            bar[0].update(done - bar[0].n)
            if done >= total:
                bar[0].close()

        record, _ = plan_configurations(
            args.hw, args.model, args.devices, args.batch_size, strategies=declared_traits(),
            seq_len=args.seq_len, top=args.top, precisions=precisions or None,
            memory_limit=memory_size(args.memory_limit) if args.memory_limit else None,
            optimizer=args.optimizer, library=args.library, runnable_only=args.run,
            ties=args.ties, lossy=args.lossy, compute=args.compute,
            grad_reduce=args.grad_reduce, tick=tick,
        )  # fmt: skip
        if not record["configurations"] and not record["did_not_fit"]:  # none valid at all
            raise UsageError(
                f"no layout of {args.model} on {args.devices} devices splits it: the batch "
                f"{args.batch_size} must split over the replicas (data x fsdp x expert) and "
                "the model's heads, sequence, experts and layers over the other axes; give a "
                "--batch-size or --devices that divides them"
            )
        if not record["configurations"]:
            raise UsageError(
                f"no configuration of {args.model} fits {args.devices} devices of "
                f"{record['memory_limit_bytes'] / 1e9:.3g} GB at batch {args.batch_size}; "
                "raise --devices or --memory-limit, or lower --batch-size"
            )
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if record["memory_limit_note"]:  # after the checks: bad input stays one line
        print(f"{PROG}: note: {record['memory_limit_note']}", file=sys.stderr)
    if record["overhead_note"]:
        print(f"{PROG}: note: {record['overhead_note']}", file=sys.stderr)
    if args.plot:
        draw(record, args.plot)
    if shape is not None:
        record["model_shape"] = describe(shape)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        show(record)
    return run_best(args, record) if args.run else 0


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, PROG))
