"""Models, one module each, registered by name in ``MODELS``."""

from refdl.models import lenet5, lstm_lm, mlp, moe, resnet, transformer  # noqa: F401  (registers)
from refdl.models.base import MODELS, ModelDef, register

__all__ = ["MODELS", "ModelDef", "register"]
