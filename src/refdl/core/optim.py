"""SGD variants from optax (sgd, momentum, nesterov, adam) and learning-rate schedules.

Schedules: ``constant``; ``step`` (multiply by ``decay_factor`` every
``decay_every`` steps); ``cosine`` (to zero at ``total_steps``); each optionally
preceded by a linear warm-up of ``warmup_steps`` from 0 to ``lr``.
"""

from __future__ import annotations

from typing import Any

import optax

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


def make_optimizer(
    name: str,
    schedule: optax.Schedule,
    *,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """An optax optimizer by name; ``weight_decay`` adds ``wd * params`` to the gradient (L2)."""
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


def make_optimizer_for(spec: RunSpec, updates_per_step: int = 1) -> tuple[Any, Any]:
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
        spec.optimizer, schedule, momentum=spec.momentum, weight_decay=spec.weight_decay
    )
    return optimizer, base
