"""The library's entries that take a strategy by its registered name (``refdl.predict_steps``).

The performance model never imports the strategies, so its functions take a
strategy's ``Traits``; this module, above both, looks the traits up by name for a
library caller.
"""

from __future__ import annotations

from typing import Any

from refdl.perf import prediction
from refdl.strategies import traits_of


def predict_steps(
    hw_name: str,
    strategy: str,
    model: str,
    batch_size: int,
    workers: list[int],
    scaling: str = "strong",
    opts: Any = None,
    precision: str = "fp32",
    library: str | None = None,
) -> list[dict[str, Any]]:
    """``refdl.perf.prediction.predict_steps`` for the strategy registered as ``strategy``:
    one row per worker count (step time, its terms and interval, speed-up, memory)."""
    return prediction.predict_steps(hw_name, strategy, traits_of(strategy), model, batch_size,
                                    workers, scaling, opts, precision, library)  # fmt: skip
