"""The PyTorch adapter: twin models (``models``) and PyTorch's own runners (``runners``)."""

from refdl.adapters.torch.models import (
    INSTALL_HINT,
    NATIVE_DDP_REFUSED,
    ModelPlan,
    available,
    export,
    flatten,
    load,
    require,
)
from refdl.adapters.torch.runners import (
    TorchResult,
    TrainPlan,
    loss_fn,
    make_optimizer,
    train_ddp,
    train_pipeline,
    train_single,
    train_single_apart,
)
from refdl.adapters.torch.twins import TWINS, Twin, check_twin, train_twin

__all__ = [
    "INSTALL_HINT",
    "NATIVE_DDP_REFUSED",
    "TWINS",
    "ModelPlan",
    "TorchResult",
    "TrainPlan",
    "Twin",
    "available",
    "check_twin",
    "export",
    "flatten",
    "load",
    "loss_fn",
    "make_optimizer",
    "require",
    "train_ddp",
    "train_pipeline",
    "train_single",
    "train_single_apart",
    "train_twin",
]
