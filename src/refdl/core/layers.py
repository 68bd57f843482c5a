"""Layers and the ``Sequential`` model ``f(x) = f_n(...f_1(x))``.

Every layer is a flax linen module written for one device, with the uniform
signature ``layer(x, train=False)``. Every parameter carries logical axis
names (``embed``, ``mlp``, ``heads``, ``conv_in``, ``conv_out``, ``vocab``,
``lstm_gates`` ...) through ``nn.with_logical_partitioning``; the strategies
map those names to mesh axes and never edit model code.

``Sequential`` keeps one parameter sub-tree per layer, keyed ``"00_conv"``,
``"01_maxpool"`` ..., so a model splits into contiguous pipeline stages by
slicing its layer list: stage parameters are a subset of the keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from refdl.core.conv import conv2d
from refdl.core.precision import abstract_to_master, to_master, wide

Array = jax.Array
PyTree = Any
Axes = tuple[str | None, ...]

_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "gelu": jax.nn.gelu,
    "sigmoid": jax.nn.sigmoid,
}


def activation(name: str | None) -> Callable[[Array], Array]:
    """The activation function called ``name`` (``None`` is the identity)."""
    if name is None:
        return lambda x: x
    return _ACTIVATIONS[name]


def param(module: nn.Module, name: str, init: Callable, shape: Sequence[int], axes: Axes):
    """A parameter of ``module`` boxed with its logical axis names, drawn in fp32 (an fp64
    run casts the same draws up: ``refdl.core.precision``)."""
    return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), jnp.float32)


class Dense(nn.Module):
    """``y = act(x @ W + b)`` on the last axis; ``W`` has axes ``(in_axis, out_axis)``."""

    features: int
    in_axis: str | None = "embed"
    out_axis: str | None = "mlp"
    act: str | None = None
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        kernel = param(
            self,
            "kernel",
            nn.initializers.lecun_normal(),
            (x.shape[-1], self.features),
            (self.in_axis, self.out_axis),
        )
        y = jnp.dot(x, kernel)
        if self.use_bias:
            y = y + param(self, "bias", nn.initializers.zeros, (self.features,), (self.out_axis,))
        return activation(self.act)(y)


class Conv(nn.Module):
    """2-D convolution, NHWC input, HWIO kernel with axes ``(None, None, conv_in, conv_out)``."""

    features: int
    kernel_size: tuple[int, int] = (3, 3)
    strides: tuple[int, int] = (1, 1)
    padding: str = "SAME"
    act: str | None = None
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        kh, kw = self.kernel_size
        kernel = param(
            self,
            "kernel",
            nn.initializers.lecun_normal(),
            (kh, kw, x.shape[-1], self.features),
            (None, None, "conv_in", "conv_out"),
        )
        y = conv2d(x, kernel, self.strides, self.padding)
        if self.use_bias:
            y = y + param(self, "bias", nn.initializers.zeros, (self.features,), ("conv_out",))
        return activation(self.act)(y)


class Pool(nn.Module):
    """Max or average pooling over a square window (no parameters)."""

    kind: str = "max"
    window: int = 2
    stride: int = 2
    padding: str = "VALID"

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        pool = nn.max_pool if self.kind == "max" else nn.avg_pool
        return pool(x, (self.window, self.window), (self.stride, self.stride), self.padding)


class GlobalAvgPool(nn.Module):
    """Mean over the spatial axes: NHWC -> NC."""

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        return jnp.mean(x, axis=(1, 2))


class Flatten(nn.Module):
    """Flatten everything but the batch axis."""

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        return x.reshape(x.shape[0], -1)


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """``var`` set to ``value`` inside the ``with`` block (the hooks strategies set while
    their programs are traced), restored after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


_BATCH_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("batch_axis", default=None)


def batch_axis(name: str | None) -> contextlib.AbstractContextManager[None]:
    """While tracing inside ``shard_map``, name the mesh axis the batch is split over, so
    BatchNorm averages its statistics over the whole global batch (as ``single`` does)."""
    return scoped(_BATCH_AXIS, name)


def batch_mean(x: Array) -> Array:
    """``x`` averaged over the mesh axis named by ``batch_axis`` (unchanged outside one): a
    statistic of the whole global batch."""
    name = _BATCH_AXIS.get()
    return x if name is None else jax.lax.pmean(x, name)


class BatchNorm(nn.Module):
    """Batch normalisation over all but the last axis (statistics of the whole global batch).

    Running averages live in the ``batch_stats`` collection (``TrainState.model_state``).
    Under ``batch_axis(name)`` the statistics are averaged over that mesh axis.
    """

    axis_name: str | None = "conv_out"
    momentum: float = 0.9
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        axes = (self.axis_name,)
        return nn.BatchNorm(
            use_running_average=not train,
            axis_name=_BATCH_AXIS.get() if train else None,
            momentum=self.momentum,
            epsilon=self.epsilon,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes),
        )(x)


class LayerNorm(nn.Module):
    """Layer normalisation over the last axis, parameters on ``axis_name``."""

    axis_name: str | None = "embed"
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        axes = (self.axis_name,)
        return nn.LayerNorm(
            epsilon=self.epsilon,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes),
        )(x)


class ConvBN(nn.Module):
    """conv3x3 (no bias) + BatchNorm + activation, as one layer (the ResNet stem)."""

    features: int
    act: str | None = "relu"

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        y = Conv(self.features, (3, 3), use_bias=False)(x)
        return activation(self.act)(BatchNorm()(y, train))


class ResidualBlock(nn.Module):
    """He et al.'s CIFAR basic block: conv3x3-BN-ReLU-conv3x3-BN, + shortcut, ReLU.

    The shortcut is option A of the paper (identity; when the shape changes,
    stride-2 subsampling and zero-padded channels), so ResNet-20 has the
    paper's 0.27 M parameters.
    """

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        s = (self.strides, self.strides)
        y = Conv(self.features, (3, 3), s, use_bias=False)(x)
        y = jax.nn.relu(BatchNorm()(y, train))
        y = Conv(self.features, (3, 3), use_bias=False)(y)
        y = BatchNorm()(y, train)
        shortcut = x
        if self.strides != 1:
            shortcut = shortcut[:, :: self.strides, :: self.strides, :]
        extra = self.features - shortcut.shape[-1]
        if extra > 0:
            pad = ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2))
            shortcut = jnp.pad(shortcut, pad)
        return jax.nn.relu(y + shortcut)


class Embed(nn.Module):
    """Token embedding: integer ids -> vectors; table axes ``(vocab, embed)``."""

    vocab_size: int
    features: int

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        table = param(
            self,
            "embedding",
            nn.initializers.normal(stddev=0.1),
            (self.vocab_size, self.features),
            ("vocab", "embed"),
        )
        return jnp.take(table, x, axis=0)


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """How the traced tokens sit in the sequence when it is split (context parallelism,
    ``refdl.parallel.context``): ``positions(t)`` gives the places in the sequence of the
    ``t`` tokens traced, and ``attention(q, k, v)`` is causal attention of their queries over
    the whole sequence. Inside ``shard_map`` (``whole`` False) those are one device's piece;
    under ``jax.jit`` shardings (``whole`` True, ``hybrid``) all ``T``, in the held order."""

    positions: Callable[[int], Array]
    attention: Callable[[Array, Array, Array], Array]
    # whether the traced tokens are whole sequences (in a permuted order), as under
    # ``jax.jit`` shardings, rather than one device's piece of them, as in ``shard_map``
    whole: bool = False


_SEQUENCE: contextvars.ContextVar[SequenceShard | None] = contextvars.ContextVar(
    "sequence", default=None
)
# A function applied to the residual stream ``[B, T, D]`` where Megatron's sequence
# parallelism keeps it split along the sequence (``refdl.strategies.hybrid``).
_RESIDUAL: contextvars.ContextVar[Callable[[Array], Array] | None] = contextvars.ContextVar(
    "residual", default=None
)


def sequence_shard(shard: SequenceShard | None) -> contextlib.AbstractContextManager[None]:
    """While tracing, the model's positions and attention see the sequence as ``shard``."""
    return scoped(_SEQUENCE, shard)


def residual_layout(
    constrain: Callable[[Array], Array] | None,
) -> contextlib.AbstractContextManager[None]:
    """While tracing, pass the residual stream through ``constrain`` (a sharding constraint)
    at each block's input and after each residual add."""
    return scoped(_RESIDUAL, constrain)


def sequence_now() -> SequenceShard | None:
    """The sequence split set by ``sequence_shard`` while tracing (``None``: none)."""
    return _SEQUENCE.get()


def residual(x: Array) -> Array:
    """The residual stream under the layout set by ``residual_layout`` (else unchanged)."""
    constrain = _RESIDUAL.get()
    return x if constrain is None else constrain(x)


class PositionalEmbed(nn.Module):
    """Learned absolute position embedding added to ``[B, T, D]`` inputs."""

    max_len: int

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        pos = param(
            self,
            "embedding",
            nn.initializers.normal(stddev=0.02),
            (self.max_len, x.shape[-1]),
            (None, "embed"),
        )
        shard = _SEQUENCE.get()
        if shard is not None:
            return x + jnp.take(pos, shard.positions(x.shape[1]), axis=0)[None]
        return x + pos[None, : x.shape[1], :]


class LSTM(nn.Module):
    """One LSTM layer over ``[B, T, D]``, zero initial state, gates in PyTorch order i, f, g, o.

    ``W_ih: (D, 4H)``, ``W_hh: (H, 4H)`` and one bias ``(4H,)``; the gate axis is
    ``lstm_gates`` so tensor parallelism can split the four gates' units.
    """

    hidden: int

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        h = self.hidden
        init = nn.initializers.uniform(scale=2.0 / np.sqrt(h))
        shifted = lambda key, shape, dtype=jnp.float32: init(key, shape, dtype) - 1.0 / math.sqrt(h)  # noqa: E731
        w_ih = param(self, "w_ih", shifted, (x.shape[-1], 4 * h), ("embed", "lstm_gates"))
        w_hh = param(self, "w_hh", shifted, (h, 4 * h), ("lstm_hidden", "lstm_gates"))
        bias = param(self, "bias", nn.initializers.zeros, (4 * h,), ("lstm_gates",))
        xw = jnp.einsum("btd,dg->btg", x, w_ih) + bias  # input projection for all steps at once

        def cell(carry, xw_t):
            h_prev, c_prev = carry
            z = xw_t + h_prev @ w_hh
            i, f, g, o = jnp.split(z, 4, axis=-1)
            c = jax.nn.sigmoid(f) * c_prev + jax.nn.sigmoid(i) * jnp.tanh(g)
            h_t = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (h_t, c), h_t

        zeros = jnp.zeros((x.shape[0], h), xw.dtype)
        _, hs = jax.lax.scan(cell, (zeros, zeros), jnp.swapaxes(xw, 0, 1))
        return jnp.swapaxes(hs, 0, 1)


def causal_attention(q: Array, k: Array, v: Array) -> Array:
    """``softmax(q k^T / sqrt(h) + causal mask) v`` on ``[batch, time, heads, head_dim]``.

    XLA's formulation everywhere, except cuDNN's fused kernel on a GPU in bf16/fp16,
    which never holds the ``T x T`` scores in memory (the same mathematics), and fp64,
    whose softmax ``jax.nn.dot_product_attention`` would take in fp32. Under
    ``sequence_shard`` the shard's attention, which sees the other devices' keys and values.
    """
    shard = _SEQUENCE.get()
    if shard is not None:
        return shard.attention(q, k, v)
    if q.dtype == jnp.float64:
        t = q.shape[1]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        with contextlib.suppress(Exception):  # a shape or version cuDNN does not take
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


class TransformerBlock(nn.Module):
    """Pre-LN decoder block: x + MHA(LN(x)) (causal), then x + MLP(LN(x)).

    Q, K, V and the output projection carry a ``heads`` axis, the MLP an ``mlp``
    axis: Megatron-style tensor parallelism splits exactly those. ``ffn`` replaces the
    MLP by another feed-forward module (``refdl.core.moe.MoEFeedForward``).
    """

    num_heads: int
    mlp_dim: int
    ffn: nn.Module | None = None

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        d = x.shape[-1]
        hd = d // self.num_heads
        x = residual(x)
        y = LayerNorm()(x)
        qkv_init = nn.initializers.lecun_normal()
        wq = param(self, "wq", qkv_init, (d, self.num_heads, hd), ("embed", "heads", "head_dim"))
        wk = param(self, "wk", qkv_init, (d, self.num_heads, hd), ("embed", "heads", "head_dim"))
        wv = param(self, "wv", qkv_init, (d, self.num_heads, hd), ("embed", "heads", "head_dim"))
        wo = param(self, "wo", qkv_init, (self.num_heads, hd, d), ("heads", "head_dim", "embed"))
        q = jnp.einsum("btd,dnh->btnh", y, wq)
        k = jnp.einsum("btd,dnh->btnh", y, wk)
        v = jnp.einsum("btd,dnh->btnh", y, wv)
        ctx = causal_attention(q, k, v)
        x = residual(x + jnp.einsum("btnh,nhd->btd", ctx, wo))
        y = LayerNorm()(x)
        if self.ffn is not None:
            return residual(x + self.ffn(y, train))
        y = Dense(self.mlp_dim, "embed", "mlp", act="gelu")(y)
        y = Dense(d, "mlp", "embed")(y)
        return residual(x + y)


_SELECTIVE = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def recomputed(fn: Callable, policy: Callable | None = None) -> Callable:
    """``fn`` whose forward activations are recomputed in the backward pass, keeping only
    its inputs (and, under ``policy``, the values it names saveable).

    ``jax.checkpoint`` alone does not do it on every backend: XLA:CPU drops the barrier
    that keeps the recomputation apart and then merges it with the forward pass, keeping
    every activation (jax 0.10.2). Here the backward adds ``0 x`` one element of the
    output's cotangent to the saved values first: exact for finite values, and a data
    dependence XLA can neither merge nor move before the cotangent exists.
    """

    @jax.custom_vjp
    def run(*args: Any) -> Any:
        return fn(*args)

    def forward(*args: Any) -> tuple[Any, Any]:
        return jax.vjp(jax.checkpoint(fn, policy=policy, prevent_cse=False), *args)

    def backward(saved: Any, cotangent: Any) -> Any:
        first = jax.tree.leaves(cotangent)[0]
        zero = 0 * first.reshape(-1)[0]
        tie = lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
        return jax.tree.map(tie, saved)(cotangent)

    run.defvjp(forward, backward)
    return run


def _layer_key(index: int, layer: nn.Module) -> str:
    return f"{index:02d}_{type(layer).__name__.lower()}"


_FACTORS: contextvars.ContextVar[tuple[str, frozenset[str], int] | None] = contextvars.ContextVar(
    "sufficient_factors", default=None
)


def sufficient_factors(
    axis: str, keys: frozenset[str], p: int
) -> contextlib.AbstractContextManager[None]:
    """While tracing inside ``shard_map``: the ``Dense`` layers ``keys`` exchange their
    weight gradient as sufficient factors over the mesh axis ``axis`` of ``p`` devices
    (Xie et al. 2015): the layer's input rows and the gradient at its output, all-gathered,
    from which every device forms the batch's mean gradient ``X^T dZ / p`` itself; those
    parameters' gradients come out averaged, and the caller does not all-reduce them."""
    return scoped(_FACTORS, (axis, keys, p))


def sfb_mode(setting: str, factor_bytes: float, gradient_bytes: float) -> str:
    """``--sfb``'s rule for one layer: ``factors`` (all, or auto where the gathered factors
    move fewer bytes than the gradient's all-reduce), else ``gradient``."""
    return "factors" if setting == "all" or factor_bytes < gradient_bytes else "gradient"


def factored_dense(layer: Dense, axis: str, p: int, low: Any = None) -> Callable:
    """``(params, state, x) -> (y, state)`` of a ``Dense`` layer whose weight gradient is
    formed from factors gathered over ``axis`` (``sufficient_factors``); ``low``, a dtype
    the layer computes in (its factors travel in fp32). Saves its input and
    pre-activation for the backward pass whatever ``remat`` says."""
    act = activation(layer.act)

    def pre(w: PyTree, x: Array) -> Array:
        z = jnp.dot(x, w["kernel"])
        return z + w["bias"] if layer.use_bias else z

    @jax.custom_vjp
    def f(w: PyTree, x: Array) -> Array:
        return act(pre(w, x))

    def fwd(w: PyTree, x: Array) -> tuple[Array, tuple]:
        z = pre(w, x)
        return act(z), (w, x, z)

    def bwd(res: tuple, dy: Array) -> tuple[PyTree, Array]:
        w, x, z = res
        dz = jax.vjp(act, z)[1](dy)[0]

        def gather(a: Array) -> Array:  # >= fp32 on every backend (XLA's CPU widens bf16)
            return jax.lax.all_gather(a.reshape(-1, a.shape[-1]).astype(wide(a.dtype)), axis,
                                      tiled=True)  # fmt: skip

        xs, dzs = gather(x), gather(dz)
        grads = {"kernel": jnp.dot(xs.T, dzs) / p}
        if layer.use_bias:
            grads["bias"] = jnp.sum(dzs, axis=0) / p
        grads = {k: g.astype(w[k].dtype) for k, g in grads.items()}
        return grads, jnp.dot(dz, w["kernel"].T)

    f.defvjp(fwd, bwd)

    def run(w: PyTree, s: PyTree, x: Array) -> tuple[Array, PyTree]:
        if low is not None:  # outside f: the casts' own gradients return fp32
            w, x = jax.tree.map(lambda a: a.astype(low), w), x.astype(low)
        return f(w, x), s

    return run


@dataclasses.dataclass(frozen=True)
class Sequential:
    """A model as a sequence of layers, ``f(x) = f_n(...f_1(x))``.

    Parameters are ``{layer_key: layer_params}``; non-trainable state (BatchNorm's
    running averages) is ``{layer_key: {collection: ...}}`` for the layers that
    have any. ``stage(i, j)`` is the contiguous sub-model of layers ``i..j-1``
    with the same keys, so a pipeline stage applies to a subset of the params.

    How it computes, for every strategy alike (each runs ``apply`` or a stage's):
    ``remat`` recomputes each layer's activations in the backward pass (``full``: keeps
    only the layer's input; ``selective``: also the outputs of its matrix products without
    batch dimensions, so the attention scores and the elementwise work are recomputed -
    MaxText's ``minimal`` policy, Megatron's selective recomputation); ``precision``
    ``bf16`` runs each layer on bf16 copies of its parameters and of its floating input
    (master weights, their gradients and the loss stay fp32); ``fp64`` keeps the
    parameters in float64 and raises a floating input to it (``refdl.core.precision``;
    the layers draw their initial values in fp32, so fp32 and fp64 runs start equal).
    """

    layers: tuple[nn.Module, ...]
    keys: tuple[str, ...] = ()
    remat: str = "none"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if not self.keys:
            object.__setattr__(
                self, "keys", tuple(_layer_key(i, l) for i, l in enumerate(self.layers))
            )
        if len(self.keys) != len(self.layers):
            raise ValueError("Sequential: one key per layer")

    def __len__(self) -> int:
        return len(self.layers)

    def init(self, rng: Array, x: Array) -> tuple[PyTree, PyTree, PyTree]:
        """Initialise every layer on the example input ``x`` (one compiled program).

        Returns ``(params, model_state, logical_axes)``: plain arrays, the
        non-parameter collections, and a tree like ``params`` whose leaves are
        tuples of logical axis names (one per array dimension).
        """
        # Initialisation runs once: compile it without LLVM's expensive passes, which on
        # the CPU backend take seconds per random initializer for no run-time gain here.
        # The program is kept per input shape: each seed of a run is a new key, not a new
        # compile (refdl validate --results runs many seeds of one model).
        options = _FAST_COMPILE if jax.default_backend() == "cpu" else None
        programs = self.__dict__.setdefault("_init_programs", {})
        sig = (jax.default_backend(), jnp.shape(x), str(jnp.result_type(x)), jax.typeof(rng))
        if sig not in programs:
            lowered = jax.jit(self._init_boxed).lower(rng, x)
            programs[sig] = lowered.compile(compiler_options=options)
        boxed = programs[sig](rng, x)
        params, state = to_master(self._params_state(nn.meta.unbox(boxed)), self.precision)
        return params, state, self._axes(boxed)

    def logical_axes(self, x: Array) -> PyTree:
        """The logical axis names of every parameter, from shapes alone (nothing allocated)."""
        return self._axes(jax.eval_shape(self._init_boxed, jax.random.key(0), x))

    def abstract_params(self, x: Array) -> PyTree:
        """The parameters as ``ShapeDtypeStruct``s, from shapes alone (nothing allocated)."""
        return self.abstract_variables(x)[0]

    def abstract_variables(self, x: Array) -> tuple[PyTree, PyTree]:
        """``(params, model_state)`` as ``ShapeDtypeStruct``s, from shapes alone."""
        boxed = jax.eval_shape(self._init_boxed, jax.random.key(0), x)
        return abstract_to_master(self._params_state(nn.meta.unbox(boxed)), self.precision)

    def _init_boxed(self, rng: Array, x: Array) -> dict[str, PyTree]:
        out = {}
        for key, layer, k in zip(
            self.keys, self.layers, jax.random.split(rng, len(self)), strict=True
        ):
            variables = layer.init(k, x, train=False)
            x = layer.apply(nn.meta.unbox(variables), x, train=False)
            out[key] = variables
        return out

    @staticmethod
    def _params_state(variables: dict[str, PyTree]) -> tuple[PyTree, PyTree]:
        params = {k: dict(v).get("params", {}) for k, v in variables.items()}
        state = {}
        for k, v in variables.items():
            rest = {c: x for c, x in v.items() if c != "params"}
            if rest:
                state[k] = rest
        return params, state

    @staticmethod
    def _axes(boxed: dict[str, PyTree]) -> PyTree:
        return {
            k: jax.tree.map(
                tuple,
                nn.get_partition_spec(dict(v)).get("params", {}),
                is_leaf=lambda s: isinstance(s, PartitionSpec),
            )
            for k, v in boxed.items()
        }

    def apply(
        self, params: PyTree, state: PyTree, x: Array, train: bool = False
    ) -> tuple[Array, PyTree]:
        """Run the layers in order; returns the output and the updated model state."""
        new_state = {}
        factors = _FACTORS.get() if train else None
        for key, layer in zip(self.keys, self.layers, strict=True):
            s = state.get(key, {})
            fn = self._layer_fn(layer, train, bool(s))
            if factors is not None and key in factors[1] and isinstance(layer, Dense):
                low = jnp.bfloat16 if self.precision == "bf16" else None
                fn = factored_dense(layer, factors[0], factors[2], low)
            x, updates = fn(params.get(key, {}), s, x)
            if s:
                new_state[key] = updates
        return x, new_state

    def dense_layers(self, params: PyTree, state: PyTree, x: Any) -> dict[str, dict[str, int]]:
        """Each fully connected layer's ``rows`` (of an input like ``x``), ``in``, ``out``
        and ``params``: what sufficient-factor broadcasting prices."""
        shapes = self.input_shapes(params, state, x)
        out = {}
        for key, layer in zip(self.keys, self.layers, strict=True):
            if isinstance(layer, Dense):
                m, n = params[key]["kernel"].shape
                out[key] = {"rows": math.prod(shapes[key][:-1]), "in": m, "out": n,
                            "params": m * n + (n if layer.use_bias else 0)}  # fmt: skip
        return out

    def input_shapes(self, params: PyTree, state: PyTree, x: Any) -> dict[str, tuple[int, ...]]:
        """Each layer's input shape for an input like ``x`` (shapes alone: nothing runs)."""
        out = {}
        for key, layer in zip(self.keys, self.layers, strict=True):
            out[key] = tuple(x.shape)
            variables = {"params": params.get(key, {}), **state.get(key, {})}
            x = jax.eval_shape(lambda v, a, lay=layer: lay.apply(v, a, train=False), variables, x)
        return out

    def _layer_fn(self, layer: nn.Module, train: bool, stateful: bool) -> Callable:
        """``(params, state, x) -> (y, new_state)`` of one layer, in this model's precision,
        recomputed in the backward pass as ``remat`` says."""
        low = jnp.bfloat16 if self.precision == "bf16" else None

        def run(p: PyTree, s: PyTree, x: Array) -> tuple[Array, PyTree]:
            if low is not None:
                p = jax.tree.map(lambda a: a.astype(low), p)
                x = x.astype(low) if jnp.issubdtype(x.dtype, jnp.floating) else x
            elif self.precision == "fp64" and jnp.issubdtype(x.dtype, jnp.floating):
                x = x.astype(jnp.float64)
            variables = {"params": p, **s}
            if train and stateful:
                y, updates = layer.apply(variables, x, train=True, mutable=list(s))
                return y, dict(updates)
            return layer.apply(variables, x, train=train), s

        if self.remat == "none" or not train:
            return run
        return recomputed(run, None if self.remat == "full" else _SELECTIVE)

    def stage(self, start: int, stop: int) -> Sequential:
        """The contiguous sub-model of layers ``start..stop-1`` (same parameter keys)."""
        if not 0 <= start < stop <= len(self.layers):
            raise ValueError(f"stage({start}, {stop}) outside 0..{len(self.layers)}")
        return dataclasses.replace(self, layers=self.layers[start:stop], keys=self.keys[start:stop])

    def split(self, boundaries: Sequence[int]) -> list[Sequential]:
        """Split at the given layer indices: ``split([2, 5])`` -> layers 0-1, 2-4, 5-end."""
        edges = [0, *boundaries, len(self.layers)]
        return [self.stage(a, b) for a, b in itertools.pairwise(edges)]


def param_count(tree: PyTree) -> int:
    """Total number of scalars in a tree of arrays."""
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(tree)))
