"""From a spec to the pure pieces of a run, without devices: data set, ``Task``, model shape.

It assembles what the layers below it define (data sets, models, losses,
optimizers), which is why it sits above them. ``make_task`` is what the run
builder (``refdl.run.build``) and the performance model (``refdl.perf.model_cost``)
share: neither builds the other's parts, and nothing here places an array on a
device (parameters appear only as shapes until a strategy initialises them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from refdl.config.plan import Layer, ModelShape
from refdl.config.spec import RunSpec
from refdl.core.losses import LOSSES
from refdl.core.optim import make_optimizer_for
from refdl.core.task import Task
from refdl.data import DATASETS, Dataset, load_dataset
from refdl.models import MODELS


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A spec's pure pieces: the spec resolved, its data set, its Task, its model's shape."""

    spec: RunSpec
    dataset: Dataset
    task: Task
    shape: ModelShape


def assemble(spec: RunSpec) -> Pieces:
    """The spec with the model's recipe filled in, then its data set, Task and model
    shape (no device: parameters appear only as shapes)."""
    spec = resolve(spec)
    dataset = load_data(spec)
    model, sample, axes = _model(spec, dataset)
    shape = _shape(model, sample, axes, dataset, spec.model)
    return Pieces(spec, dataset, _task(spec, model, sample, axes), shape)


def resolve(spec: RunSpec) -> RunSpec:
    """``spec`` with the model's recipe (data set, optimizer, learning rate) where unset
    (the microbatches are the plan's: ``refdl.config.plan``)."""
    d = MODELS.get(spec.model).defaults
    return dataclasses.replace(
        spec,
        dataset=spec.dataset or d.get("dataset", "digits"),
        optimizer=spec.optimizer or d.get("optimizer", "sgd"),
        lr=spec.lr if spec.lr is not None else d.get("lr", 0.01),
    )


def load_data(spec: RunSpec) -> Dataset:
    """The spec's data set (read from ``--data-dir`` where it needs files; a resumed run's
    own folder for a data set that reads none is passed over, as it was when it started:
    refused for new runs since 2026-11-28)."""
    data_dir = spec.data_dir
    if spec.resume and data_dir and not DATASETS.get(spec.dataset).needs_dir:
        data_dir = None
    return load_dataset(spec.dataset, data_dir, dict(spec.data_opts))


def make_task(spec: RunSpec, dataset: Dataset) -> Task:
    """The model, loss and optimizer of a resolved ``spec`` on ``dataset``, as a Task."""
    return _task(spec, *_model(spec, dataset))


def _model(spec: RunSpec, dataset: Dataset) -> tuple[Any, np.ndarray, Any]:
    """The spec's model, a one-example input and the parameters' logical axes."""
    LOSSES.get(spec.loss)
    model = MODELS.get(spec.model).make(dataset.info, dict(spec.model_opts))
    model = dataclasses.replace(model, remat=spec.remat, precision=spec.precision)
    sample = dataset.train_batch(np.arange(1))["x"]
    return model, sample, model.logical_axes(jnp.asarray(sample))


def _task(spec: RunSpec, model: Any, sample: np.ndarray, axes: Any) -> Task:
    """The Task of the model with the spec's loss and optimizer (made last)."""
    loss, init = spec.loss, spec.init
    options = MODELS.get(spec.model).cpu_compiler_options
    optimizer, base = make_optimizer_for(spec, logical_axes=axes)
    return Task(model, loss, optimizer, sample, axes, schedule=base, init=init,
                cpu_compiler_options=options)  # fmt: skip


def model_shape(task: Task, dataset: Dataset, name: str) -> ModelShape:
    """The model seen without devices: per layer, each parameter's shape and logical axes."""
    return _shape(task.model, task.sample_x, task.logical_axes, dataset, name)


def _shape(model: Any, sample: np.ndarray, logical_axes: Any, dataset: Dataset,
           name: str) -> ModelShape:  # fmt: skip
    params, state = model.abstract_variables(jnp.asarray(sample))
    layers = []
    for key in model.keys:
        shapes = params.get(key, {})
        axes = logical_axes.get(key, {})
        flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
        table = {}
        for path, leaf in flat:
            logical = _get(axes, path)
            table["/".join(str(getattr(k, "key", k)) for k in path)] = (
                tuple(leaf.shape),
                tuple(logical) if logical else (None,) * leaf.ndim,
            )
        layers.append(Layer(key, table))
    splits = name in MODELS and MODELS.get(name).splits_sequence
    return ModelShape(
        name=name,
        layers=tuple(layers),
        batch_stats=any("batch_stats" in v for v in state.values()),
        train_size=dataset.info.train_size,
        sequence=int(np.shape(sample)[1]) if splits else 0,
    )


def _get(tree, path):
    for k in path:
        tree = tree[getattr(k, "key", k)]
    return tree
