"""How well an architecture uses a device, relative to ResNet-50 (``architectures.toml``).

On one GPU the fraction of peak FLOP/s a training step achieves depends on the
architecture as much as on the device: in the published calibration steps
AlexNet and VGG-16 (large 3x3 convolutions, Winograd's saving, few memory-bound
passes) achieve ~2.6x what ResNet-50 does on the same card, Inception and
GoogLeNet (many small and 1x1 convolutions, concatenations) ~0.85x. A
profile's ``[achieved.device]`` fraction is ResNet-50's; this factor scales it
per convolutional architecture. ``scripts/fit_achieved.py`` fits both on the
calibration part of ``docs/published/measurements.toml`` (log-space least
squares of ``time = FLOPs / (peak x fraction[device] x factor[model])``). A
model with no calibration step of its own takes its family's factor (VGG-19:
VGG-16's, the same 3x3 stacks and classifier with three more convolutions; BVLC's
grouped AlexNet: the one-tower AlexNet's, the same widths); ResNet v1 (the stride in the
1x1) shares v1.5's, its steps fitted with them;
one with neither gets 1 (ResNet-50's), and so do GEMM-class models (their
device fraction is fitted on themselves).
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Any

FILE = Path(__file__).with_name("architectures.toml")
# A model without calibration steps of its own -> the fitted model of its family.
# A model that shares its family's factor: fitted on the family's steps (the same layers,
# one stride moved: ResNet v1 beside the zoo's v1.5), or taken when it has no steps.
FAMILY = {"vgg19": "vgg16", "alexnet_bvlc": "alexnet",  # BVLC: the paper's widths, grouped
          "resnet50_v1": "resnet50", "resnet101_v1": "resnet101"}  # fmt: skip


def fitted_as(model: str) -> str:
    """The model whose factor ``model``'s steps fit and use: its family's where it has one."""
    return FAMILY.get(model, model)


@functools.cache
def _table() -> dict[str, dict]:
    if not FILE.exists():
        return {}
    return tomllib.loads(FILE.read_text()).get("model", {})


def _entry(model: str) -> tuple[str, dict]:
    """(the model whose fit applies, its entry): its own, else its family's, else none."""
    table = _table()
    if model not in table and FAMILY.get(model) in table:
        return FAMILY[model], table[FAMILY[model]]
    return model, table.get(model, {})


def factor(model: str) -> float:
    """The architecture's achieved fraction relative to ResNet-50's on the same device."""
    return float(_entry(model)[1].get("factor", 1.0))


def source(model: str) -> str | None:
    """Where ``model``'s factor comes from (None: no factor, 1 assumed)."""
    fitted, entry = _entry(model)
    if "source" not in entry:
        return None
    if fitted != model:
        return f"{fitted}'s factor (same family, fitted on the family's steps): {entry['source']}"
    return entry["source"]


def architecture_factor(m: Any) -> float:
    """How well model cost ``m``'s architecture uses a device relative to ResNet-50's (1
    for anything but a convolutional model)."""
    return factor(m.name) if m.op_class == "conv" else 1.0


def expected_view(profile: Any, precision: str, m: Any, library: str | None = None) -> Any:
    """The profile's expected figures for model cost ``m`` in ``precision``: its op
    class's achieved fraction, times its architecture's factor (``refdl predict`` and
    ``refdl plan`` price with the same view)."""
    return profile.view("expected", precision, m.op_class, library, architecture_factor(m))
