"""How well an architecture uses a device, relative to ResNet-50 (``architectures.toml``).

On one GPU the fraction of peak FLOP/s a training step achieves depends on the
architecture as much as on the device: in the published calibration steps
AlexNet and VGG-16 (large 3x3 convolutions, Winograd's saving, few memory-bound
passes) achieve ~2.6x what ResNet-50 does on the same card, Inception and
GoogLeNet (many small and 1x1 convolutions, concatenations) ~0.85x. A
profile's ``[achieved.device]`` fraction is ResNet-50's; this factor scales it
per convolutional architecture. ``scripts/fit_achieved.py`` fits both on the
calibration part of ``docs/published/measurements.toml`` (log-space least
squares of ``time = FLOPs / (peak x fraction[device] x factor[model])``); a
model without a factor gets 1 (ResNet-50's), and so do GEMM-class models
(their device fraction is fitted on themselves).
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path

FILE = Path(__file__).with_name("architectures.toml")


@functools.cache
def _table() -> dict[str, dict]:
    if not FILE.exists():
        return {}
    return tomllib.loads(FILE.read_text()).get("model", {})


def factor(model: str) -> float:
    """The architecture's achieved fraction relative to ResNet-50's on the same device."""
    return float(_table().get(model, {}).get("factor", 1.0))


def source(model: str) -> str | None:
    """Where ``model``'s factor comes from (None: no factor, 1 assumed)."""
    return _table().get(model, {}).get("source")
