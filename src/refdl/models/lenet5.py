"""LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling, for any small image size.

Both convolutions use SAME padding so the net also fits 8x8 digits:
28x28 -> conv 6 -> pool -> 14x14 -> conv 16 -> pool -> 7x7x16 -> 120 -> 84 -> classes;
8x8 -> ... -> 2x2x16 -> 120 -> 84 -> classes.
"""

from __future__ import annotations

from refdl.core.layers import Conv, Dense, Flatten, Pool, Sequential
from refdl.models.base import ModelDef, register


def build(info, conv: tuple[int, ...] = (6, 16), fc: tuple[int, ...] = (120, 84)) -> Sequential:
    """Conv(5x5)-pool twice, flatten, two fully connected ReLU layers, classifier."""
    layers = []
    for c in conv:
        layers += [Conv(c, (5, 5), act="relu"), Pool("max", 2, 2, "SAME")]
    layers.append(Flatten())
    in_axis = "embed"
    for i, h in enumerate(fc):
        out_axis = "mlp" if i % 2 == 0 else "embed"
        layers.append(Dense(h, in_axis, out_axis, act="relu"))
        in_axis = out_axis
    layers.append(Dense(info.num_classes, in_axis, None))
    return Sequential(tuple(layers))


LENET5 = register(
    ModelDef(
        name="lenet5",
        build=build,
        data_kind="image",
        options={"conv": (6, 16), "fc": (120, 84)},
        # lr 0.03: at 0.04-0.05 the trajectory is chaotic (fp32 summation-order differences
        # of 1e-11 grow to 1e-3 in 300 steps), so no two strategies could agree to 1e-5.
        defaults={"optimizer": "momentum", "lr": 0.03, "dataset": "digits"},
        doc="LeNet-5 convolutional network",
    )
)
