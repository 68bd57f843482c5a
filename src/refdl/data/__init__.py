"""Data sets (registered by name), readers, the zarr store and the deterministic order."""

from refdl.data import embedded, readers, store, synthetic  # noqa: F401  (registers)
from refdl.data.base import DATASETS, ArrayDataset, DataInfo, Dataset, DatasetDef, register
from refdl.data.order import global_batch_indices, worker_share, worker_slice

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "DataInfo",
    "Dataset",
    "DatasetDef",
    "global_batch_indices",
    "load_dataset",
    "register",
    "worker_share",
    "worker_slice",
]


def load_dataset(name: str, data_dir: str | None = None, options: dict | None = None) -> Dataset:
    """The registered data set ``name`` (reading ``data_dir`` where it needs files)."""
    return DATASETS.get(name).make(data_dir, options)
