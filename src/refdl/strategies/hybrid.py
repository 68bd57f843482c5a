"""``hybrid``: any product of the mesh axes on one device mesh, via ``jax.jit`` shardings.

The state and the batch get ``NamedSharding``s and XLA's SPMD partitioner
(GSPMD) inserts the collectives: the batch is split on ``data`` (gradients
all-reduced over it), parameters are split on ``model`` where their logical
axis names say so (Megatron-style tensor parallelism, the ``model`` strategy's
rules). Model code stays single-device: only the rules table below decides.
The ``pipe`` axis is reserved for pipeline stages (a later issue).

Presets:

- default: ``mlp``, ``heads``, ``conv_out`` and ``lstm_gates`` split on
  ``model`` - column-then-row splitting of each dense pair (the first layer's
  output units, the second's input units), attention split by heads,
  convolutions by output channels;
- ``owt`` (Krizhevsky's "one weird trick", arXiv 1404.5997): convolutions
  data-parallel and fully connected layers model-parallel, both over *all*
  devices - the batch is split over ``data`` x ``model``, convolution weights
  are replicated, dense weights split over ``data`` x ``model``; XLA gathers
  the convolution outputs before the dense layers, as in the paper.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm.measure import collective_bytes
from refdl.core.state import TrainState
from refdl.errors import UsageError
from refdl.mesh import MeshSpec
from refdl.strategies.base import Batch, Strategy, register

MeshAxes = str | tuple[str, ...] | None

TENSOR_RULES: dict[str, MeshAxes] = {
    "mlp": "model",
    "heads": "model",
    "conv_out": "model",
    "lstm_gates": "model",
}
PRESETS: dict[str, tuple[dict[str, MeshAxes], MeshAxes]] = {
    "tensor": (TENSOR_RULES, "data"),
    "owt": ({"mlp": ("data", "model")}, ("data", "model")),
}


def partition_spec(axes: tuple[str | None, ...], rules: dict[str, MeshAxes]) -> P:
    """The mesh PartitionSpec of one parameter from its logical axis names."""
    return P(*(rules.get(a) if a else None for a in axes))


def _degree(mesh: MeshSpec, axes: MeshAxes) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.as_dict()[n] for n in names)


@register("hybrid")
class Hybrid(Strategy):
    """Data x model (x pipe, later) parallelism on one mesh, collectives placed by XLA."""

    multiprocess = "spmd"

    @classmethod
    def predict_cost(cls, model_cost, hw, batch, workers, opts):
        from refdl.perf import costs

        return costs.hybrid(model_cost, hw, batch, workers, opts)

    def __init__(self, task, spec, devices) -> None:
        super().__init__(task, spec, devices)
        self.mesh_spec = MeshSpec.parse(spec.mesh, len(devices))
        self._check_options()
        from refdl import dist

        if self.mesh_spec.pipe > 1 and dist.under_mpi():
            raise UsageError(
                "pipe > 1 runs its stages from one host process; launch it without mpirun"
            )
        preset = spec.preset or "tensor"
        if preset not in PRESETS:
            raise UsageError(f"unknown --preset {preset!r}; choose one of: owt")
        self.rules, batch_axes = PRESETS[preset]
        unit = MeshSpec(data=_degree(self.mesh_spec, batch_axes))
        unit.check_batch(spec.batch_size, spec.microbatches)
        self.mesh = self.mesh_spec.make(devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(batch_axes))
        sample = np.asarray(task.sample_x)
        shapes = task.model.abstract_params(sample)
        self.param_specs = jax.tree.map(
            lambda a: partition_spec(a, self.rules),
            task.logical_axes,
            is_leaf=lambda a: isinstance(a, tuple),
        )
        self._check_divisible(shapes, task.logical_axes)
        self._step = None
        self.measured: dict[str, int] = {}
        self.pipeline = None
        if self.mesh_spec.pipe > 1:  # stages over `pipe`, each on its data x model sub-mesh
            from refdl.strategies.pipeline import Pipeline

            self.pipeline = Pipeline(task, spec, devices, self.mesh_spec, self.rules)

    def _check_options(self) -> None:
        spec = self.spec
        if self.mesh_spec.pipe != 1 and spec.preset:
            raise UsageError(f"--preset {spec.preset} does not combine with pipe > 1")
        if spec.allreduce != "xla":
            raise UsageError(f"--allreduce {spec.allreduce} is for --strategy data only")
        if spec.compress:
            raise UsageError("--compress is for --strategy data only")

    def _check_divisible(self, shapes: Any, axes: Any) -> None:
        """Every split dimension must divide by its mesh degree; say which layer does not."""
        for key, layer in shapes.items():
            for name, shape in layer.items():
                for dim, logical in enumerate(axes[key][name]):
                    mesh_axes = self.rules.get(logical) if logical else None
                    k = _degree(self.mesh_spec, mesh_axes)
                    if k > 1 and shape.shape[dim] % k:
                        raise UsageError(
                            f"--mesh {self.spec.mesh}: {k}-way split of layer {key}'s "
                            f"{logical} width {shape.shape[dim]} (parameter {name} "
                            f"{tuple(shape.shape)}) is not even; use a degree dividing "
                            f"{shape.shape[dim]} or change the width with --model-opt"
                        )

    def state_shardings(self, state: TrainState) -> TrainState:
        """Shardings for every leaf of ``state``: parameters and their optimizer moments split
        by the rules, everything else replicated."""
        params = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            self.param_specs,
            is_leaf=lambda s: isinstance(s, P),
        )
        opt = optax.tree_map_params(
            self.task.optimizer,
            lambda _, sh: sh,
            state.opt_state,
            params,
            transform_non_params=lambda _: self.replicated,
        )
        rep = lambda tree: jax.tree.map(lambda _: self.replicated, tree)  # noqa: E731
        return TrainState(
            step=self.replicated,
            params=params,
            model_state=rep(state.model_state),
            opt_state=opt,
            rng=self.replicated,
            extras=rep(state.extras),
        )

    def place_state(self, host_state: TrainState) -> TrainState:
        if self.pipeline is not None:
            return self.pipeline.place_state(host_state)
        shardings = self.state_shardings(host_state)
        if self._step is None:
            self._step = jax.jit(
                functools.partial(self.task.step, microbatches=self.spec.microbatches),
                in_shardings=(shardings, self.batch_sharding),
                out_shardings=(shardings, self.replicated),
                donate_argnums=0,
            )
        return jax.device_put(host_state, shardings)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        if self.pipeline is not None:
            return self.pipeline.train_step(state, batch)
        batch = jax.device_put(batch, self.batch_sharding)
        if not self.measured:
            compiled = self._step.lower(state, batch).compile()
            self.measured = collective_bytes(compiled.as_text(), len(self.devices))
            self._step = compiled
        state, metrics = self._step(state, batch)
        jax.block_until_ready(state)  # see DataParallel.train_step: no queued collectives
        return state, {**metrics, "comm_bytes": self.measured.get("total", 0)}

    def gather_state(self, state: Any) -> TrainState:
        if self.pipeline is not None:
            return self.pipeline.gather_state(state)
        return super().gather_state(state)

    def timeline(self) -> list[tuple[int, str, float, float]] | None:
        return self.pipeline.timeline() if self.pipeline is not None else None

    def summary(self) -> dict[str, Any]:
        if self.pipeline is not None:
            return {**self.pipeline.summary(), "preset": "tensor"}
        return {
            "mesh": self.mesh_spec.as_dict(),
            "preset": self.spec.preset or "tensor",
            "microbatches": self.spec.microbatches,
            "comm_bytes_per_step": self.measured.get("total"),
            "comm_bytes_by_collective": {k: v for k, v in self.measured.items() if k != "total"},
        }
