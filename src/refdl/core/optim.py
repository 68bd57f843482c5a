"""SGD variants from optax (sgd, momentum, nesterov, adam, muon) and learning-rate schedules.

Muon (``muon``): each weight matrix's Nesterov momentum replaced by its nearest
semi-orthogonal matrix (five quintic Newton-Schulz iterations), scaled by
``sqrt(max(1, fan_out / fan_in))`` and applied with decoupled weight decay, step for step
as ``torch.optim.Muon`` does (an EMA momentum without bias correction, which optax's
``scale_by_muon`` adds); every other parameter (biases, norms, embeddings, the output
layer, MoE routers) goes to optax's AdamW in the same optimizer (``muon_dims`` decides,
from the parameters' logical axes). Where a strategy holds no whole matrix it says how
to orthogonalize one (``orthogonalized_by``). docs/muon.md says where the defaults
differ from Keller Jordan's and Moonlight's.

Schedules: ``constant``; ``step`` (multiply by ``decay_factor`` every
``decay_every`` steps); ``cosine`` (to zero at ``total_steps``); each optionally
preceded by a linear warm-up of ``warmup_steps`` from 0 to ``lr``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from refdl.config.choices import LR_SCHEDULES as SCHEDULES
from refdl.config.choices import OPTIMIZERS
from refdl.config.spec import RunSpec
from refdl.errors import UsageError


def make_schedule(
    lr: float,
    kind: str = "constant",
    *,
    total_steps: int = 1,
    warmup_steps: int = 0,
    decay_every: int = 0,
    decay_factor: float = 0.1,
) -> optax.Schedule:
    """The learning rate as a function of the step.

    >>> s = make_schedule(1.0, "step", decay_every=10, decay_factor=0.5)
    >>> float(s(9)), float(s(10))
    (1.0, 0.5)
    """
    if lr <= 0:
        raise UsageError(f"--lr must be > 0 (got {lr})")
    if warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be >= 0 (got {warmup_steps})")
    rest = max(total_steps - warmup_steps, 1)
    if kind == "constant":
        main = optax.constant_schedule(lr)
    elif kind == "step":
        if decay_every <= 0:
            raise UsageError("--lr-schedule step needs --lr-decay-every N with N > 0")
        main = optax.exponential_decay(lr, decay_every, decay_factor, staircase=True)
    elif kind == "cosine":
        main = optax.cosine_decay_schedule(lr, rest)
    else:
        raise UsageError(f"unknown --lr-schedule {kind!r}; choose one of: {', '.join(SCHEDULES)}")
    if warmup_steps == 0:
        return main
    warm = optax.linear_schedule(0.0, lr, warmup_steps)
    return optax.join_schedules([warm, main], [warmup_steps])


# torch.optim.Muon's defaults (PyTorch 2.13), Keller Jordan's coefficients and steps
MUON_MOMENTUM = 0.95
MUON_NS_COEFFS = (3.4445, -4.7750, 2.0315)
MUON_NS_STEPS = 5
MUON_EPS = 1e-7
# each expert its own matrix; a projection onto heads x head_dim is one matrix per layer
_BATCH_AXES = ("expert",)
_NOT_MATRICES = ("vocab",)  # embeddings and the language models' output layer


def matrix_dims(names: tuple[str | None, ...]) -> MuonDimensionNumbers | None:
    """How Muon sees a parameter with logical axes ``names``: its reduction (input) and
    output axes, the rest batch axes; ``None`` for AdamW (fewer than two axes, an
    embedding or output layer, or a 2-D matrix with an unnamed axis: a classifier's head,
    a positional table, a router).

    >>> matrix_dims(("embed", "heads", "head_dim"))
    MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1, 2))
    >>> matrix_dims((None, None, "conv_in", "conv_out"))
    MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=(3,))
    >>> matrix_dims(("embed", None)) is None
    True
    """
    n = len(names)
    matrix = [i for i, a in enumerate(names) if a not in _BATCH_AXES]
    if len(matrix) < 2 or any(a in _NOT_MATRICES for a in names):
        return None
    if n == 2 and None in names:
        return None
    out = matrix[-2:] if tuple(names[-2:]) == ("heads", "head_dim") else matrix[-1:]
    return MuonDimensionNumbers(tuple(i for i in matrix if i not in out), tuple(out))


def muon_dims(logical_axes: Any) -> Callable[[Any], Any]:
    """For any part of the parameters (a pipeline stage holds some), each leaf's
    ``matrix_dims`` read from ``logical_axes`` by its path; a leaf without logical axes
    (a model that declares none) is a matrix when it has two or more axes (input axes
    first, the last the output)."""

    def lookup(path: tuple, ndim: int) -> tuple[str | None, ...]:
        node = logical_axes
        for k in path:
            key = getattr(k, "key", getattr(k, "idx", k))
            if not isinstance(node, dict) or key not in node:
                return ("in",) * (ndim - 1) + ("out",) if ndim else ()
            node = node[key]
        return tuple(node) if isinstance(node, tuple | list) else (None,) * ndim

    def dims(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, x: matrix_dims(lookup(path, jnp.ndim(x))), params
        )

    return dims


def muon_paths(logical_axes: Any, params: Any) -> tuple[str, ...]:
    """The ``/``-joined paths of the parameters Muon updates (the rest go to AdamW), as a
    framework's twin needs them to split its parameters the same way."""
    found = jax.tree_util.tree_flatten_with_path(muon_dims(logical_axes)(params),
                                                 is_leaf=_is_dims)[0]  # fmt: skip
    return tuple("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                 for path, d in found if d is not None)  # fmt: skip


def muon_matrices(logical_axes: Any, params: Any) -> tuple[tuple[int, int, int], ...]:
    """``(count, fan_in, fan_out)`` of each parameter Muon updates (``count``: its batch of
    matrices, an expert bank's experts), what the performance model prices."""
    dims = jax.tree_util.tree_leaves(muon_dims(logical_axes)(params), is_leaf=_is_dims)
    out = []
    for d, x in zip(dims, jax.tree_util.tree_leaves(params), strict=True):
        if d is None:
            continue
        shape = jnp.shape(x)
        fan_in = math.prod(shape[i] for i in d.reduction_axis)
        fan_out = math.prod(shape[i] for i in d.output_axis)
        out.append((math.prod(shape) // (fan_in * fan_out), fan_in, fan_out))
    return tuple(out)


def newton_schulz(x: jax.Array, steps: int = MUON_NS_STEPS, eps: float = MUON_EPS) -> jax.Array:
    """The quintic Newton-Schulz iteration of Keller Jordan's Muon on a matrix ``[m, n]``:
    ``x`` over its Frobenius norm (at least ``eps``, as ``torch.optim.Muon`` clamps it),
    then ``X <- aX + (bA + cA^2)X`` with ``A = XX^T`` on the shorter side, in ``x``'s
    dtype (``torch.optim.Muon`` casts to bf16)."""
    a, b, c = MUON_NS_COEFFS
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / jnp.maximum(jnp.linalg.norm(x), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def newton_schulz_bf16(
    x: jax.Array, steps: int = MUON_NS_STEPS, eps: float = MUON_EPS
) -> jax.Array:
    """``newton_schulz`` rounded as ``torch.optim.Muon`` rounds it on a CPU: ``x`` cast to
    bf16, each product (and ``addmm``) accumulated in fp32 and rounded once to bf16. Not
    bit-exact (PyTorch's kernels sum in another order), but 30-50x closer to PyTorch than
    the unrounded iteration (docs/muon.md): what bf16 alone does to a run."""
    bf, f32 = jnp.bfloat16, jnp.float32
    a, b, c = MUON_NS_COEFFS
    tall = x.shape[0] > x.shape[1]
    y = (x.T if tall else x).astype(bf)
    y = (y / jnp.maximum(jnp.linalg.norm(y.astype(f32)).astype(bf), eps)).astype(bf)
    for _ in range(steps):
        gram = jnp.dot(y, y.T, preferred_element_type=f32).astype(bf)
        update = b * gram.astype(f32) + c * jnp.dot(gram, gram, preferred_element_type=f32)
        y = a * y.astype(f32) + jnp.dot(update.astype(bf), y, preferred_element_type=f32)
        y = y.astype(bf)
    return (y.T if tall else y).astype(x.dtype)


_ITERATION: contextvars.ContextVar[Callable[[jax.Array], jax.Array] | None] = (
    contextvars.ContextVar("iteration", default=None)
)


@contextlib.contextmanager
def iterated_by(ns: Callable[[jax.Array], jax.Array]) -> Iterator[None]:
    """While tracing a step, every matrix (whichever strategy orthogonalizes it) goes
    through ``ns`` instead of ``newton_schulz``: ``newton_schulz_bf16`` shows what
    PyTorch's bf16 alone does to a run (``refdl validate --optimizer muon``)."""
    token = _ITERATION.set(ns)
    try:
        yield
    finally:
        _ITERATION.reset(token)


def orthogonal_update(m: jax.Array, dims: MuonDimensionNumbers) -> jax.Array:
    """Muon's update of one whole parameter from its Nesterov momentum ``m``: every matrix
    (input axes x output axes; other axes batch) orthogonalized and scaled by
    ``sqrt(max(1, fan_out / fan_in))`` (``torch.optim.Muon``'s "original")."""
    red, out = tuple(dims.reduction_axis), tuple(dims.output_axis)
    batch = tuple(i for i in range(m.ndim) if i not in red + out)
    moved = jnp.transpose(m, batch + red + out)
    fan_in, fan_out = math.prod(m.shape[i] for i in red), math.prod(m.shape[i] for i in out)
    mats = moved.reshape((-1, fan_in, fan_out))
    ns = _ITERATION.get() or newton_schulz
    done = jax.vmap(ns)(mats) * max(1.0, fan_out / fan_in) ** 0.5
    back = done.reshape(moved.shape)
    return jnp.transpose(back, tuple(int(i) for i in np.argsort(batch + red + out)))


# (path, momentum as the strategy holds it, dims) -> the update as the strategy holds it
Orthogonalizer = Callable[[tuple, jax.Array, MuonDimensionNumbers], jax.Array]
_ORTHOGONALIZER: contextvars.ContextVar[Orthogonalizer | None] = contextvars.ContextVar(
    "orthogonalizer", default=None
)


@contextlib.contextmanager
def orthogonalized_by(fn: Orthogonalizer) -> Iterator[None]:
    """While tracing a step, Muon's matrices are orthogonalized by ``fn``: a strategy that
    holds only a shard of each matrix (``fsdp``'s flat shards) gathers it, or sends it to
    its owner, there (docs/muon.md's schemes)."""
    token = _ORTHOGONALIZER.set(fn)
    try:
        yield
    finally:
        _ORTHOGONALIZER.reset(token)


class MuonState(NamedTuple):
    """Muon's momentum buffer, shaped like the matrices it updates."""

    momentum: Any


def scale_by_muon(
    dims: Callable[[Any], Any], momentum: float = MUON_MOMENTUM
) -> optax.GradientTransformation:
    """``torch.optim.Muon``'s direction: ``B <- B + (1 - mu)(g - B)``, Nesterov
    ``u = g + mu (B - g)``, then each matrix orthogonalized (``orthogonal_update``, or the
    strategy's ``orthogonalized_by``)."""

    def init(params: Any) -> MuonState:
        return MuonState(optax.tree.zeros_like(params))

    def update(updates: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        del params
        buf = jax.tree.map(lambda b, g: b + (1 - momentum) * (g - b), state.momentum, updates)
        nesterov = jax.tree.map(lambda g, b: g + momentum * (b - g), updates, buf)
        found = dims(updates)
        by = _ORTHOGONALIZER.get() or (lambda _path, x, d: orthogonal_update(x, d))
        out = jax.tree_util.tree_map_with_path(lambda path, x, d: by(path, x, d), nesterov,
                                               found, is_leaf=_is_dims)  # fmt: skip
        return out, MuonState(buf)

    return optax.GradientTransformation(init, update)


def _is_dims(d: Any) -> bool:
    return d is None or isinstance(d, MuonDimensionNumbers)


def muon(
    schedule: optax.Schedule,
    dims: Callable[[Any], Any],
    *,
    momentum: float = MUON_MOMENTUM,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """Muon on the matrices ``dims`` names, AdamW (PyTorch's defaults but its weight
    decay: ``weight_decay`` for both halves, decoupled) on the rest, one learning rate."""

    def labels(params: Any) -> Any:
        return jax.tree.map(lambda d, _: "adamw" if d is None else "muon", dims(params), params,
                            is_leaf=_is_dims)  # fmt: skip

    matrices = optax.chain(
        scale_by_muon(dims, momentum),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    rest = optax.adamw(schedule, weight_decay=weight_decay)
    return optax.partition({"muon": matrices, "adamw": rest}, labels)


def make_optimizer(
    name: str,
    schedule: optax.Schedule,
    *,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    logical_axes: Any = None,
) -> optax.GradientTransformation:
    """An optax optimizer by name; ``weight_decay`` adds ``wd * params`` to the gradient (L2;
    Muon's is decoupled, as PyTorch's). ``logical_axes`` (the model's) tell Muon which
    parameters are matrices."""
    if name == "muon":
        return muon(schedule, muon_dims(logical_axes), weight_decay=weight_decay)
    if name == "sgd":
        opt = optax.sgd(schedule)
    elif name == "momentum":
        opt = optax.sgd(schedule, momentum=momentum)
    elif name == "nesterov":
        opt = optax.sgd(schedule, momentum=momentum, nesterov=True)
    elif name == "adam":
        opt = optax.adam(schedule)
    else:
        raise UsageError(f"unknown --optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")
    if weight_decay:
        opt = optax.chain(optax.add_decayed_weights(weight_decay), opt)
    return opt


def make_optimizer_for(
    spec: RunSpec, updates_per_step: int = 1, logical_axes: Any = None
) -> tuple[Any, Any]:
    """The optax optimizer of a resolved ``spec`` and its learning-rate schedule by step.

    ``updates_per_step`` > 1 (asynchronous parameter servers apply W updates per step)
    advances the schedule once per that many optimizer updates, i.e. once per step."""
    base = make_schedule(
        spec.lr,
        spec.lr_schedule,
        total_steps=spec.steps,
        warmup_steps=spec.warmup_steps,
        decay_every=spec.lr_decay_every,
        decay_factor=spec.lr_decay_factor,
    )
    schedule = base if updates_per_step == 1 else (lambda n: base(n // updates_per_step))
    optimizer = make_optimizer(
        spec.optimizer,
        schedule,
        momentum=spec.momentum,
        weight_decay=spec.weight_decay,
        logical_axes=logical_axes,
    )
    return optimizer, base
