"""The cost of one training step of a model, without devices: what the cost formulas need.

FLOPs and bytes come from XLA's cost analysis of the *lowered* (not run) training
step - forward, backward and an optimizer update - at two batch sizes (the
difference is per sample); activation bytes from the shapes of every layer's
output; for refdl's own models also the compiled step's operations by kind
(``refdl.perf.ops``) and the collectives tensor parallelism leaves. A shape-only
paper model (``refdl.perf.zoo``) is costed from its flax module; refdl's models
from their real ``Task.step`` (``refdl.assemble.make_task``), built without any
device or strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax
import flax.core
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax

from refdl.assemble import load_data, make_task, model_shape, resolve
from refdl.config.rules import TENSOR_RULES
from refdl.config.spec import RunSpec
from refdl.core.layers import Conv, Dense, Embed, PositionalEmbed, TransformerBlock
from refdl.core.moe import MoEFeedForward
from refdl.core.optim import muon_matrices
from refdl.errors import UsageError
from refdl.models import MODELS
from refdl.perf.ops import OpWork, by_kind, parse_hlo
from refdl.perf.transformer import TransformerShape
from refdl.perf.zoo import SHAPE_MODELS, TRANSFORMERS, ShapeModel


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """What a strategy's cost model needs to know about one model's training step.

    ``flops(b)`` = ``flops_fixed + b * flops_per_sample`` (likewise bytes): the fixed
    part is the optimizer update, the per-sample part forward and backward.
    """

    name: str
    params: int
    flops_per_sample: float
    flops_fixed: float
    bytes_per_sample: float
    bytes_fixed: float
    activation_bytes_per_sample: float  # all layer outputs of one sample (fp32)
    boundary_bytes_per_sample: float  # a typical stage boundary (largest layer output / 4)
    layers: int
    ops: int = 0  # operations XLA executes per step (compiled refdl models; 0: not counted)
    # Per operation kind of the compiled step (refdl.perf.ops): (kind, count, n_fixed,
    # n_per_sample), n = FLOPs or bytes; empty for shape-only models (not compiled).
    op_kinds: tuple[tuple[str, float, float, float], ...] = ()
    state_leaves: int = 0  # arrays of the training state (arguments of a step call)
    input_leaves: int = 0  # arrays of one batch (x, y)
    input_bytes_per_sample: float = 0.0  # bytes of one sample's x and y
    # The tensor-parallel step's collectives, in order: (op, fp32 bytes per sample), op
    # "allreduce" or "allgather" (``tensor_collectives``); empty: not known (then
    # ``refdl.perf.costs.tensor`` counts Megatron-LM's two all-reduces per layer).
    tp_collectives: tuple[tuple[str, float], ...] = ()
    # "conv" when convolutions carry the model (a 4-d kernel), else "gemm": which of a
    # profile's achieved fractions applies (refdl.hw.profile.Achieved)
    op_class: str = "gemm"
    # fp32 bytes of each parameter array in forward order: the gradients' order of
    # readiness, reversed, for the bucketed allreduce (refdl.perf.overlap)
    layer_param_bytes: tuple[float, ...] = ()
    # the model as a transformer shape (``refdl.perf.transformer``), where it is one: what
    # the context, expert and sequence-parallel terms and the recomputation need
    transformer: TransformerShape | None = None
    # fully connected layers: (rows per sample, in, out, parameters), what sufficient-
    # factor broadcasting prices (``--sfb``); empty for shape-only models
    dense_layers: tuple[tuple[int, int, int, int], ...] = ()
    # the matrices Muon updates, (count, fan_in, fan_out) (``refdl.core.optim``'s choice:
    # a shape-only model declares no axes, so every kernel of two or more axes)
    muon_matrices: tuple[tuple[int, int, int], ...] = ()
    # refdl's own models: the widths the tensor rules split over ``model`` (``train``
    # needs a degree dividing each: ``model_degree_problem``); empty for shape-only ones
    model_widths: tuple[int, ...] = ()

    def op_work(self, batch: float) -> Any:
        """``refdl.perf.ops.OpWork`` of one step at ``batch``: per kind, the count and
        ``n_fixed + batch x n_per_sample`` (linear between the two compiled batches)."""
        return OpWork({k: (c, max(f + batch * p, 0.0)) for k, c, f, p in self.op_kinds})

    def flops(self, batch: float) -> float:
        return self.flops_fixed + batch * self.flops_per_sample

    def bytes(self, batch: float) -> float:
        return self.bytes_fixed + batch * self.bytes_per_sample

    @property
    def param_bytes(self) -> int:
        return 4 * self.params


# ----------------------------------------------------------------- costs


def _train_step_fn(apply: Callable, outputs: int):
    """Forward, backward and an SGD update of ``apply(params, x)`` under cross entropy."""

    def step(params, x, y):
        def loss(p):
            logits = apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.reshape(-1, outputs), y.reshape(-1)
            ).mean()

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    return step


def _lowered_cost(fn: Callable, *args) -> tuple[float, float]:
    analysis = jax.jit(fn).lower(*args).cost_analysis() or {}
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))


def _count(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _in_order(params: Any) -> tuple[tuple[float, ...], str]:
    """Each parameter array's fp32 bytes in the order the layers were created (forward
    order), and the op class ("conv" if any kernel is 4-d)."""
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params))
    shapes = [tuple(v.shape) for v in flat.values()]
    op_class = "conv" if any(len(sh) == 4 for sh in shapes) else "gemm"
    return tuple(4.0 * math.prod(sh) for sh in shapes), op_class


@functools.lru_cache(maxsize=64)
def model_cost(name: str, data_opts: tuple[tuple[str, str], ...] = ()) -> ModelCost:
    """The cost of one training step of ``name``: a shape-only model, or one of refdl's
    models on its default data set's shapes (with ``data_opts``, e.g. digits at 28x28)."""
    if name in SHAPE_MODELS.names():
        m = _shape_model_cost(SHAPE_MODELS.get(name))
        if name in TRANSFORMERS.names():
            m = dataclasses.replace(m, transformer=TRANSFORMERS.get(name).shape)
        return m
    if name in TRANSFORMERS.names():
        return transformer_cost(name, TRANSFORMERS.get(name).shape)
    if name in MODELS.names():
        return _refdl_model_cost(name, data_opts)
    shapes = sorted({*SHAPE_MODELS.names(), *TRANSFORMERS.names()})
    raise UsageError(
        f"unknown --model {name!r}; shape-only: {', '.join(shapes)}; "
        f"refdl models: {', '.join(MODELS.names())}"
    )


def transformer_cost(name: str, shape: TransformerShape) -> ModelCost:
    """A transformer known by its shape: the closed-form counts of
    ``refdl.perf.transformer`` (fp32 activations, no recomputation) in place of XLA's;
    the optimizer's update and memory traffic are left out (a GPT-scale step is
    bound by its products)."""
    per_layer = 4.0 * (shape.dense_params() - shape.vocab * shape.d_model) / shape.layers
    return ModelCost(
        name=name,
        params=shape.params,
        flops_per_sample=shape.flops_per_sequence("none"),
        flops_fixed=0.0,
        bytes_per_sample=0.0,
        bytes_fixed=0.0,
        activation_bytes_per_sample=shape.layers * shape.layer_activation_bytes(1, precision="fp32")
        + 4.0 * shape.seq * shape.vocab,
        boundary_bytes_per_sample=4.0 * shape.seq * shape.d_model,
        layers=shape.layers,
        layer_param_bytes=(4.0 * shape.vocab * shape.d_model,)
        + (per_layer + 4.0 * shape.expert_params() / shape.layers,) * shape.layers,
        op_class="transformer",
        transformer=shape,
    )


def _shape_model_cost(m: ShapeModel) -> ModelCost:
    module = m.build()

    def variables(b):
        x = jax.ShapeDtypeStruct((b, *m.input_shape), m.input_dtype)
        return jax.eval_shape(module.init, jax.random.key(0), x), x

    def apply(v, x):
        if "batch_stats" in v:
            return module.apply(v, x, mutable=["batch_stats"])[0]
        return module.apply(v, x)

    step = _train_step_fn(apply, m.outputs)
    costs = []
    for b in (1, 2):
        v, x = variables(b)
        y_shape = (b, *m.input_shape) if m.input_dtype == jnp.int32 else (b,)
        costs.append(_lowered_cost(step, v, x, jax.ShapeDtypeStruct(y_shape, jnp.int32)))
    v, x = variables(1)
    params = _count(v.get("params", v))
    _, inter = jax.eval_shape(
        lambda v, x: module.apply(v, x, capture_intermediates=True, mutable=True), v, x
    )
    outs = [
        math.prod(o.shape)
        for o in jax.tree.leaves(inter.get("intermediates", {}))
        if hasattr(o, "shape")
    ]
    order, op_class = _in_order(v.get("params", v))
    return dataclasses.replace(
        _finish(m.name, params, costs, outs),
        op_class=op_class,
        layer_param_bytes=order,
        muon_matrices=muon_matrices(None, v.get("params", v)),
    )


def _refdl_model_cost(name: str, data_opts: tuple[tuple[str, str], ...] = ()) -> ModelCost:
    """refdl's own model (``refdl.models``) on its default data set, costed from the
    real ``Task.step`` lowered at batch 1 and 2."""
    spec = resolve(RunSpec(model=name, data_opts=data_opts))
    dataset = load_data(spec)
    task = make_task(spec, dataset)
    state = task.abstract_state()
    costs = []
    for b in (1, 2):
        batch = {
            k: jax.ShapeDtypeStruct((b, *v.shape[1:]), v.dtype)
            for k, v in dataset.train_batch(np.arange(1)).items()
        }
        costs.append(_lowered_cost(task.step, state, batch))
    ops = count_ops(jax.jit(task.step).lower(state, batch).compile().as_text())
    kinds = op_kinds(task.step, state, dataset.train_batch(np.arange(1)))
    x = jax.ShapeDtypeStruct(np.shape(task.sample_x), np.asarray(task.sample_x).dtype)
    outs, params = [], _count(state.params)
    sizes = [math.prod(x.shape[1:])]
    for layer in task.model.layers:  # each layer's output size, abstractly
        x, _ = jax.eval_shape(
            lambda x, layer=layer: layer.init_with_output(jax.random.key(0), x, train=False), x
        )
        outs.append(math.prod(x.shape[1:]))
    sample = dataset.train_batch(np.arange(1))
    tp = _tp_layers(task)
    order, op_class = _in_order(state.params)
    return dataclasses.replace(
        _finish(name, params, costs, outs, ops),
        tp_collectives=tensor_collectives(tp, sizes + outs) if tp is not None else (),
        op_kinds=kinds,
        state_leaves=len(jax.tree.leaves(state)),
        input_leaves=len(jax.tree.leaves(sample)),
        input_bytes_per_sample=float(sum(np.asarray(v).nbytes for v in sample.values())),
        op_class=op_class,
        layer_param_bytes=order,
        transformer=transformer_shape(task.model.layers),
        dense_layers=_dense_layers(task),
        muon_matrices=muon_matrices(task.logical_axes, state.params),
        model_widths=_model_widths(task, dataset, name),
    )


def _model_widths(task: Any, dataset: Any, name: str) -> tuple[int, ...]:
    """The sizes of the parameter dimensions ``TENSOR_RULES`` splits over ``model``."""
    split = [logical for logical, axes in TENSOR_RULES.items() if axes == "model"]
    widths = {shape[d] for layer in model_shape(task, dataset, name).layers
              for shape, axes in layer.params.values()
              for d, logical in enumerate(axes) if logical in split}  # fmt: skip
    return tuple(sorted(widths))


def model_degree_problem(m: ModelCost, k: int) -> str | None:
    """Why ``train`` cannot split ``m`` ``k`` ways over ``model`` (a width ``k`` does not
    divide), or None where it can (or where ``m`` is known by its shape only)."""
    uneven = [w for w in m.model_widths if w % k]
    if k <= 1 or not uneven:
        return None
    g = math.gcd(*m.model_widths)
    return (
        f"a {k}-way model split of {m.name}'s width {uneven[0]} is not even (train "
        f"refuses it); use a model degree dividing {g}"
    )


def _dense_layers(task: Any) -> tuple[tuple[int, int, int, int], ...]:
    """``(rows per sample, in, out, parameters)`` of each fully connected layer."""
    if not hasattr(task.model, "dense_layers"):
        return ()
    params, state = task.model.abstract_variables(task.sample_x)
    x = jax.ShapeDtypeStruct((1, *np.shape(task.sample_x)[1:]), np.asarray(task.sample_x).dtype)
    return tuple((d["rows"], d["in"], d["out"], d["params"])
                 for d in task.model.dense_layers(params, state, x).values())  # fmt: skip


def transformer_shape(layers: Any) -> TransformerShape | None:
    """A decoder built of refdl's layers (``Embed``, ``PositionalEmbed``,
    ``TransformerBlock``s, an untied output ``Dense``) as a shape; None for any other
    model."""
    blocks = [x for x in layers if isinstance(x, TransformerBlock)]
    embed = [x for x in layers if isinstance(x, Embed)]
    pos = [x for x in layers if isinstance(x, PositionalEmbed)]
    if not blocks or len(embed) != 1 or len(pos) != 1:
        return None
    b, ffn = blocks[0], blocks[0].ffn
    moe: dict[str, Any] = {"ffn": b.mlp_dim}
    if isinstance(ffn, MoEFeedForward):
        moe = dict(experts=ffn.experts, top_k=ffn.top_k, capacity_factor=ffn.capacity_factor,
                   ffn=ffn.mlp_dim)  # fmt: skip
    return TransformerShape(len(blocks), embed[0].features, b.num_heads, pos[0].max_len,
                            embed[0].vocab_size, tied=False, **moe)  # fmt: skip


def tensor_collectives(
    layers: list[tuple[bool, bool] | None], sizes: list[int]
) -> tuple[tuple[str, float], ...]:
    """The collectives of a tensor-parallel step of a chain of layers, each given as
    ``(input features split, output features split)`` over the model axis (``None``: a
    layer without parameters, which keeps its input's split), ``sizes`` the elements per
    sample of the input and of each layer's output. Forward, a layer that needs its whole
    input all-gathers a split one, and a row-split layer all-reduces its partial sums;
    backward, a column-split layer all-reduces its input's gradient (not the first layer
    with parameters: the data needs none). Returns ``(op, fp32 bytes per sample)``; on
    refdl's mlp this gives the 1 all-reduce, and on lenet5 the 3 all-reduces and 2
    all-gathers, that XLA's partitioner puts in the compiled model-parallel step."""
    out: list[tuple[str, float]] = []
    split, seen = False, False
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        split_in, split_out = layer
        if split and not split_in:
            out.append(("allgather", 4.0 * sizes[i]))
        if split_out and seen:
            out.append(("allreduce", 4.0 * sizes[i]))
        if split_in:
            out.append(("allreduce", 4.0 * sizes[i + 1]))
        split, seen = split_out, True
    return tuple(out)


def _tp_layers(task: Any) -> list[tuple[bool, bool] | None] | None:
    """Each layer's ``(input split, output split)`` under the tensor rules, where every
    layer with parameters is a ``Dense`` or ``Conv`` (else ``None``: not known)."""
    axes = task.model.logical_axes(task.sample_x)
    out: list[tuple[bool, bool] | None] = []
    for key, layer in zip(task.model.keys, task.model.layers, strict=True):
        kernel = axes.get(key, {}).get("kernel")
        if not jax.tree.leaves(axes.get(key, {}), is_leaf=lambda a: isinstance(a, tuple)):
            out.append(None)
        elif isinstance(layer, Dense | Conv) and kernel is not None:
            out.append((TENSOR_RULES.get(kernel[-2]) is not None,
                        TENSOR_RULES.get(kernel[-1]) is not None))  # fmt: skip
        else:
            return None
    return out


OP_BATCHES = (16, 64)  # compile the step at these batches; sizes are linear in between


def op_kinds(
    step: Callable, state: Any, sample: dict
) -> tuple[tuple[str, float, float, float], ...]:
    """``(kind, count, n_fixed, n_per_sample)`` per operation kind of the compiled ``step``
    (``refdl.perf.ops.parse_hlo``), from compiling it at two batches (``OP_BATCHES``): the
    count is the larger batch's, n a line through the two."""
    aggs = []
    for b in OP_BATCHES:
        batch = {k: jax.ShapeDtypeStruct((b, *np.shape(v)[1:]), np.asarray(v).dtype)
                 for k, v in sample.items()}  # fmt: skip
        aggs.append(by_kind(parse_hlo(jax.jit(step).lower(state, batch).compile().as_text())))
    (b1, b2), (a1, a2) = OP_BATCHES, aggs
    out = []
    for kind, (count, n2) in sorted(a2.items()):
        n1 = a1.get(kind, (0, 0.0))[1]
        per = max((n2 - n1) / (b2 - b1), 0.0)
        out.append((kind, float(count), max(n2 - b2 * per, 0.0), per))
    return tuple(out)


def count_ops(hlo_text: str) -> int:
    """Operations in a compiled module's entry computation (fusions, dots, convolutions,
    copies, collectives...), leaving out parameters, constants and tuple plumbing."""
    entry = hlo_text[hlo_text.find("ENTRY") :]
    skip = ("parameter(", "constant(", "get-tuple-element(", " tuple(", "bitcast(")
    return sum(1 for ln in entry.splitlines() if " = " in ln and not any(k in ln for k in skip))


def _finish(
    name: str, params: int, costs: list[tuple[float, float]], outs: list[int], ops: int = 0
) -> ModelCost:
    (f1, b1), (f2, b2) = costs
    per_f, per_b = max(f2 - f1, 0.0), max(b2 - b1, 0.0)
    return ModelCost(
        name=name,
        params=params,
        flops_per_sample=per_f,
        flops_fixed=max(f1 - per_f, 0.0),
        bytes_per_sample=per_b,
        bytes_fixed=max(b1 - per_b, 0.0),
        activation_bytes_per_sample=4.0 * sum(outs),
        boundary_bytes_per_sample=4.0 * (sum(outs) / max(len(outs), 1)),
        layers=len(outs),
        ops=ops,
    )
