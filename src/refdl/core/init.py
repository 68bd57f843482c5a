"""Initialisation schemes: refdl's own, and the defaults of the frameworks users compare.

refdl's layers draw Dense and convolution kernels LeCun-normal and biases zero.
A framework's own run starts from *its* defaults, which learn at another pace
(PyTorch's ``nn.Linear`` at its default starts the digits MLP several times
slower), so a statistical comparison with such a run must draw refdl's seeds
from the same distribution (``--init``):

- ``lecun_normal`` (refdl's): kernels ``N(0, 1/fan_in)`` (truncated, flax's), biases 0;
- ``torch``: PyTorch's ``nn.Linear``/``nn.Conv2d`` default: kernels
  ``kaiming_uniform(a=sqrt(5))`` = ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, biases
  ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``;
- ``keras``: Keras' ``Dense``/``Conv2D`` default: kernels Glorot-uniform
  ``U(-sqrt(6/(fan_in+fan_out)), ...)``, biases 0;
- ``mxnet``: a bare ``net.initialize()`` in MXNet Gluon: ``mx.init.Uniform(0.07)``, kernels
  ``U(-0.07, 0.07)`` whatever the fan, biases 0.

Only Dense and convolution layers are redrawn (fan-in of a ``(kh, kw, in, out)``
kernel: ``kh kw in``); other layers keep refdl's draws.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from refdl.config.choices import INIT_SCHEMES

PyTree = Any


def _uniform(key: jax.Array, shape: tuple[int, ...], bound: float, dtype: Any) -> jax.Array:
    """``U(-bound, bound)`` drawn in fp32 and cast to ``dtype``."""
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def redraw(params: PyTree, model: Any, scheme: str, key: jax.Array) -> PyTree:
    """``params`` with every Dense and convolution layer redrawn from ``scheme``."""
    if scheme == "lecun_normal":
        return params
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"unknown initialisation {scheme!r}")
    from refdl.core.layers import Conv, Dense

    out = dict(params)
    keys = jax.random.split(key, len(model.keys))
    for k, layer_key, layer in zip(keys, model.keys, model.layers, strict=True):
        if not isinstance(layer, Dense | Conv) or "kernel" not in params.get(layer_key, {}):
            continue
        p = dict(params[layer_key])
        shape = p["kernel"].shape
        fan_in = math.prod(shape[:-1])
        fan_out = math.prod(shape[:-2]) * shape[-1]
        kk, kb = jax.random.split(k)
        dtype = p["kernel"].dtype  # drawn in fp32 and cast: an fp64 run starts where fp32 does
        draw = functools.partial(_uniform, dtype=dtype)
        if scheme == "torch":
            bound = 1.0 / math.sqrt(fan_in)
            p["kernel"] = draw(kk, shape, bound)
            if "bias" in p:
                p["bias"] = draw(kb, p["bias"].shape, bound)
        else:  # keras; mxnet: a fixed scale
            bound = 0.07 if scheme == "mxnet" else math.sqrt(6.0 / (fan_in + fan_out))
            p["kernel"] = draw(kk, shape, bound)
            if "bias" in p:
                p["bias"] = jnp.zeros_like(p["bias"])
        out[layer_key] = p
    return out
