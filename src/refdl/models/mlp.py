"""MLP (fully connected network): flatten, hidden ReLU layers, linear classifier."""

from __future__ import annotations

from refdl.config.values import Ints, Option
from refdl.core.layers import Dense, Flatten, Sequential
from refdl.models.base import ModelDef, register


def build(info, hidden: tuple[int, ...] = (256, 256)) -> Sequential:
    """``Flatten -> [Dense(h, relu)]* -> Dense(classes)``; hidden layers alternate the
    ``mlp``/``embed`` axes so tensor parallelism pairs them column-then-row."""
    layers = [Flatten()]
    in_axis = "embed"
    for i, h in enumerate(hidden):
        out_axis = "mlp" if i % 2 == 0 else "embed"
        layers.append(Dense(h, in_axis, out_axis, act="relu"))
        in_axis = out_axis
    layers.append(Dense(info.num_classes, in_axis, None))
    return Sequential(tuple(layers))


MLP = register(
    ModelDef(
        name="mlp",
        build=build,
        data_kind="image",
        options={"hidden": Option((256, 256), Ints(1, 1 << 16), "hidden layer widths")},
        defaults={"optimizer": "momentum", "lr": 0.05, "dataset": "digits"},
        doc="fully connected network (FCN)",
    )
)
