"""Shape-only models for prediction at paper scale, and the cost of a training step.

Nothing here allocates weights: parameters come from ``jax.eval_shape`` of the
initialiser, FLOPs and bytes from XLA's cost analysis of the *lowered* (not
compiled, not run) training step - forward, backward and an SGD update - and
activation bytes from the shapes of every layer's output. The architectures
follow their papers (input sizes and widths as published):

- AlexNet (Krizhevsky et al. 2012, one tower: no grouped convolutions), 227x227x3;
- VGG-16 / VGG-19 (Simonyan & Zisserman 2015, configurations D / E), 224x224x3;
- GoogLeNet (Szegedy et al. 2015, Inception v1 without the auxiliary heads), 224x224x3;
- Inception V3 (Szegedy et al. 2016, without the auxiliary head), 299x299x3;
- ResNet-50 / ResNet-101 (He et al. 2016, bottleneck blocks), 224x224x3;
- LeNet-5 (LeCun et al. 1998), 32x32x1;
- LSTM LM (Zaremba et al. 2014 "medium": 2 x 650, vocab 10k, 35 steps);
- GPT-2 small (Radford et al. 2019: 12 x 768, 12 heads, 1024 tokens, vocab 50257).

refdl's own trainable models (``refdl.models``) are costed the same way from
their real ``Task.step`` (see ``model_cost``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from refdl.errors import UsageError
from refdl.registry import Registry


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

    def op_work(self, batch: float) -> Any:
        """``refdl.perf.ops.OpWork`` of one step at ``batch``: per kind, the count and
        ``n_fixed + batch x n_per_sample`` (linear between the two compiled batches)."""
        from refdl.perf.ops import OpWork

        return OpWork({k: (c, max(f + batch * p, 0.0)) for k, c, f, p in self.op_kinds})

    def flops(self, batch: float) -> float:
        return self.flops_fixed + batch * self.flops_per_sample

    def bytes(self, batch: float) -> float:
        return self.bytes_fixed + batch * self.bytes_per_sample

    @property
    def param_bytes(self) -> int:
        return 4 * self.params


@dataclasses.dataclass(frozen=True)
class ShapeModel:
    """A paper-scale architecture: a flax module, its per-sample input, and its source."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    input_dtype: Any
    outputs: int
    doc: str


SHAPE_MODELS: Registry[ShapeModel] = Registry("shape-only model")


def _register(name: str, input_shape, outputs: int, doc: str, dtype=jnp.float32):
    def deco(build):
        SHAPE_MODELS.register(name)(ShapeModel(name, build, input_shape, dtype, outputs, doc))
        return build

    return deco


# ----------------------------------------------------------------- CNNs


def conv(x, f, k, s=1, pad="SAME"):
    k = (k, k) if isinstance(k, int) else k
    return nn.relu(nn.Conv(f, k, strides=(s, s), padding=pad)(x))


def max_pool(x, k=3, s=2, pad="SAME"):
    return nn.max_pool(x, (k, k), (s, s), padding=pad)


class AlexNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = max_pool(conv(x, 96, 11, 4, "VALID"), 3, 2, "VALID")
        x = max_pool(conv(x, 256, 5), 3, 2, "VALID")
        x = conv(conv(conv(x, 384, 3), 384, 3), 256, 3)
        x = max_pool(x, 3, 2, "VALID").reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(4096)(x))
        x = nn.relu(nn.Dense(4096)(x))
        return nn.Dense(1000)(x)


VGG_CFG = {
    16: (2, 2, 3, 3, 3),
    19: (2, 2, 4, 4, 4),
}


class VGG(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        for reps, width in zip(VGG_CFG[self.depth], (64, 128, 256, 512, 512), strict=True):
            for _ in range(reps):
                x = conv(x, width, 3)
            x = max_pool(x, 2, 2)
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(4096)(x))
        x = nn.relu(nn.Dense(4096)(x))
        return nn.Dense(1000)(x)


class InceptionV1(nn.Module):
    """One GoogLeNet module: 1x1 | 1x1-3x3 | 1x1-5x5 | pool-1x1, concatenated."""

    c1: int
    c3r: int
    c3: int
    c5r: int
    c5: int
    cp: int

    @nn.compact
    def __call__(self, x):
        b1 = conv(x, self.c1, 1)
        b2 = conv(conv(x, self.c3r, 1), self.c3, 3)
        b3 = conv(conv(x, self.c5r, 1), self.c5, 5)
        b4 = conv(max_pool(x, 3, 1), self.cp, 1)
        return jnp.concatenate([b1, b2, b3, b4], -1)


GOOGLENET = (  # (c1, c3r, c3, c5r, c5, pool) per module, "pool" = max pool after
    (64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64), "pool",
    (192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
    (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128), "pool",
    (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128),
)  # fmt: skip


class GoogLeNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = max_pool(conv(x, 64, 7, 2))
        x = max_pool(conv(conv(x, 64, 1), 192, 3))
        for m in GOOGLENET:
            x = max_pool(x) if m == "pool" else InceptionV1(*m)(x)
        x = jnp.mean(x, (1, 2))
        return nn.Dense(1000)(x)


class InceptionV3(nn.Module):
    """Inception V3 (Szegedy et al. 2016, Figure 5-7 modules; torchvision's widths)."""

    @nn.compact
    def __call__(self, x):
        x = conv(x, 32, 3, 2, "VALID")
        x = conv(x, 32, 3, 1, "VALID")
        x = max_pool(conv(x, 64, 3), 3, 2, "VALID")
        x = conv(x, 80, 1)
        x = max_pool(conv(x, 192, 3, 1, "VALID"), 3, 2, "VALID")
        for pool_features in (32, 64, 64):  # 35x35: Figure 5
            b1 = conv(x, 64, 1)
            b5 = conv(conv(x, 48, 1), 64, 5)
            b3 = conv(conv(conv(x, 64, 1), 96, 3), 96, 3)
            bp = conv(nn.avg_pool(x, (3, 3), (1, 1), "SAME"), pool_features, 1)
            x = jnp.concatenate([b1, b5, b3, bp], -1)
        b3 = conv(x, 384, 3, 2, "VALID")  # reduction to 17x17
        bd = conv(conv(conv(x, 64, 1), 96, 3), 96, 3, 2, "VALID")
        x = jnp.concatenate([b3, bd, max_pool(x, 3, 2, "VALID")], -1)
        for c7 in (128, 160, 160, 192):  # 17x17: Figure 6 (n = 7)
            b1 = conv(x, 192, 1)
            b7 = conv(conv(conv(x, c7, 1), c7, (1, 7)), 192, (7, 1))
            bd = conv(x, c7, 1)
            for f, k in ((c7, (7, 1)), (c7, (1, 7)), (c7, (7, 1)), (192, (1, 7))):
                bd = conv(bd, f, k)
            bp = conv(nn.avg_pool(x, (3, 3), (1, 1), "SAME"), 192, 1)
            x = jnp.concatenate([b1, b7, bd, bp], -1)
        b3 = conv(conv(x, 192, 1), 320, 3, 2, "VALID")  # reduction to 8x8
        b7 = conv(conv(conv(conv(x, 192, 1), 192, (1, 7)), 192, (7, 1)), 192, 3, 2, "VALID")
        x = jnp.concatenate([b3, b7, max_pool(x, 3, 2, "VALID")], -1)
        for _ in range(2):  # 8x8: Figure 7
            b1 = conv(x, 320, 1)
            b3 = conv(x, 384, 1)
            b3 = jnp.concatenate([conv(b3, 384, (1, 3)), conv(b3, 384, (3, 1))], -1)
            bd = conv(conv(x, 448, 1), 384, 3)
            bd = jnp.concatenate([conv(bd, 384, (1, 3)), conv(bd, 384, (3, 1))], -1)
            bp = conv(nn.avg_pool(x, (3, 3), (1, 1), "SAME"), 192, 1)
            x = jnp.concatenate([b1, b3, bd, bp], -1)
        return nn.Dense(1000)(jnp.mean(x, (1, 2)))


class Bottleneck(nn.Module):
    width: int
    stride: int

    @nn.compact
    def __call__(self, x):
        bn = functools.partial(nn.BatchNorm, use_running_average=False)
        cv = functools.partial(nn.Conv, use_bias=False)
        y = nn.relu(bn()(cv(self.width, (1, 1))(x)))
        y = nn.relu(bn()(cv(self.width, (3, 3), (self.stride, self.stride))(y)))
        y = bn()(cv(4 * self.width, (1, 1))(y))
        if x.shape[-1] != 4 * self.width or self.stride != 1:
            x = cv(4 * self.width, (1, 1), (self.stride, self.stride))(x)
            x = nn.BatchNorm(use_running_average=False)(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    blocks: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (7, 7), (2, 2), use_bias=False)(x)
        x = max_pool(nn.relu(nn.BatchNorm(use_running_average=False)(x)))
        for stage, n in enumerate(self.blocks):
            for i in range(n):
                x = Bottleneck(64 * 2**stage, 2 if i == 0 and stage > 0 else 1)(x)
        return nn.Dense(1000)(jnp.mean(x, (1, 2)))


class LeNet5(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.tanh(nn.Conv(6, (5, 5), padding="VALID")(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.tanh(nn.Conv(16, (5, 5), padding="VALID")(x)), (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.tanh(nn.Dense(120)(x))
        x = nn.tanh(nn.Dense(84)(x))
        return nn.Dense(10)(x)


# ----------------------------------------------------------------- sequence models


class LSTMLM(nn.Module):
    vocab: int = 10000
    hidden: int = 650
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.hidden)(tokens)
        for _ in range(self.layers):
            x = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(x)
        return nn.Dense(self.vocab)(x)


class GPT2Block(nn.Module):
    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(self.heads, qkv_features=self.d)(h, h, mask=mask)
        h = nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(x))))
        return x + h


class GPT2(nn.Module):
    vocab: int = 50257
    ctx: int = 1024
    d: int = 768
    layers: int = 12
    heads: int = 12

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.d)
        pos = self.param("pos", nn.initializers.normal(0.01), (self.ctx, self.d))
        x = embed(tokens) + pos[: tokens.shape[1]]
        for _ in range(self.layers):
            x = GPT2Block(self.d, self.heads)(x)
        return embed.attend(nn.LayerNorm()(x))  # tied output embedding


_register("alexnet", (227, 227, 3), 1000, "AlexNet (one tower), 227x227x3, 62.4 M")(AlexNet)
_register("vgg16", (224, 224, 3), 1000, "VGG-16, 224x224x3, 138 M")(lambda: VGG(16))
_register("vgg19", (224, 224, 3), 1000, "VGG-19, 224x224x3, 144 M")(lambda: VGG(19))
_register("googlenet", (224, 224, 3), 1000, "GoogLeNet (Inception v1), 224x224x3")(GoogLeNet)
_register("inception_v3", (299, 299, 3), 1000, "Inception V3, 299x299x3, 24 M")(InceptionV3)
_register("resnet50", (224, 224, 3), 1000, "ResNet-50, 224x224x3, 25.6 M")(
    lambda: ResNet((3, 4, 6, 3))
)
_register("resnet101", (224, 224, 3), 1000, "ResNet-101, 224x224x3, 44.5 M")(
    lambda: ResNet((3, 4, 23, 3))
)
_register("lenet5_1998", (32, 32, 1), 10, "LeNet-5 (1998), 32x32x1, 62 k")(LeNet5)
_register("lstm_lm_medium", (35,), 10000, "LSTM LM 2x650, vocab 10k, 35 steps", jnp.int32)(LSTMLM)
_register("gpt2", (1024,), 50257, "GPT-2 small, 12x768, 1024 tokens", jnp.int32)(GPT2)


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


@functools.lru_cache(maxsize=64)
def shape_param_count(name: str) -> int:
    """Parameters of a shape-only model (``jax.eval_shape`` of its initialiser: instant)."""
    m = SHAPE_MODELS.get(name)
    x = jax.ShapeDtypeStruct((1, *m.input_shape), m.input_dtype)
    v = jax.eval_shape(m.build().init, jax.random.key(0), x)
    return _count(v["params"])


def _lowered_cost(fn: Callable, *args) -> tuple[float, float]:
    analysis = jax.jit(fn).lower(*args).cost_analysis() or {}
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))


def _count(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


@functools.lru_cache(maxsize=64)
def model_cost(name: str) -> ModelCost:
    """The cost of one training step of ``name``: a shape-only model, or one of refdl's
    models on its default data set's shapes."""
    from refdl.models import MODELS

    if name in SHAPE_MODELS.names():
        return _shape_model_cost(SHAPE_MODELS.get(name))
    if name in MODELS.names():
        return _refdl_model_cost(name)
    raise UsageError(
        f"unknown --model {name!r}; shape-only: {', '.join(SHAPE_MODELS.names())}; "
        f"refdl models: {', '.join(MODELS.names())}"
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
    return _finish(m.name, params, costs, outs)


def _refdl_model_cost(name: str) -> ModelCost:
    """refdl's own model (``refdl.models``) on its default data set, costed from the
    real ``Task.step`` lowered at batch 1 and 2."""
    from refdl.loop import build
    from refdl.spec import RunSpec

    run = build(RunSpec(model=name, progress=False))
    task = run.task
    state = task.abstract_state()
    costs = []
    for b in (1, 2):
        batch = {
            k: jax.ShapeDtypeStruct((b, *v.shape[1:]), v.dtype)
            for k, v in run.dataset.train_batch(np.arange(1)).items()
        }
        costs.append(_lowered_cost(task.step, state, batch))
    ops = count_ops(jax.jit(task.step).lower(state, batch).compile().as_text())
    kinds = op_kinds(task.step, state, run.dataset.train_batch(np.arange(1)))
    x = jax.ShapeDtypeStruct(np.shape(task.sample_x), np.asarray(task.sample_x).dtype)
    outs, params = [], _count(state.params)
    sizes = [math.prod(x.shape[1:])]
    for layer in task.model.layers:  # each layer's output size, abstractly
        x, _ = jax.eval_shape(
            lambda x, layer=layer: layer.init_with_output(jax.random.key(0), x, train=False), x
        )
        outs.append(math.prod(x.shape[1:]))
    sample = run.dataset.train_batch(np.arange(1))
    tp = _tp_layers(task)
    return dataclasses.replace(
        _finish(name, params, costs, outs, ops),
        tp_collectives=tensor_collectives(tp, sizes + outs) if tp is not None else (),
        op_kinds=kinds,
        state_leaves=len(jax.tree.leaves(state)),
        input_leaves=len(jax.tree.leaves(sample)),
        input_bytes_per_sample=float(sum(np.asarray(v).nbytes for v in sample.values())),
    )


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
    from refdl.core.layers import Conv, Dense
    from refdl.strategies.hybrid import TENSOR_RULES

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
    from refdl.perf.ops import by_kind, parse_hlo

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
