"""``python -m refdl.bench op-profile``: the compute model held against JAX's profiler,
operation by operation.

``predict-vs-measure`` compares whole steps; when a row is off, this says where.
It runs refdl's single-device training step (the loop's way: a fresh host batch,
``device_put``, the step, the wait), times ``--steps`` steps plainly, then the
same number under ``jax.profiler``. XLA:CPU records every executed operation
under its HLO instruction name, so each operation that ``refdl.perf.ops.parse_hlo``
lists gets its measured time (the median over the profiled steps) beside the
profile's prediction for it (``op_time``: Hockney's ``t0 + n / r_inf`` of its
kind, scaled by its group's ``[device.in_step]`` factor). Rows group the
operations by kind, and by whether XLA handed them to a kernel library (its
YNNPACK custom fusions run products and pools with other kernels than its own
emitter). ``gap`` is what the plain step's wall time leaves once the measured
operations and the predicted host time (dispatch, batch transfer) are taken
out: time between operations that no operation accounts for, set beside the
predicted hand-offs (``[device.in_step]``'s ``handoff_s`` per operation).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from typing import Any

from refdl import hw
from refdl.bench.predict_vs_measure import WARMUP, step_times
from refdl.cli import Parser
from refdl.config.paths import writable_file, write_atomic
from refdl.errors import UsageError
from refdl.perf import compute_time
from refdl.perf.ops import InStep, OpWork, op_time, parse_hlo


def library_ops(hlo_text: str) -> set[str]:
    """Names of the entry operations XLA:CPU runs through a kernel library (fusions whose
    backend config names ``__ynn_fusion``)."""
    names = set()
    for line in hlo_text.splitlines():
        if "fusion(" in line and "__ynn_fusion" in line and "=" in line:
            names.add(line.split("=", 1)[0].replace("ROOT", "").strip().lstrip("%"))
    return names


def run(model: str, profile: str = "local", batch: int = 64, steps: int = 20) -> dict[str, Any]:
    """Measured and predicted time of each operation of ``model``'s single-device step,
    grouped by kind; the step's wall time, its measured operations and the gap."""
    if not 1 <= steps <= 10_000:  # (each is timed and profiled: 10,000 is hours here)
        raise UsageError(f"--steps {steps}: give 1 to 10000 steps to profile")
    prof = hw.load(profile)
    if not prof.need_device().ops:  # a GPU's datasheet: nothing to set beside this CPU's ops
        raise UsageError(f"--hw {profile} has no per-operation rates ([device.ops], which "
                         "`refdl hw calibrate` measures on a machine): op-profile times "
                         "this machine's operations; give local or a profile calibrated "
                         "here")  # fmt: skip
    from refdl.config.spec import RunSpec  # (JAX: after a mistaken flag is answered)
    from refdl.hw.calibrate.in_step import traced_ops
    from refdl.perf.costs import host_work
    from refdl.perf.model_cost import model_cost
    from refdl.run.build import build

    run_ = build(RunSpec(strategy="single", model=model, batch_size=batch, progress=False))
    state = run_.strategy.init_state(0)
    text = run_.strategy.compiled_steps()[0].as_text()
    ops = parse_hlo(text)
    library = library_ops(text)
    state, _ = step_times(run_, state, 0, WARMUP)
    state, walls = step_times(run_, state, WARMUP, steps)
    with traced_ops({op.name for op in ops}) as durations:
        state, profiled = step_times(run_, state, WARMUP + steps, steps)

    rates = prof.need_device().ops or {}
    in_step = (prof.device.in_step if rates else None) or InStep()
    # each operation's own time (the in-step factors, no hand-off): what the profiler times;
    # the hand-offs are set beside the gap between operations instead
    busy = dataclasses.replace(in_step, handoff_s=0.0)
    groups: dict[str, dict[str, Any]] = {}
    rows = []
    for op in ops:
        measured = statistics.median(durations[op.name]) if op.name in durations else None
        predicted = op_time(OpWork({op.kind: (1, op.size)}), rates, prof, busy)
        group = op.kind + (" (library)" if op.name in library else "")
        g = groups.setdefault(group, {"count": 0, "unseen": 0, "measured_s": 0.0,
                                      "predicted_s": 0.0, "size": 0.0})  # fmt: skip
        g["count"] += 1
        g["predicted_s"] += predicted
        g["size"] += op.size
        if measured is None:
            g["unseen"] += 1
        else:
            g["measured_s"] += measured
        rows.append({"name": op.name, "group": group, "flops": op.flops, "bytes": op.bytes,
                     "measured_s": measured, "predicted_s": predicted})  # fmt: skip

    # the host's share of the predicted step (dispatch, batch transfer), as refdl.predict has it
    host = compute_time(0.0, 0.0, prof, **host_work(model_cost(model), batch))
    wall = statistics.median(walls)
    ops_s = sum(g["measured_s"] for g in groups.values())
    return {
        "model": model,
        "profile": prof.name,
        "batch_size": batch,
        "steps": steps,
        "wall_s": wall,
        "wall_profiled_s": statistics.median(profiled),
        "operations": len(ops),
        "unseen": sum(g["unseen"] for g in groups.values()),
        "measured_ops_s": ops_s,
        "predicted_ops_s": sum(g["predicted_s"] for g in groups.values()),
        "predicted_host_s": host,
        "gap_s": wall - ops_s - host,
        "gap_per_op_s": (wall - ops_s - host) / max(len(ops), 1),
        "predicted_handoff_s": in_step.handoff_s * len(ops),
        "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["measured_s"])),
        "ops": sorted(rows, key=lambda r: -(r["measured_s"] or 0.0)),
    }


def print_table(r: dict[str, Any], top: int = 8) -> None:
    """The per-group table, the totals, and the ``top`` longest operations."""
    print(f"{r['model']}: single-device step, batch {r['batch_size']}, profile {r['profile']}, "
          f"{r['steps']} steps (median per operation)")  # fmt: skip
    print(f"{'group':26s} {'ops':>4s} {'measured ms':>12s} {'predicted ms':>13s} {'ratio':>6s}")
    for name, g in r["groups"].items():
        ratio = g["predicted_s"] / g["measured_s"] if g["measured_s"] else float("nan")
        unseen = f"  ({g['unseen']} not in the trace)" if g["unseen"] else ""
        print(f"{name:26s} {g['count']:4d} {g['measured_s'] * 1e3:12.3f} "
              f"{g['predicted_s'] * 1e3:13.3f} {ratio:6.2f}{unseen}")  # fmt: skip
    print(f"{'operations':26s} {r['operations']:4d} {r['measured_ops_s'] * 1e3:12.3f} "
          f"{r['predicted_ops_s'] * 1e3:13.3f}")  # fmt: skip
    print(f"step wall {r['wall_s'] * 1e3:.3f} ms (profiled {r['wall_profiled_s'] * 1e3:.3f} ms); "
          f"predicted host {r['predicted_host_s'] * 1e3:.3f} ms; gap {r['gap_s'] * 1e3:.3f} ms "
          f"= {r['gap_per_op_s'] * 1e6:.1f} µs per operation; predicted hand-offs "
          f"{r['predicted_handoff_s'] * 1e3:.3f} ms")  # fmt: skip
    print(f"longest {top} operations:")
    for op in r["ops"][:top]:
        measured = op["measured_s"] * 1e6 if op["measured_s"] is not None else float("nan")
        print(f"  {op['name']:28s} {op['group']:24s} {measured:9.1f} µs measured "
              f"{op['predicted_s'] * 1e6:9.1f} µs predicted  {op['flops']:.3g} FLOP "
              f"{op['bytes']:.3g} B")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = Parser(name="refdl bench op-profile", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="lenet5")
    ap.add_argument("--hw", default="local", help="hardware profile (name or TOML path)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="steps timed, and as many profiled")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    try:
        if args.out:
            writable_file(args.out, "--out", (".json",))
        result = run(args.model, args.hw, args.batch_size, args.steps)
    except UsageError as e:
        print(f"refdl.bench op-profile: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    if args.out:
        write_atomic(args.out, json.dumps(result, indent=2) + "\n")
    return 0
