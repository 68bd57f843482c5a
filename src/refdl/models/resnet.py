"""CIFAR-style ResNet (He et al. 2016, section 4.2): depth 6n+2, three stages 16/32/64.

Depth 20/32/44/56 gives n = 3/5/7/9 basic blocks per stage; option-A shortcuts
(parameter-free), BatchNorm, global average pooling and one linear classifier.
"""

from __future__ import annotations

from refdl.config.values import Int, Option
from refdl.core.layers import (
    ConvBN,
    Dense,
    GlobalAvgPool,
    ResidualBlock,
    Sequential,
)
from refdl.errors import UsageError
from refdl.models.base import ModelDef, register

DEPTHS = (20, 32, 44, 56)


def build(info, depth: int = 20, width: int = 16) -> Sequential:
    """Stem, 3 stages of (depth-2)/6 blocks (widths w, 2w, 4w), pool, classifier."""
    if depth < 8 or (depth - 2) % 6:
        raise UsageError(f"resnet depth must be 6n+2 (e.g. {DEPTHS}); got {depth}")
    n = (depth - 2) // 6
    layers = [ConvBN(width, act="relu")]
    for stage, w in enumerate((width, 2 * width, 4 * width)):
        for b in range(n):
            layers.append(ResidualBlock(w, 2 if (stage > 0 and b == 0) else 1))
    layers += [GlobalAvgPool(), Dense(info.num_classes, "embed", None)]
    return Sequential(tuple(layers))


RESNET = register(
    ModelDef(
        name="resnet",
        build=build,
        data_kind="image",
        options={
            "depth": Option(20, Int(8, 1000), "layers, 6n+2"),
            "width": Option(16, Int(1, 4096), "channels of the first stage"),
        },
        defaults={"optimizer": "momentum", "lr": 0.05, "dataset": "digits"},
        doc="CIFAR ResNet (depth 20/32/44/56)",
    )
)
