"""The logical-axis rules table: which mesh axes split which named layer dimensions.

Layers name their parameters' dimensions (``embed``, ``mlp``, ``heads``,
``conv_out``, ``lstm_gates`` ...; ``refdl.core.layers``); a rules table maps a
name to mesh axes, and a parameter's ``PartitionSpec`` follows. Model code
never changes: only the table decides (MaxText's ``logical_axis_rules``).

Presets (``--preset``):

- ``tensor`` (default): Megatron-style tensor parallelism over ``model`` -
  column-then-row splitting of each dense pair (the first layer's output
  units ``mlp``, the second's input units), attention by ``heads``,
  convolutions by ``conv_out``, LSTM gates by ``lstm_gates``; the batch is
  split over ``data``;
- ``owt`` (Krizhevsky's "one weird trick", arXiv 1404.5997): convolutions
  data-parallel and fully connected layers model-parallel, both over *all*
  devices - the batch is split over ``data`` x ``model``, dense weights over
  ``data`` x ``model``, convolution weights replicated.
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec

from refdl.config.mesh import MeshSpec

MeshAxes = str | tuple[str, ...] | None

TENSOR_RULES: dict[str, MeshAxes] = {
    "mlp": "model",
    "heads": "model",
    "conv_out": "model",
    "lstm_gates": "model",
    "expert": "expert",  # mixture-of-experts weights: expert parallelism
}
# preset -> (rules, mesh axes the batch is split over)
PRESET_RULES: dict[str, tuple[dict[str, MeshAxes], MeshAxes]] = {
    "tensor": (TENSOR_RULES, "data"),
    "owt": ({"mlp": ("data", "model")}, ("data", "model")),
}


def partition_spec(axes: tuple[str | None, ...], rules: dict[str, MeshAxes]) -> PartitionSpec:
    """The mesh PartitionSpec of one parameter from its logical axis names.

    >>> partition_spec(("embed", "mlp"), TENSOR_RULES)
    PartitionSpec(None, 'model')
    """
    return PartitionSpec(*(rules.get(a) if a else None for a in axes))


def param_spec(
    axes: tuple[str | None, ...], shape: tuple[int, ...], rules: dict[str, MeshAxes], fsdp: int
) -> PartitionSpec:
    """The parameter's PartitionSpec from its logical axes, and, with an ``fsdp`` degree
    > 1, its largest dimension that the rules leave whole and ``fsdp`` divides split over
    the ``fsdp`` axis (a parameter with none stays replicated over it).

    >>> param_spec(("embed", "mlp"), (64, 256), TENSOR_RULES, 4)
    PartitionSpec('fsdp', 'model')
    >>> param_spec(("mlp",), (10,), {}, 4)
    PartitionSpec(None,)
    """
    spec = list(partition_spec(axes, rules))
    if fsdp > 1:
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % fsdp == 0]
        if free:
            spec[max(free, key=lambda d: shape[d])] = "fsdp"
    return PartitionSpec(*spec)


def degree(mesh: MeshSpec, axes: MeshAxes) -> int:
    """How many ways ``axes`` (one mesh axis, several, or none) split a dimension."""
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.as_dict()[n] for n in names)
