"""``model``: tensor (operator) parallelism over the ``model`` mesh axis.

Megatron-style: in each pair of dense layers the first is split by output
units (columns) and the second by input units (rows), so one all-reduce joins
them; attention is split by heads; convolutions by output channels; LSTM gates
by units. The rules act on the logical axis names the layers carry
(``refdl.config.rules``); the model code stays single-device. This is
``hybrid`` with every device on ``model``.
"""

from __future__ import annotations

from refdl.config.plan import Traits
from refdl.strategies.base import register
from refdl.strategies.hybrid import Hybrid


@register("model")
class ModelParallel(Hybrid):
    """All devices on the ``model`` axis (``--mesh`` defaults to ``model=<devices>``)."""

    traits = Traits(
        axes=("model",),
        options=frozenset({"mesh", "sequence_parallel"}),
        multiprocess="spmd",
        cost="tensor",
    )
