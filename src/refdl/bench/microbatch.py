"""``refdl bench microbatch``: μ-cuDNN's micro-batch selection (Oyama et al., 2018),
measured on this machine.

For every convolution of the model's training step (its input shape at the batch), the
forward and both backward products are timed for each implementation refdl has (XLA's
convolution, ``im2col``: patches x kernel) and each micro-batch size of the policy;
``refdl.perf.microbatch`` then picks, per layer, the fastest micro-batches under the
workspace limit (``--mode layer``: dynamic programming) or shares the limit across
layers (``--mode shared``: a 0-1 integer program). The plan's predicted step is the
undivided step's measured time with each layer's undivided convolution time replaced by
the plan's (each timed alone, less the least an empty call costs); the step is then
built with the plan and measured, side by side with the undivided one, and its gradients
compared with the undivided step's at fp32 precision (a GPU's default runs fp32 products
as TF32, whose rounding alone moves ResNet-20's gradients by 15 % of an array's largest
entry: that difference is reported beside the check, not taken as the plan's).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from refdl.cli import Parser
from refdl.config.paths import writable_file, write_atomic
from refdl.config.values import memory_size
from refdl.errors import UsageError

if TYPE_CHECKING:
    from refdl.core.conv import ConvPlan

# JAX and the runs are imported where they are used: a mistaken flag is answered before
# they load.

IMPLS = ("xla", "im2col")


def _times(fn: Any, *args: Any, repeats: int) -> list[float]:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def _median_time(fn: Any, *args: Any, repeats: int) -> float:
    return statistics.median(_times(fn, *args, repeats=repeats))


def conv_time(sig: tuple, impl: str, b: int, repeats: int) -> float:
    """Seconds of one micro-batch of ``b``: the forward product and both backward ones."""
    import jax
    import numpy as np

    from refdl.core.conv import conv_impl

    (_, h, w, c), kshape, strides, padding = sig
    x = jax.device_put(np.random.default_rng(0).normal(size=(b, h, w, c)).astype(np.float32))
    k = jax.device_put(np.random.default_rng(1).normal(size=kshape).astype(np.float32))

    def fwd_bwd(x, k):
        y, back = jax.vjp(lambda x, k: conv_impl(impl, x, k, strides, padding), x, k)
        return back(y)

    return _median_time(jax.jit(fwd_bwd), x, k, repeats=repeats)


def step_args(run: Any) -> tuple[Any, Any, Any]:
    """The gradient step's arguments: initial parameters, model state, the first batch."""
    state = run.strategy.init_state(0)
    return state.params, state.model_state, run.batch(0)


def _grads(run: Any) -> Any:
    return lambda params, model_state, batch: run.task.accumulated_grads(
        params, model_state, batch, 1
    )[:2]


def conv_calls(run: Any, args: tuple) -> list[tuple]:
    """Every convolution of the gradient step, in order (traced, not run)."""
    import jax

    from refdl.core.conv import ConvPlan, conv_plan

    recorder = ConvPlan()
    with conv_plan(recorder):
        jax.eval_shape(_grads(run), *args)
    return recorder.calls


def grad_step(run: Any, args: tuple, plan: ConvPlan | None, precision: str | None = None) -> Any:
    """The model's gradient step for ``args``, compiled with every convolution by ``plan``
    (and fp32 products at ``precision``: None is JAX's default, TF32 on a recent GPU)."""
    import jax

    from refdl.core.conv import ConvPlan, conv_plan

    with conv_plan(plan or ConvPlan()), jax.default_matmul_precision(precision):
        return jax.jit(_grads(run)).lower(*args).compile()


def largest_difference(g: Any, reference: Any) -> float:
    """Over the arrays: the largest difference over the reference array's largest entry."""
    import jax
    import numpy as np

    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-30))
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(reference), strict=True)
    )


def run_bench(model: str, batch: int, limit: float, policy: str, mode: str,
              repeats: int = 5) -> dict[str, Any]:  # fmt: skip
    """The plan, its predicted and measured step against undivided, and the gradients'
    largest relative difference."""
    import jax
    import numpy as np

    from refdl.config.spec import RunSpec
    from refdl.core.conv import ConvPlan
    from refdl.perf import microbatch as mb
    from refdl.run.build import build

    if mode not in ("layer", "shared"):
        raise UsageError(f"--mode {mode!r}: choose layer or shared")
    run = build(RunSpec(strategy="single", model=model, batch_size=batch, progress=False))
    args = step_args(run)
    calls = conv_calls(run, args)
    if not calls:
        raise UsageError(f"--model {model} has no convolutions to divide")
    sizes = mb.sizes(batch, policy)
    # a call's own cost (dispatch, argument handling), which the products inside one
    # compiled step do not pay: its least (a median was seen at 0.07 and 0.12 ms on one
    # H100, the second above every product timed alone) is taken off every micro-batch
    x1 = jax.device_put(np.zeros((1,), np.float32))
    overhead = min(_times(jax.jit(lambda x, k: (x, k)), x1, x1, repeats=4 * repeats))
    measured: dict[tuple, dict[mb.Choice, float]] = {}
    for sig in dict.fromkeys(calls):
        print(f"timing {sig[0]} x {sig[1]}: {len(IMPLS) * len(sizes)} micro-batches",
              file=sys.stderr, flush=True)  # fmt: skip
        measured[sig] = {(i, b): max(conv_time(sig, i, b, repeats) - overhead, 1e-7)
                         for i in IMPLS for b in sizes}  # fmt: skip
    work = {sig: {c: mb.workspace_bytes(sig, *c) for c in measured[sig]} for sig in measured}
    if mode == "layer":
        splits = [mb.best_split(batch, measured[s], work[s], limit)[1] for s in calls]
    else:
        fronts = [mb.candidates(batch, measured[s], work[s]) for s in calls]
        chosen = mb.shared_limit(fronts, limit)
        splits = [fronts[i][j][2] for i, j in enumerate(chosen)]
    undivided_conv = [min(measured[s][(i, batch)] for i in IMPLS) for s in calls]
    default = [measured[s][("im2col" if _default_im2col(s) else "xla", batch)] for s in calls]
    planned = [sum(measured[s][c] for c in split) for s, split in zip(calls, splits, strict=True)]

    base, plan_step = grad_step(run, args, None), grad_step(run, args, ConvPlan(splits))
    t_base, t_plan = [], []
    for _ in range(3):  # side by side, alternating: a busy machine slows both alike
        t_base.append(_median_time(base, *args, repeats=repeats))
        t_plan.append(_median_time(plan_step, *args, repeats=repeats))
    t_base_s, t_plan_s = statistics.median(t_base), statistics.median(t_plan)
    default_diff = largest_difference(plan_step(*args)[1], base(*args)[1])
    # the check itself: both steps again, fp32 products computed in fp32
    g0 = grad_step(run, args, None, "highest")(*args)[1]
    g1 = grad_step(run, args, ConvPlan(splits), "highest")(*args)[1]
    diff = largest_difference(g1, g0)
    exact = all(
        np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True)
    )
    layers = [_layer(s, split, t, d, work[s]) for s, split, t, d in
              zip(calls, splits, planned, default, strict=True)]  # fmt: skip
    return {
        "model": model, "batch": batch, "memory_limit_bytes": limit, "policy": policy,
        "mode": mode, "device": jax.devices()[0].device_kind, "layers": layers,
        "workspace_bytes_total": sum(x["workspace_bytes"] for x in layers),
        "step_undivided_s": t_base_s, "step_planned_s": t_plan_s,
        "step_predicted_s": predicted_step(t_base_s, sum(default), sum(planned)),
        "step_undivided_runs_s": t_base, "step_planned_runs_s": t_plan,
        "conv_fastest_undivided_s": sum(undivided_conv), "call_overhead_s": overhead,
        "gradients_max_relative_difference": diff, "gradients_equal_rtol_1e-5": exact,
        "gradients_precision": "highest",
        "gradients_max_relative_difference_default_precision": default_diff,
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip


def predicted_step(step_s: float, undivided_s: float, planned_s: float) -> float:
    """The undivided step with its convolutions' time replaced by the plan's. Timed alone,
    the products can add up to more than the step they sit in (tiny layers: a call costs
    more than the work); then the step is all convolution and scales by planned/undivided."""
    rest = max(step_s - undivided_s, 0.0)
    return rest + planned_s * (step_s - rest) / undivided_s


def _layer(sig: tuple, split: list, t: float, undivided: float, work: dict) -> dict[str, Any]:
    return {"input": list(sig[0]), "kernel": list(sig[1]), "strides": list(sig[2]),
            "split": [list(c) for c in split], "time_s": t, "undivided_time_s": undivided,
            "workspace_bytes": max(work[c] for c in split)}  # fmt: skip


def _default_im2col(sig: tuple) -> bool:
    from refdl.core.conv import use_im2col

    return use_im2col(sig[0], sig[1], sig[2], sig[3])


def main(argv: list[str]) -> int:
    ap = Parser(name="refdl bench microbatch", description=__doc__)
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--memory-limit", default="64MiB", help="workspace limit (e.g. 64MiB)")
    ap.add_argument("--policy", default="powers", help="powers (of two) or all sizes")
    ap.add_argument("--mode", default="layer", help="layer (a limit each) or shared (in all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the result as JSON to this file")
    args = ap.parse_args(argv)
    try:
        if args.batch_size < 1 or args.repeats < 1:
            raise UsageError("--batch-size and --repeats must be at least 1")
        if args.out:
            writable_file(args.out, "--out", (".json",))
        limit = memory_size(args.memory_limit)
        r = run_bench(args.model, args.batch_size, limit, args.policy, args.mode, args.repeats)
    except UsageError as e:
        print(f"refdl bench microbatch: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_atomic(args.out, json.dumps(r, indent=1))
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['model']}, batch {r['batch']}, workspace limit {r['memory_limit_bytes']:.0f} B "
          f"({r['mode']}, {r['policy']}), {r['device']}")  # fmt: skip
    for i, x in enumerate(r["layers"]):
        split = " + ".join(f"{impl}:{b}" for impl, b in x["split"])
        print(f"  conv {i:2d} {x['input']} k{x['kernel'][:2]}/{x['strides'][0]}: {split:28s} "
              f"{x['time_s'] * 1e3:8.3f} ms (undivided {x['undivided_time_s'] * 1e3:8.3f}), "
              f"workspace {x['workspace_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    print(f"step: undivided {r['step_undivided_s'] * 1e3:.2f} ms; planned: predicted "
          f"{r['step_predicted_s'] * 1e3:.2f} ms, measured {r['step_planned_s'] * 1e3:.2f} ms; "
          f"gradients (fp32 products) equal to the undivided step's within rtol 1e-5: "
          f"{r['gradients_equal_rtol_1e-5']} (largest difference "
          f"{r['gradients_max_relative_difference']:.1e} of an array's largest entry; "
          f"{r['gradients_max_relative_difference_default_precision']:.1e} at the default "
          f"precision, TF32 on a GPU)")  # fmt: skip
    return 0
