"""How far TF32 rounding alone moves a model's gradients, emulated on a CPU.

A recent NVIDIA GPU runs fp32 matrix products and convolutions as TF32 (10-bit mantissa)
by JAX's default precision. ``refdl bench microbatch`` on a lent H100 found the planned
step's gradients 15 % (of an array's largest entry) from the undivided step's; this
rounds every convolution's inputs and output gradients to TF32 on this machine and
compares the two implementations (XLA's convolution, ``im2col``) the same way, with
each against fp32, to tell the rounding from a fault of the plan.

    .venv/bin/python scripts/tf32_gradients.py [--model resnet] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from refdl.bench.microbatch import conv_calls, grad_step, largest_difference, step_args
from refdl.config.spec import RunSpec
from refdl.core import conv
from refdl.run.build import build


def to_tf32(a: jax.Array) -> jax.Array:
    """fp32 rounded to TF32's 10 mantissa bits (to nearest, ties away from zero)."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    bits = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@jax.custom_vjp
def tf32(a: jax.Array) -> jax.Array:
    return to_tf32(a)


tf32.defvjp(lambda a: (to_tf32(a), None), lambda _, g: (to_tf32(g),))


def gradients(run, impl: str, rounded: bool, batch_size: int):
    """The step's gradients with every convolution by ``impl`` (its inputs TF32 if asked)."""
    args = step_args(run)
    plan = conv.ConvPlan([[(impl, batch_size)] for _ in conv_calls(run, args)])
    plain = conv.conv_impl
    if rounded:
        conv.conv_impl = lambda i, x, k, s, p: plain(i, tf32(x), tf32(k), s, p)
    try:
        return grad_step(run, args, plan)(*args)[1]
    finally:
        conv.conv_impl = plain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args()
    run = build(RunSpec(strategy="single", model=args.model, batch_size=args.batch_size,
                        progress=False))  # fmt: skip
    g = {
        (i, r): gradients(run, i, r, args.batch_size)
        for i in ("xla", "im2col")
        for r in (False, True)
    }
    r = {
        "model": args.model, "batch": args.batch_size, "date": time.strftime("%Y-%m-%d"),
        "fp32_xla_vs_im2col": largest_difference(g["im2col", False], g["xla", False]),
        "tf32_xla_vs_im2col": largest_difference(g["im2col", True], g["xla", True]),
        "tf32_xla_vs_fp32": largest_difference(g["xla", True], g["xla", False]),
        "tf32_im2col_vs_fp32": largest_difference(g["im2col", True], g["xla", False]),
        "measure": "largest |difference| over the array's largest entry, over the arrays",
    }  # fmt: skip
    print(json.dumps(r, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
