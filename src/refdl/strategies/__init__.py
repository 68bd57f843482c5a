"""Strategies, one module each, registered by name in ``STRATEGIES``."""

from refdl.strategies import (  # noqa: F401  (registers)
    context,
    data,
    decentralized,
    fsdp,
    hybrid,
    model,
    pipeline,
    ps,
    single,
)
from refdl.strategies.base import STRATEGIES, Strategy, declared_traits, register, traits_of

__all__ = ["STRATEGIES", "Strategy", "declared_traits", "register", "traits_of"]
