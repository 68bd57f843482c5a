"""2-D convolution (NHWC x HWIO), formulated for the platform it runs on.

XLA:CPU's own convolution emitter is many times slower than its matrix product
on the convolutions of small networks: few input channels (LeNet's first
layer, an RGB stem) or a window as large as the image (5x5 on 4x4 maps, 3x3 on
2x2). On those shapes the CPU program gathers the patches and multiplies
(``im2col``: the same products, summed in another order); everywhere else,
and on every other platform (cuDNN, TPU), the program is XLA's convolution.
``lax.platform_dependent`` makes the choice when the program is lowered for
its device, so one model serves a CPU and a GPU unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
_DIMS = ("NHWC", "HWIO", "NHWC")
_XLA_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("xla_only", default=False)


@contextlib.contextmanager
def xla_only(on: bool = True) -> Iterator[None]:
    """While tracing a program whose convolutions' inputs are split by channels (tensor
    parallelism), keep XLA's convolution: its partitioner gathers the input, where with
    patches it would gather the patches (kh x kw times the bytes)."""
    token = _XLA_ONLY.set(on)
    try:
        yield
    finally:
        _XLA_ONLY.reset(token)


class ConvPlan:
    """Micro-batch plans for the convolutions of a program being traced, in call order
    (μ-cuDNN, Oyama et al. 2018; ``refdl.perf.microbatch``): each entry is a list of
    ``(implementation, micro-batch size)`` covering the batch; ``None`` records the
    convolutions' signatures instead (``calls``)."""

    def __init__(self, entries: list[list[tuple[str, int]]] | None = None) -> None:
        self.entries, self.calls = entries, []

    def take(self, sig: tuple) -> list[tuple[str, int]] | None:
        self.calls.append(sig)
        return None if self.entries is None else self.entries[len(self.calls) - 1]


_PLAN: contextvars.ContextVar[ConvPlan | None] = contextvars.ContextVar("conv_plan", default=None)


@contextlib.contextmanager
def conv_plan(plan: ConvPlan) -> Iterator[ConvPlan]:
    """While tracing, run (or record) every convolution by ``plan``."""
    token = _PLAN.set(plan)
    try:
        yield plan
    finally:
        _PLAN.reset(token)


def conv_impl(impl: str, x: Array, kernel: Array, strides: tuple[int, int], padding: str) -> Array:
    """One implementation: ``xla`` (XLA's convolution; cuDNN's on a GPU) or ``im2col``."""
    if impl == "im2col":
        return im2col_conv(x, kernel, strides, padding)
    return lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=_DIMS)


def conv2d(x: Array, kernel: Array, strides: tuple[int, int], padding: str) -> Array:
    """``y[n, h, w, o] = sum_{i, j, c} x[n, h*s + i - p, w*s + j - p, c] kernel[i, j, c, o]``."""

    def xla(x: Array, kernel: Array) -> Array:
        return conv_impl("xla", x, kernel, strides, padding)

    plan = _PLAN.get()
    if plan is not None:
        split = plan.take((tuple(x.shape), tuple(kernel.shape), tuple(strides), padding))
        if split is not None:  # the micro-batches, in order, each by its implementation
            ys, first = [], 0
            for impl, b in split:
                ys.append(conv_impl(impl, x[first : first + b], kernel, strides, padding))
                first += b
            return jnp.concatenate(ys) if len(ys) > 1 else ys[0]
    if _XLA_ONLY.get() or not use_im2col(x.shape, kernel.shape, strides, padding):
        return xla(x, kernel)
    return lax.platform_dependent(
        x, kernel, cpu=lambda x, k: im2col_conv(x, k, strides, padding), default=xla
    )


def output_size(n: int, k: int, s: int, pads: tuple[int, int]) -> int:
    """Output length of a window ``k`` with stride ``s`` over ``n`` padded by ``pads``."""
    return (n + pads[0] + pads[1] - k) // s + 1


def use_im2col(
    x_shape: tuple[int, ...], k_shape: tuple[int, ...], strides: tuple[int, int], padding: str
) -> bool:
    """Whether a CPU runs this convolution faster as patches x kernel: fewer than 16 input
    channels, or an output of at most 2x2 (measured on 2 cores, docs/speed.md)."""
    _, h, w, c = x_shape
    kh, kw = k_shape[:2]
    pads = lax.padtype_to_pads((h, w), (kh, kw), strides, padding)
    ho = output_size(h, kh, strides[0], pads[0])
    wo = output_size(w, kw, strides[1], pads[1])
    return c < 16 or ho * wo <= 4


def im2col_conv(x: Array, kernel: Array, strides: tuple[int, int], padding: str) -> Array:
    """The convolution as one matrix product: every output position's ``kh x kw x C``
    window (in the kernel's ``(i, j, c)`` order) times the kernel reshaped to ``(kh kw C, O)``."""
    n, h, w, c = x.shape
    kh, kw, _, o = kernel.shape
    sh, sw = strides
    pads = lax.padtype_to_pads((h, w), (kh, kw), strides, padding)
    ho, wo = output_size(h, kh, sh, pads[0]), output_size(w, kw, sw, pads[1])
    xp = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    ends = lambda i, j: (n, i + sh * (ho - 1) + 1, j + sw * (wo - 1) + 1, c)  # noqa: E731
    cols = [lax.slice(xp, (0, i, j, 0), ends(i, j), (1, sh, sw, 1)) for i in range(kh)
            for j in range(kw)]  # fmt: skip
    patches = jnp.concatenate(cols, axis=-1) if len(cols) > 1 else cols[0]
    y = jnp.dot(patches.reshape(n * ho * wo, kh * kw * c), kernel.reshape(kh * kw * c, o))
    return y.reshape(n, ho, wo, o)
