"""Strategies, one module each, registered by name in ``STRATEGIES``."""

from refdl.strategies import data, decentralized, hybrid, model, pipeline, ps, single  # noqa: F401  (registers)
from refdl.strategies.base import STRATEGIES, Strategy, register

__all__ = ["STRATEGIES", "Strategy", "register"]
