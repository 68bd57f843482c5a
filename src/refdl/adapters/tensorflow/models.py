"""Keras twins of refdl layers, built from ``refdl.adapters.layers``' plain descriptions.

Layouts are refdl's already (NHWC, Dense kernels ``(in, out)``, convolution
kernels HWIO, LSTM ``kernel (D, 4H)``, ``recurrent_kernel (H, 4H)``, one bias,
gates i, f, g(c), o), so weights copy without transposes. Two details differ
and are matched: an average pool over SAME padding counts the padded zeros in
flax (``count_include_pad``) and not in Keras, so the twin pads with zeros and
pools VALID; Keras' ``same`` convolution padding is XLA's (the odd pixel high).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from refdl.adapters.exchange import Flat, same_pads

ACTIVATIONS = {None: None, "relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid"}
# refdl parameter names of each layer kind, in the order Keras keeps its weights.
WEIGHTS = {
    "dense": ("kernel", "bias"),
    "conv": ("kernel", "bias"),
    "embed": ("embedding",),
    "lstm": ("w_ih", "w_hh", "bias"),
}


def _activation(name: str | None) -> str | None:
    if name not in ACTIVATIONS:
        raise ValueError(f"no Keras twin for activation {name!r}")
    return ACTIVATIONS[name]


def _layers(spec: dict[str, Any]) -> list[Any]:
    kind = spec["kind"]
    if kind == "dense":
        return [keras.layers.Dense(spec["features"], activation=_activation(spec["act"]),
                                   use_bias=spec["bias"], name=spec["key"])]  # fmt: skip
    if kind == "conv":
        return [keras.layers.Conv2D(
            spec["features"], tuple(spec["kernel"]), tuple(spec["strides"]),
            padding=spec["padding"].lower(), activation=_activation(spec["act"]),
            use_bias=spec["bias"], name=spec["key"],
        )]  # fmt: skip
    if kind == "pool":
        w, s = spec["window"], spec["stride"]
        pool = keras.layers.MaxPooling2D if spec["op"] == "max" else keras.layers.AveragePooling2D
        if spec["padding"] == "SAME" and spec["op"] == "avg":
            h, wd = spec["input"][1:3]
            pads = (same_pads(h, w, s), same_pads(wd, w, s))
            return [keras.layers.ZeroPadding2D(pads), pool((w, w), (s, s), padding="valid")]
        return [pool((w, w), (s, s), padding=spec["padding"].lower(), name=spec["key"])]
    if kind == "flatten":
        return [keras.layers.Flatten(name=spec["key"])]
    if kind == "embed":
        return [keras.layers.Embedding(spec["vocab"], spec["features"], name=spec["key"])]
    if kind == "lstm":
        return [keras.layers.LSTM(spec["hidden"], return_sequences=True, name=spec["key"])]
    raise ValueError(f"no Keras twin for layer kind {kind!r} ({spec['key']})")


def build(layers: list[dict[str, Any]], params: Flat) -> keras.Model:
    """The Keras model of ``layers`` with refdl's ``params`` loaded."""
    first = layers[0]
    dtype = "int32" if first["kind"] == "embed" else "float32"
    model = keras.Sequential([keras.Input(tuple(first["input"][1:]), dtype=dtype)])
    for spec in layers:
        for layer in _layers(spec):
            model.add(layer)
    load(model, layers, params)
    return model


def _named(model: keras.Model, layers: list[dict[str, Any]]):
    for spec in layers:
        if spec["kind"] in WEIGHTS:
            yield spec, model.get_layer(spec["key"])


def load(model: keras.Model, layers: list[dict[str, Any]], params: Flat) -> None:
    """Copy refdl's parameters (flat paths ``key/name``) into the Keras layers."""
    for spec, layer in _named(model, layers):
        names = WEIGHTS[spec["kind"]][: len(layer.get_weights())]
        values = [np.asarray(params[f"{spec['key']}/{n}"], np.float32) for n in names]
        for n, v, w in zip(names, values, layer.get_weights(), strict=True):
            if v.shape != w.shape:
                raise ValueError(f"{spec['key']}/{n}: refdl {v.shape} vs Keras {w.shape}")
        layer.set_weights(values)


def export(model: keras.Model, layers: list[dict[str, Any]]) -> Flat:
    """The Keras model's parameters in refdl's flat layout."""
    out: Flat = {}
    for spec, layer in _named(model, layers):
        for n, w in zip(WEIGHTS[spec["kind"]], layer.get_weights(), strict=False):
            out[f"{spec['key']}/{n}"] = np.array(w, np.float32, copy=True)
    return out
