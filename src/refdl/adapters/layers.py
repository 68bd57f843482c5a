"""A refdl model as plain data: one JSON-ready dict per layer, with its input shape.

What a framework's own process needs to build the twin of a refdl ``Sequential``
without JAX or flax (TensorFlow and MXNet run in their own processes and, for
MXNet, their own environment; ``refdl.adapters.exchange`` carries the dicts):

- ``dense``: ``features``, ``act``, ``bias``; kernel ``(in, out)``;
- ``conv``: ``features``, ``kernel`` ``[kh, kw]``, ``strides``, ``padding``
  (``SAME``: XLA's, the odd pixel high), ``act``, ``bias``; kernel HWIO, NHWC input;
- ``pool``: ``op`` (``max``/``avg``; flax counts padded zeros in an average),
  ``window``, ``stride``, ``padding``;
- ``flatten``, ``embed`` (``vocab``, ``features``), ``lstm`` (``hidden``; gates
  i, f, g, o; ``w_ih (D, 4H)``, ``w_hh (H, 4H)``, one bias ``(4H,)``).

Each dict also has ``key`` (the layer's parameter key, e.g. ``01_dense``) and
``input`` (the input's shape for the sample batch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdl.core import layers as L
from refdl.errors import UsageError


def describe(model: Any, sample_x: np.ndarray, covers: str = "") -> list[dict[str, Any]]:
    """One dict per layer of ``model`` (a refdl ``Sequential``); a layer with no plain
    description is a one-line UsageError naming what the adapter ``covers``."""
    import jax
    import jax.numpy as jnp

    params, state = model.abstract_variables(jnp.asarray(sample_x))
    x = jax.ShapeDtypeStruct(sample_x.shape, jnp.asarray(sample_x).dtype)
    out = []
    for i, (key, layer) in enumerate(zip(model.keys, model.layers, strict=True)):
        out.append({"key": key, "input": list(x.shape), **_one(layer, key, covers)})
        stage = model.stage(i, i + 1)
        x = jax.eval_shape(lambda p, s, v, st=stage: st.apply(p, s, v)[0], params, state, x)
    return out


def _one(layer: Any, key: str, covers: str) -> dict[str, Any]:
    kind = type(layer)
    if kind is L.Dense:
        return {"kind": "dense", "features": layer.features, "act": layer.act,
                "bias": layer.use_bias}  # fmt: skip
    if kind is L.Conv:
        return {"kind": "conv", "features": layer.features, "kernel": list(layer.kernel_size),
                "strides": list(layer.strides), "padding": layer.padding, "act": layer.act,
                "bias": layer.use_bias}  # fmt: skip
    if kind is L.Pool:
        return {"kind": "pool", "op": layer.kind, "window": layer.window,
                "stride": layer.stride, "padding": layer.padding}  # fmt: skip
    if kind is L.Flatten:
        return {"kind": "flatten"}
    if kind is L.Embed:
        return {"kind": "embed", "vocab": layer.vocab_size, "features": layer.features}
    if kind is L.LSTM:
        return {"kind": "lstm", "hidden": layer.hidden}
    raise UsageError(
        f"no plain description of layer {kind.__name__} ({key}) for another framework"
        + (f"; the adapter covers {covers}" if covers else "")
    )
