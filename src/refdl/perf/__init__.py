"""Performance model: what a step should cost (compute, communication, bubble, memory)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


class Hardware(Protocol):
    """The figures of a device the cost model needs (a hardware profile provides them)."""

    peak_flops: float  # FLOP/s for the dtype in use
    memory_bandwidth: float  # bytes/s


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    """Predicted time of one training step, split the way the survey splits it."""

    compute_s: float
    comm_s: float = 0.0
    bubble_s: float = 0.0
    memory_bytes: int = 0
    flops: float = 0.0
    comm_bytes: float = 0.0

    @property
    def step_time_s(self) -> float:
        """Compute, communication and bubble, assumed not to overlap (an upper bound)."""
        return self.compute_s + self.comm_s + self.bubble_s


def roofline_time(flops: float, bytes_accessed: float, hw: Hardware) -> float:
    """Roofline compute time ``max(flops / peak, bytes / bandwidth)`` (Williams et al. 2009)."""
    return max(flops / hw.peak_flops, bytes_accessed / hw.memory_bandwidth)


def xla_cost(compiled: Any) -> tuple[float, float]:
    """``(flops, bytes accessed)`` from XLA's cost analysis of a compiled computation."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX returned one dict per computation
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))
