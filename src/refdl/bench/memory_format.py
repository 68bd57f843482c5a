"""What a framework's NCHW layout costs a convolutional step on tensor cores.

cuDNN's tensor-core convolutions want channels last (NHWC); a framework that keeps
PyTorch's default contiguous NCHW layout in mixed precision pays a transpose around
every convolution (NVIDIA, "Convolutional Layers User's Guide", tensor layout). refdl
runs under XLA, which picks the layout itself, and the profiles' fractions are fitted
on channels-last or XLA steps; a published step that says it ran NCHW in fp16/bf16 is
priced slower by the measured ratio of its device's generation below (ResNet-50-class
networks; a whole step, not one convolution). In fp32/TF32 NCHW costs nothing to
price: PyTorch's maintainers expect channels last to help only 16-bit inputs
(pytorch/pytorch#44943), and DeepLearningExamples' own TF32 tables ran NCHW.
"""

from __future__ import annotations

import dataclasses
import math

FORMATS = ("nchw", "nhwc")
TENSOR_CORE_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class NchwCost:
    """A measured step-time ratio NCHW / NHWC of one device generation, with its source."""

    factor: float
    source: str


# Per device name (refdl.hw's [device] name): measured, each from its own source.
MEASURED = {
    "Tesla V100 SXM2": NchwCost(
        0.259 / 0.198,  # 1.31
        "pytorch/tutorials intermediate_source/memory_format_tutorial.py (commit "
        "061d3b2a), 'Performance Gains': apex main_amp.py -a resnet50 --b 200 "
        "--opt-level O2 on Volta, cuDNN 7.6.3: Time 0.259 s contiguous, 0.198 s with "
        "--channels-last true (iterations 20-80)",
    ),
    "A100 SXM": NchwCost(
        627.030 / 420.047,  # 1.49
        "NVIDIA/DeepLearningExamples pull request #1017 (2021-10-15), SSD with a "
        "ResNet-50 backbone, --bs 256 --amp benchmark-training on an A100 80GB: "
        "420.047 images/s NCHW, 627.030 NHWC; NVIDIA/apex issue #1445 (2022-08-03) "
        "measured 1.50 on ResNet-50 (main_amp.py --b 200 -O2: 0.139 s and 0.093 s, an "
        "A100-class 2,150 images/s; the card is not named)",
    ),
}
# A tensor-core device without a measurement of its own borrows the nearest measured
# generation's (the H100's transposes are likely dearer still: its FLOP/s per byte of
# memory bandwidth is about twice the A100's).
BORROW = {"H100 SXM": "A100 SXM"}


def borrowed_log_spread() -> float:
    """How far a borrowed ratio could be from the device's own: half the log-range of the
    measured generations' ratios, added to both sides of the step's interval (as a
    borrowed link's or device's figure widens it by the spread of those it could have
    been)."""
    factors = [c.factor for c in MEASURED.values()]
    return 0.5 * math.log(max(factors) / min(factors))


def nchw_cost(device: str, dtype: str, memory_format: str) -> tuple[float, bool, str]:
    """(factor on the step time, whether it is borrowed, its source) of a step that ran
    in ``memory_format`` at ``dtype`` on ``device``; (1, False, "") where nothing is paid
    (NHWC, unstated, fp32/TF32, a device without tensor cores or a measured
    generation)."""
    if memory_format != "nchw" or dtype not in TENSOR_CORE_DTYPES:
        return 1.0, False, ""
    if device in MEASURED:
        cost = MEASURED[device]
        return cost.factor, False, cost.source
    if BORROW.get(device) in MEASURED:
        cost = MEASURED[BORROW[device]]
        return cost.factor, True, f"borrowed from {BORROW[device]}: {cost.source}"
    return 1.0, False, ""
