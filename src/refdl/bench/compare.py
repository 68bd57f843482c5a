"""``python -m refdl.bench compare``: samples/s of refdl and PyTorch side by side, one run.

For each device count the same model, batch and optimizer train for ``--steps``
steps in refdl (the strategy on simulated CPU devices in this process) and in
PyTorch (one process, ``DistributedDataParallel`` over gloo, or
``torch.distributed.pipelining``, one process per worker); samples/s is the
global batch over the median step time after ``--warmup`` steps. refdl's steps
are walked as its training loop walks them: the host waits for the devices only
every ``--sync-every`` steps (the loop waits at its logged steps), so host work
overlaps the devices'; PyTorch's eager steps finish before they return. The two sides
alternate ``--rounds`` times (who goes first alternating too) so a noisy moment does
not hit one side only. Each PyTorch process gets ``cores / workers`` intra-op threads
(at least 1), as refdl's simulated devices share the host's cores.

A busy machine fools such ratios (PyTorch's intra-op threads collapse when the cores
are taken: 18.6x and 140x were printed on a shared machine). The CPU other processes
use is measured for a second before and over the whole measurement, and each side's
spread over the rounds is reported; when either says the ratio cannot be trusted a
warning names both (the JSON records them, ``trusted`` false), and ``--strict`` exits 1.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from refdl.bench.mpi_allreduce import machine_cpu_seconds
from refdl.cli import Parser
from refdl.config.paths import writable_folder
from refdl.errors import UsageError
from refdl.parallel.processes import simulate_devices
from refdl.progress import phase

# JAX, the runs and the PyTorch adapter are imported where they are used: a mistaken flag
# is answered before they load.

FRAMEWORKS = ("refdl", "torch")


def refdl_step_times(
    model: str, strategy: str, devices: int, steps: int, batch: int, sync_every: int = 1
) -> list[float]:
    """Step times of refdl's ``strategy`` on ``devices`` simulated devices, walked as the
    training loop walks them: the host waits for the devices every ``sync_every`` steps
    (the loop's logged steps) and each step of a window gets the window's mean time."""
    from refdl.config.spec import RunSpec
    from refdl.run.build import build
    from refdl.run.trajectory import run_steps, trajectory

    spec = RunSpec(strategy=strategy, model=model, devices=devices, steps=steps,
                   batch_size=batch, progress=False)  # fmt: skip
    if sync_every == 1:
        return run_steps(spec, steps).seconds
    run = build(spec)
    state = run.strategy.init_state(spec.seed)
    times: list[float] = []
    # The first step (compilation) waits alone; then windows of ``sync_every`` steps.
    for out in trajectory(run, state, 0, steps, sync=lambda done: (done - 1) % sync_every == 0):
        if out.seconds is not None:
            times += [out.seconds] * out.window
    return times


def torch_step_times(
    model: str, strategy: str, devices: int, steps: int, batch: int
) -> list[float]:
    """Step times of the same training in PyTorch (``refdl.adapters.torch``)."""
    import jax

    from refdl.adapters import torch as adapter
    from refdl.config.spec import RunSpec
    from refdl.run.build import build

    run = build(RunSpec(strategy=strategy, model=model, devices=devices, steps=steps,
                        batch_size=batch, progress=False))  # fmt: skip
    s = run.spec
    plan = adapter.TrainPlan(
        model=adapter.ModelPlan.of(run.task.model, run.task.sample_x),
        params=adapter.flatten(jax.device_get(run.task.init_state(s.seed).params)),
        batches=tuple(run.batch(t) for t in range(steps)),
        lrs=tuple(run.lr(t) for t in range(steps)),
        optimizer=s.optimizer,
        momentum=s.momentum,
        weight_decay=s.weight_decay,
        loss=s.loss,
    )
    twin = adapter.Twin(strategy=strategy, devices=devices, cuts=run.plan.cuts,
                        microbatches=s.microbatches, schedule=s.schedule)  # fmt: skip
    result, _ = adapter.train_twin(twin, plan, apart=True)
    return result.step_times


# The strategies whose PyTorch twins are timed beside refdl (the others are checked for
# equality by refdl validate, not timed).
TIMED = ("single", "data", "pipeline")

# A ratio is trusted when other processes used less than this share of the cores
# (before and while measuring) and each side's round medians lie within this spread.
BUSY_SHARE = 0.15
# Spread bound tuned 2026-11-24: idle rounds of 20 timed steps spread 16-42 % (trust-tuning.json).
MAX_SPREAD = 0.5


class OthersLoad:
    """CPU cores used by other processes since ``start``: the machine's busy CPU seconds
    (``/proc/stat``) less this process's and its reaped children's."""

    def start(self) -> OthersLoad:
        self.t, self.busy, self.own = time.monotonic(), self._busy(), self._own()
        return self

    @staticmethod
    def _busy() -> float | None:
        got = machine_cpu_seconds()
        return got[0] if got else None

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def cores(self) -> float | None:
        busy, dt = self._busy(), time.monotonic() - self.t
        if busy is None or self.busy is None or dt <= 0:
            return None
        return max(0.0, ((busy - self.busy) - (self._own() - self.own)) / dt)


def compare(
    frameworks: list[str], model: str, strategy: str, devices: list[int], steps: int,
    warmup: int, rounds: int, batch: int, sync_every: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """samples/s of each framework at each device count, and refdl / torch; the sides
    alternate round by round, and the load other processes put on the machine (before
    and during) and each side's spread over the rounds say whether the ratio holds."""
    before = OthersLoad().start()
    time.sleep(1.0)
    load_before = before.cores()
    during = OthersLoad().start()
    per_round: dict[tuple[str, int], list[list[float]]] = {
        (f, d): [] for f in frameworks for d in devices
    }
    todo, done = rounds * len(devices) * len(frameworks), 0
    from refdl.config.spec import RunSpec
    from refdl.run.build import build

    for d in devices:  # refused settings: one line, before any round's line
        build(RunSpec(strategy=strategy, model=model, devices=d, steps=steps, batch_size=batch,
                      progress=False))  # fmt: skip
    for r in range(rounds):
        for d in devices:
            order = frameworks if r % 2 == 0 else frameworks[::-1]  # who goes first alternates
            for f in order:
                done += 1
                phase(f"refdl.bench compare: round {r + 1}/{rounds}, {f} {strategy} on {d} "
                      f"device(s) ({done}/{todo})")  # fmt: skip
                if f == "refdl":
                    got = refdl_step_times(model, strategy, d, steps, batch, sync_every)
                else:
                    got = torch_step_times(model, strategy, d, steps, batch)
                per_round[(f, d)].append(got[warmup:])
    load_during = during.cores()
    cores = os.cpu_count() or 1
    rows, spreads = [], []
    for d in devices:
        row: dict[str, Any] = {"devices": d}
        for f in frameworks:
            times = [t for rnd in per_round[(f, d)] for t in rnd]
            med = statistics.median(times)
            meds = [batch / statistics.median(rnd) for rnd in per_round[(f, d)]]
            row[f"{f}_step_s"] = med
            row[f"{f}_samples_per_s"] = batch / med
            row[f"{f}_rounds_samples_per_s"] = meds
            row[f"{f}_spread"] = (max(meds) - min(meds)) / statistics.median(meds)
            spreads.append((f"{f} on {d}", row[f"{f}_spread"]))
        if set(FRAMEWORKS) <= set(frameworks):
            row["refdl_vs_torch"] = row["refdl_samples_per_s"] / row["torch_samples_per_s"]
            ours, theirs = row["refdl_rounds_samples_per_s"], row["torch_rounds_samples_per_s"]
            row["refdl_vs_torch_range"] = [min(ours) / max(theirs), max(ours) / min(theirs)]
        rows.append(row)
    doubts = [f"other processes used {v:.2f} of {cores} cores {when}"
              for when, v in (("before", load_before), ("during the measurement", load_during))
              if v is not None and v > BUSY_SHARE * cores]  # fmt: skip
    doubts += [f"{who}'s rounds spread {v:.0%}" for who, v in spreads if v > MAX_SPREAD]
    return {
        "model": model,
        "strategy": strategy,
        "date": time.strftime("%Y-%m-%d"),
        "global_batch": batch,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "refdl_sync_every": sync_every,
        "cores": cores,
        "threads": {
            "refdl": f"XLA's CPU pool over {cores} cores, shared by the simulated devices",
            "torch": "cores / workers intra-op threads each",
        },
        "others_load_cores": {"before": load_before, "during": load_during},
        "spread": dict(spreads),
        "trusted": not doubts,
        "doubts": doubts,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = Parser(name="refdl bench compare",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--frameworks", default="refdl,torch")
    ap.add_argument("--model", default="lenet5")
    ap.add_argument("--strategy", default="data", help=", ".join(TIMED))
    ap.add_argument("--devices", default="1,2,4")
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--sync-every", type=int, default=10,
                    help="refdl waits for its devices every N steps, as the training loop does "
                         "at its logged steps (default 10, --log-every's default); 1: every "
                         "step")  # fmt: skip
    ap.add_argument("--out", help="directory for compare_<model>_<strategy>.json/.png")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when the load or the spread says the ratio cannot be trusted",
    )
    args = ap.parse_args(argv)
    try:
        if args.out:
            writable_folder(args.out, "--out")
        frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
        bad = sorted(set(frameworks) - set(FRAMEWORKS))
        if bad or not frameworks:
            raise UsageError(f"--frameworks: choose from {', '.join(FRAMEWORKS)} (got {bad})")
        try:
            devices = [int(v) for v in args.devices.split(",")]
        except ValueError:
            raise UsageError(f"--devices {args.devices!r}: give counts like 1,2,4") from None
        if not devices or min(devices) < 1 or max(devices) > 8:
            raise UsageError("--devices: counts between 1 and 8")
        if args.strategy not in TIMED:
            raise UsageError(f"--strategy: {', '.join(TIMED)} (the PyTorch twins it times)")
        from refdl.strategies import traits_of

        if not traits_of(args.strategy).axes and devices != [1]:
            raise UsageError(f"--strategy {args.strategy} runs on 1 device: --devices 1")
        for flag, value, least in (("--sync-every", args.sync_every, 1), ("--steps", args.steps, 1),
                                   ("--rounds", args.rounds, 1), ("--warmup", args.warmup, 0),
                                   ("--batch-size", args.batch_size, 1)):  # fmt: skip
            if value < least:
                raise UsageError(f"{flag} must be at least {least} (got {value})")
        if args.warmup >= args.steps:
            raise UsageError("--warmup must be smaller than --steps")
        if len(set(frameworks)) < len(frameworks):
            raise UsageError(f"--frameworks names one twice ({args.frameworks})")
        if args.strict and not set(FRAMEWORKS) <= set(frameworks):
            raise UsageError(f"--strict judges the {'/'.join(FRAMEWORKS)} ratio, and "
                             f"--frameworks {args.frameworks} gives none; add the other "
                             "framework or drop --strict")  # fmt: skip
        from refdl.models import MODELS

        if args.model not in MODELS.names():
            raise UsageError(f"unknown --model {args.model!r}; choose {', '.join(MODELS.names())}")
        if "torch" in frameworks:
            from refdl.adapters import torch as adapter

            adapter.require()
        # Only as many simulated devices as asked: a CPU split into 8 devices runs a
        # one-device step ~30 % slower than the whole CPU (2 cores, docs/speed.md).
        simulate_devices(max(devices))
        result = compare(frameworks, args.model, args.strategy, devices, args.steps,
                         args.warmup, args.rounds, args.batch_size, args.sync_every)  # fmt: skip
    except UsageError as e:
        print(f"refdl.bench compare: error: {e}", file=sys.stderr)
        return 2
    if not result["trusted"]:
        print(
            f"refdl.bench compare: warning: the ratio cannot be trusted: "
            f"{'; '.join(result['doubts'])}; rerun on an idle machine",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        head = "".join(f" {f + ' samples/s':>18s}" for f in frameworks)
        print(f"{result['model']} {result['strategy']}, global batch {result['global_batch']}")
        print(f"{'devices':>7s}{head} {'refdl/torch':>12s}")
        for r in result["rows"]:
            cells = "".join(f" {r[f + '_samples_per_s']:18.0f}" for f in frameworks)
            ratio = f"{r['refdl_vs_torch']:12.2f}" if "refdl_vs_torch" in r else ""
            span = r.get("refdl_vs_torch_range")
            span = f"  ({span[0]:.2f}-{span[1]:.2f} over the rounds)" if span else ""
            print(f"{r['devices']:7d}{cells} {ratio}{span}")
    if args.out:
        from refdl import plots

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"compare_{args.model}_{args.strategy}"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        plots.throughput(result, FRAMEWORKS, out / f"{stem}.png")
        print(f"wrote {out / stem}.json and .png", file=sys.stderr)
    return 1 if args.strict and not result["trusted"] else 0
