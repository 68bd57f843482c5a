"""Gluon twins of refdl layers, built from ``refdl.adapters.layers``' plain descriptions.

refdl feeds NHWC images; MXNet's CPU convolutions and pools want NCHW, so the
first convolution or pool transposes in and ``flatten`` transposes back before
flattening (Dense kernels keep refdl's row order). Layouts: Dense ``(in, out)``
-> ``weight (out, in)``; convolution HWIO -> OIHW. SAME padding is XLA's (the odd
pixel high), applied with an explicit pad (MXNet pads symmetrically); an average
pool counts the padded zeros, as flax does (``count_include_pad``).
"""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np
from mxnet import gluon

from refdl.adapters.exchange import Flat, same_pads

ACTIVATIONS = ("relu", "tanh", "sigmoid")


def _act(x: Any, name: str | None) -> Any:
    if name is None:
        return x
    if name not in ACTIVATIONS:
        raise ValueError(f"no MXNet twin for activation {name!r}")
    return mx.nd.Activation(x, act_type=name)


def _pad(x: Any, spec: dict[str, Any], k: tuple[int, int], s: tuple[int, int], value: float):
    """XLA's SAME padding of NCHW ``x`` for kernel ``k`` and strides ``s``."""
    h, w = spec["input"][1:3]
    (t, b), (left, r) = same_pads(h, k[0], s[0]), same_pads(w, k[1], s[1])
    if not (t or b or left or r):
        return x
    return mx.nd.pad(x, mode="constant", constant_value=value,
                     pad_width=(0, 0, 0, 0, t, b, left, r))  # fmt: skip


class Twin(gluon.Block):
    """The refdl model, layer by layer (``blocks[key]`` holds each parametrised layer)."""

    def __init__(self, layers: list[dict[str, Any]]) -> None:
        super().__init__()
        self.specs = layers
        self.blocks: dict[str, Any] = {}
        with self.name_scope():
            for spec in layers:
                block = self._block(spec)
                if block is not None:
                    self.register_child(block, spec["key"])
                    self.blocks[spec["key"]] = block

    @staticmethod
    def _block(spec: dict[str, Any]) -> Any:
        if spec["kind"] == "dense":
            return gluon.nn.Dense(spec["features"], in_units=spec["input"][-1], flatten=False,
                                  use_bias=spec["bias"])  # fmt: skip
        if spec["kind"] == "conv":
            k, st = tuple(spec["kernel"]), tuple(spec["strides"])
            return gluon.nn.Conv2D(spec["features"], k, st, in_channels=spec["input"][-1],
                                   use_bias=spec["bias"])  # fmt: skip
        if spec["kind"] in ("pool", "flatten"):
            return None
        raise ValueError(f"no MXNet twin for layer kind {spec['kind']!r} ({spec['key']}); "
                         "the adapter covers mlp and lenet5")  # fmt: skip

    def forward(self, x: Any) -> Any:
        nchw = False
        for spec in self.specs:
            kind = spec["kind"]
            if kind in ("conv", "pool") and not nchw:
                x, nchw = x.transpose((0, 3, 1, 2)), True
            if kind == "dense":
                x = _act(self.blocks[spec["key"]](x), spec["act"])
            elif kind == "conv":
                k, s = tuple(spec["kernel"]), tuple(spec["strides"])
                if spec["padding"] == "SAME":
                    x = _pad(x, spec, k, s, 0.0)
                x = _act(self.blocks[spec["key"]](x), spec["act"])
            elif kind == "pool":
                w, st = (spec["window"],) * 2, (spec["stride"],) * 2
                if spec["padding"] == "SAME":
                    x = _pad(x, spec, w, st, 0.0 if spec["op"] == "avg" else -np.inf)
                x = mx.nd.Pooling(x, kernel=w, stride=st, pool_type=spec["op"],
                                  count_include_pad=True)  # fmt: skip
            elif kind == "flatten":
                if nchw:
                    x, nchw = x.transpose((0, 2, 3, 1)), False
                x = x.reshape((x.shape[0], -1))
        return x


# refdl name -> (Gluon parameter, to MXNet layout, from MXNet layout)
LAYOUTS = {
    "dense": {"kernel": ("weight", lambda a: a.T, lambda a: a.T), "bias": ("bias", None, None)},
    "conv": {"kernel": ("weight", lambda a: a.transpose(3, 2, 0, 1),
                        lambda a: a.transpose(2, 3, 1, 0)),
             "bias": ("bias", None, None)},
}  # fmt: skip


def _links(net: Twin):
    for spec in net.specs:
        if spec["key"] in net.blocks:
            block = net.blocks[spec["key"]]
            for name, (attr, to_mx, from_mx) in LAYOUTS[spec["kind"]].items():
                param = getattr(block, attr, None)
                if param is not None:
                    yield (
                        f"{spec['key']}/{name}",
                        param,
                        to_mx or (lambda a: a),
                        from_mx or (lambda a: a),
                    )


def build(layers: list[dict[str, Any]], params: Flat, contexts: list) -> Twin:
    """The Gluon model of ``layers`` on ``contexts`` with refdl's ``params`` copied in."""
    net = Twin(layers)
    net.initialize(mx.init.Zero(), ctx=contexts)
    for path, param, to_mx, _ in _links(net):
        value = np.ascontiguousarray(to_mx(np.asarray(params[path], np.float32)))
        if value.shape != param.shape:
            raise ValueError(f"{path}: refdl {value.shape} vs MXNet {param.shape}")
        param.set_data(mx.nd.array(value, dtype="float32"))
    return net


def export(net: Twin) -> Flat:
    """The parameters in refdl's flat layout (from the first context)."""
    return {path: np.array(from_mx(param.list_data()[0].asnumpy()), np.float32, order="C")
            for path, param, _, from_mx in _links(net)}  # fmt: skip
