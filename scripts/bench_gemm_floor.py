"""How fast a model's single-device step could be with each framework's matrix products:
every product of refdl's training step (its jaxpr, scans counted by their length), timed
alone at its canonical shape (batch x M x K times batch x K x N) by XLA:CPU and by
PyTorch, summed, beside both frameworks' whole measured steps (issue 21).

A step cannot be faster than its products; where refdl's products alone take longer than
PyTorch's whole step divided by 1.2, no change to the rest of refdl's step reaches 1.2x
PyTorch with XLA:CPU's kernels. Both frameworks time the same canonical problems (no
transposes), so the floors compare the kernel libraries and nothing else.

    .venv/bin/python scripts/bench_gemm_floor.py --models lstm_lm,transformer \
        --out docs/bench/compare/gemm_floor.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def products(jaxpr, times: int = 1, out=None) -> collections.Counter:
    """``{(batch, M, K, N): count}`` of every ``dot_general`` in ``jaxpr`` and its
    sub-jaxprs (a scan's body counts ``length`` times)."""
    out = collections.Counter() if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _rc), (lb, _rb) = eqn.params["dimension_numbers"]
            ls, rs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            size = lambda shape, axes: math.prod(shape[a] for a in axes)  # noqa: E731
            b, k = size(ls, lb), size(ls, lc)
            m = math.prod(ls) // (b * k)
            n = math.prod(rs) // (b * k)
            out[(b, m, k, n)] += times
        reps = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for sub in _subjaxprs(eqn):
            products(sub, reps, out)
    return out


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):  # ClosedJaxpr
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def _operands(b: int, m: int, k: int, n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.standard_normal((b, m, k), dtype=np.float32),
            rng.standard_normal((b, k, n), dtype=np.float32))  # fmt: skip


def time_xla(b: int, m: int, k: int, n: int) -> float:
    """Seconds per ``[b, m, k] x [b, k, n]`` by XLA:CPU: one jitted product, waited for."""
    import jax
    import jax.numpy as jnp

    a, c = (jnp.asarray(x) for x in _operands(b, m, k, n))
    if b == 1:
        f = jax.jit(lambda x, y: x[0] @ y[0])
    else:
        f = jax.jit(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y))
    return _per_call(lambda: f(a, c).block_until_ready(), _reps(b, m, k, n))


def time_torch(b: int, m: int, k: int, n: int) -> float:
    """Seconds per ``[b, m, k] x [b, k, n]`` by PyTorch (``torch.mm`` / ``torch.bmm``)."""
    import torch

    a, c = (torch.from_numpy(x) for x in _operands(b, m, k, n))
    if b == 1:
        a, c, op = a[0], c[0], torch.mm
    else:
        op = torch.bmm
    return _per_call(lambda: op(a, c), _reps(b, m, k, n))


def _per_call(fn, reps: int) -> float:
    """Seconds per call: the best of three loops of ``reps`` calls (``timing.best``)."""
    from refdl.hw.calibrate.timing import best

    return best(lambda: [fn() for _ in range(reps)], repeats=3) / reps


def _reps(b: int, m: int, k: int, n: int) -> int:
    return max(3, min(200, int(1e8 / (b * m * k * n))))


def floors(shapes: collections.Counter) -> list[dict]:
    """Each canonical product of a step, timed alone: all of XLA's first, then all of
    PyTorch's (PyTorch's OpenMP threads spin after each call and would slow XLA's)."""
    order = sorted(shapes.items(), key=lambda kv: -math.prod(kv[0]) * kv[1])
    xla = [time_xla(*shape) for shape, _ in order]
    torch_ = [time_torch(*shape) for shape, _ in order]
    return [{"batch": b, "m": m, "k": k, "n": n, "count": count, "flops": 2 * b * m * k * n,
             "xla_s": tx, "torch_s": tt}
            for ((b, m, k, n), count), tx, tt in zip(order, xla, torch_, strict=True)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lstm_lm,transformer")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=45, help="whole steps timed per framework")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)

    import jax

    from refdl.bench.compare import refdl_step_times, torch_step_times
    from refdl.config.spec import RunSpec
    from refdl.run.build import build

    out = {"command": " ".join(["scripts/bench_gemm_floor.py", *(argv or sys.argv[1:])]),
           "date": datetime.date.today().isoformat(), "jax": jax.__version__,
           "batch": args.batch_size, "models": {}}  # fmt: skip
    for model in args.models.split(","):
        run = build(RunSpec(strategy="single", model=model, batch_size=args.batch_size,
                            progress=False))  # fmt: skip
        state = run.strategy.init_state(0)
        step = functools.partial(run.task.step, microbatches=run.plan.microbatches)
        closed = jax.make_jaxpr(step)(state, run.batch(0))
        # Whole steps first: refdl here, PyTorch in a process of its own (bench compare's
        # way), before this process has run any PyTorch product.
        warm = 5
        refdl = statistics.median(
            refdl_step_times(model, "single", 1, args.steps, args.batch_size, 10)[warm:]
        )
        torch_ = statistics.median(
            torch_step_times(model, "single", 1, args.steps, args.batch_size)[warm:]
        )
        rows = floors(products(closed.jaxpr))
        fx = sum(r["xla_s"] * r["count"] for r in rows)
        ft = sum(r["torch_s"] * r["count"] for r in rows)
        flops = sum(r["flops"] * r["count"] for r in rows)
        out["models"][model] = {
            "products": rows, "product_flops": flops,
            "xla_floor_s": fx, "torch_floor_s": ft,
            "refdl_step_s": refdl, "torch_step_s": torch_,
            "ratio_now": torch_ / refdl,
            "ratio_ceiling_xla": torch_ / fx,
        }  # fmt: skip
        print(f"{model}: {flops / 1e9:.2f} GFLOP of products a step; alone: XLA "
              f"{fx * 1e3:.1f} ms ({flops / fx / 1e9:.0f} GFLOP/s), PyTorch {ft * 1e3:.1f} ms "
              f"({flops / ft / 1e9:.0f} GFLOP/s); whole step: refdl {refdl * 1e3:.1f} ms, "
              f"PyTorch {torch_ * 1e3:.1f} ms; refdl/PyTorch now {torch_ / refdl:.2f}, at most "
              f"{torch_ / fx:.2f} with XLA's products")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
