"""The model registry: each model module registers a ``ModelDef`` by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from refdl.core.layers import Sequential
from refdl.errors import UsageError
from refdl.registry import Registry


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """How to build a model and what it expects.

    ``build(info, **options)`` returns a ``Sequential`` for a data set described by
    ``info`` (a ``refdl.data.DataInfo``); ``options`` are the model's knobs with
    their defaults (``--model-opt KEY=VALUE``); ``data_kind`` is ``"image"`` or
    ``"tokens"``; ``defaults`` are the recipe settings it trains well with
    (optimizer, lr, data set), used where the user did not set them.
    """

    name: str
    build: Callable[..., Sequential]
    data_kind: str
    options: dict[str, Any]
    defaults: dict[str, Any]
    doc: str = ""

    def make(self, info: Any, overrides: dict[str, str] | None = None) -> Sequential:
        """Build for ``info`` with string overrides parsed to each option's type."""
        if info.kind != self.data_kind:
            raise UsageError(
                f"model {self.name!r} needs a {self.data_kind} data set, but "
                f"{info.name!r} holds {info.kind}; pick another --dataset"
            )
        opts = dict(self.options)
        for key, raw in (overrides or {}).items():
            if key not in opts:
                raise UsageError(
                    f"model {self.name!r} has no option {key!r}; "
                    f"its options are: {', '.join(sorted(opts)) or 'none'}"
                )
            opts[key] = _parse_like(key, raw, opts[key])
        return self.build(info, **opts)


def _parse_like(key: str, raw: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if isinstance(default, tuple):
            return tuple(int(v) for v in raw.replace("x", ",").split(",") if v)
        return type(default)(raw)
    except ValueError:
        raise UsageError(f"--model-opt {key}={raw!r}: expected a value like {default!r}") from None


MODELS: Registry[ModelDef] = Registry("model")


def register(model: ModelDef) -> ModelDef:
    """Register ``model`` under its name."""
    return MODELS.register(model.name)(model)
