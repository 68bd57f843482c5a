"""``model``: tensor (operator) parallelism over the ``model`` mesh axis.

Megatron-style: in each pair of dense layers the first is split by output
units (columns) and the second by input units (rows), so one all-reduce joins
them; attention is split by heads; convolutions by output channels; LSTM gates
by units. The rules act on the logical axis names the layers carry; the model
code stays single-device. This is ``hybrid`` with every device on ``model``.
"""

from __future__ import annotations

import dataclasses

from refdl.errors import UsageError
from refdl.strategies.base import register
from refdl.strategies.hybrid import Hybrid


@register("model")
class ModelParallel(Hybrid):
    """All devices on the ``model`` axis (``--mesh`` defaults to ``model=<devices>``)."""

    @classmethod
    def predict_cost(cls, model_cost, hw, batch, workers, opts):
        from refdl.perf import costs

        return costs.tensor(model_cost, hw, batch, workers, opts)

    def __init__(self, task, spec, devices) -> None:
        if spec.mesh is None:
            spec = dataclasses.replace(spec, mesh=f"model={len(devices)}")
        super().__init__(task, spec, devices)
        if self.mesh_spec.data != 1 or self.mesh_spec.pipe != 1:
            raise UsageError(
                f"--strategy model uses only the model axis; use --strategy hybrid for "
                f"--mesh {spec.mesh}"
            )
        if spec.preset:
            raise UsageError("--preset is for --strategy hybrid")
