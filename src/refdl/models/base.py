"""The model registry: each model module registers a ``ModelDef`` by name."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from refdl.config.values import Option, parse_options
from refdl.core.layers import Sequential
from refdl.errors import UsageError
from refdl.registry import Registry


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """How to build a model and what it expects.

    ``build(info, **options)`` returns a ``Sequential`` for a data set described by
    ``info`` (a ``refdl.data.DataInfo``); ``options`` are the model's knobs, each an
    ``Option`` declaring its default, type and range (``--model-opt KEY=VALUE``,
    checked before the model is built); ``data_kind`` is ``"image"`` or
    ``"tokens"``; ``defaults`` are the recipe settings it trains well with
    (optimizer, lr, data set), used where the user did not set them;
    ``cpu_compiler_options`` are XLA:CPU options its programs compile with, where one
    measured faster for this model and slower for others (docs/speed.md);
    ``splits_sequence``: its positions mix only through attention, so a ``context`` axis
    (``refdl.parallel.context``) or sequence parallelism may split its sequence.
    """

    name: str
    build: Callable[..., Sequential]
    data_kind: str
    options: dict[str, Option]
    defaults: dict[str, Any]
    doc: str = ""
    cpu_compiler_options: tuple[tuple[str, str], ...] = ()
    splits_sequence: bool = False

    def defaults_of_options(self) -> dict[str, Any]:
        """Each option's default value."""
        return {k: o.default for k, o in self.options.items()}

    def make(self, info: Any, overrides: dict[str, str] | None = None) -> Sequential:
        """Build for ``info`` with string overrides parsed to each option's type."""
        if info.kind != self.data_kind:
            raise UsageError(
                f"model {self.name!r} needs a {self.data_kind} data set, but "
                f"{info.name!r} holds {info.kind}; pick another --dataset"
            )
        opts = parse_options(self.options, overrides or {}, f"model {self.name!r}", "--model-opt")
        try:
            inspect.signature(self.build).bind(info, **opts)
        except TypeError as e:
            raise UsageError(
                f"model {self.name!r}: build must take (info, **options) - the data set's "
                f"description, then one keyword per declared option ({e})"
            ) from None
        model = self.build(info, **opts)
        if not isinstance(model, Sequential):
            raise UsageError(f"model {self.name!r}: build returned a {type(model).__name__}, "
                             "not a refdl.core.layers.Sequential")  # fmt: skip
        return model


MODELS: Registry[ModelDef] = Registry("model")


def register(model: ModelDef) -> ModelDef:
    """Register ``model`` under its name."""
    return MODELS.register(model.name)(model)
