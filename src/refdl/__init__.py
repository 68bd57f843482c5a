"""refdl: a pure-JAX reference implementation of parallel and distributed training.

The library's public surface (docs/library.md), importable from here:

    import refdl
    spec = refdl.RunSpec(strategy="data", devices=4, model="mlp")
    summary = refdl.fit(spec)                    # train, with logs and checkpoints
    traj = refdl.run_steps(spec, 5)              # or just take 5 steps
    refdl.assert_equivalent(spec)                # equal to the single-device reference?

Importing the package is cheap and starts nothing: each name is imported on first
use, so ``import refdl`` does not pull in JAX (and a CLI can still choose the
simulated device count before JAX's backend starts).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "RunSpec": "refdl.config.spec",
    "MeshSpec": "refdl.config.mesh",
    "Traits": "refdl.config.plan",
    "Plan": "refdl.config.plan",
    "Option": "refdl.config.values",
    "ModelDef": "refdl.models.base",
    "register_model": "refdl.models.base",
    "Strategy": "refdl.strategies.base",
    "register_strategy": "refdl.strategies.base",
    "ArrayDataset": "refdl.data.base",
    "DataInfo": "refdl.data.base",
    "DatasetDef": "refdl.data.base",
    "register_dataset": "refdl.data.base",
    "build": "refdl.run.build",
    "trajectory": "refdl.run.trajectory",
    "run_steps": "refdl.run.trajectory",
    "fit": "refdl.run.loop",
    "assert_equivalent": "refdl.testing",
    "compare": "refdl.core.compare",
    "register_shape_model": "refdl.perf.zoo",
    "predict_steps": "refdl.named",
    "UsageError": "refdl.errors",
}
_ALIASES = {
    "register_model": "register",
    "register_strategy": "register",
    "register_dataset": "register",
}
# Calls whose refusals are worded for a library caller (arguments, not flags).
_WORDED = {"build", "trajectory", "run_steps", "fit", "assert_equivalent"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'refdl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), _ALIASES.get(name, name))
    if name in _WORDED:
        value = _in_arguments(value)
    globals()[name] = value
    return value


def _in_arguments(fn: Any) -> Any:
    """``fn`` whose UsageError names ``RunSpec`` arguments (``overwrite=True``) where the
    command line's message names flags (``--overwrite``)."""
    from refdl.config.spec import as_arguments
    from refdl.errors import UsageError

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UsageError as e:
            raise type(e)(as_arguments(str(e))) from None

    return call


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
