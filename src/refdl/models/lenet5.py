"""LeNet-5 (LeCun et al. 1998): tanh units and average-pooling subsampling, any small image.

tanh and average pooling are the original's, and they keep the trajectory
smooth: with ReLU and max-pooling (``--model-opt act=relu --model-opt
pool=max``) pooling ties on the digits' blank pixels flip with fp32 summation
order, and two strategies' runs drift apart by ~1e-3 within 300 steps instead
of ~1e-10.

C1 has 8 feature maps instead of the original 6, so that every layer splits
evenly over model degrees 2 and 4 (tensor parallelism splits convolutions by
output channels); ``--model-opt conv=6,16`` gives the original widths.
Both convolutions use SAME padding so the net also fits 8x8 digits:
28x28 -> conv 8 -> pool -> 14x14 -> conv 16 -> pool -> 7x7x16 -> 120 -> 84 -> classes;
8x8 -> ... -> 2x2x16 -> 120 -> 84 -> classes.
"""

from __future__ import annotations

from refdl.config.values import Choice, Ints, Option
from refdl.core.layers import Conv, Dense, Flatten, Pool, Sequential
from refdl.models.base import ModelDef, register


def build(
    info,
    conv: tuple[int, ...] = (8, 16),
    fc: tuple[int, ...] = (120, 84),
    act: str = "tanh",
    pool: str = "avg",
) -> Sequential:
    """Conv(5x5)-pool twice, flatten, two fully connected layers, classifier."""
    layers = []
    for c in conv:
        layers += [Conv(c, (5, 5), act=act), Pool(pool, 2, 2, "SAME")]
    layers.append(Flatten())
    in_axis = "embed"
    for i, h in enumerate(fc):
        out_axis = "mlp" if i % 2 == 0 else "embed"
        layers.append(Dense(h, in_axis, out_axis, act=act))
        in_axis = out_axis
    layers.append(Dense(info.num_classes, in_axis, None))
    return Sequential(tuple(layers))


LENET5 = register(
    ModelDef(
        name="lenet5",
        build=build,
        data_kind="image",
        options={
            "conv": Option((8, 16), Ints(1, 4096), "feature maps of the 5x5 convolutions"),
            "fc": Option((120, 84), Ints(1, 1 << 16), "fully connected widths"),
            "act": Option("tanh", Choice(("tanh", "relu", "sigmoid", "gelu")), "activation"),
            "pool": Option("avg", Choice(("avg", "max")), "subsampling"),
        },
        defaults={"optimizer": "momentum", "lr": 0.05, "dataset": "digits"},
        doc="LeNet-5 convolutional network",
    )
)
