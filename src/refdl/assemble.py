"""From a spec to the pure pieces of a run, without devices: data set, ``Task``, model shape.

It assembles what the layers below it define (data sets, models, losses,
optimizers), which is why it sits above them. ``make_task`` is what the run
builder (``refdl.run.build``) and the performance model (``refdl.perf.model_cost``)
share: neither builds the other's parts, and nothing here places an array on a
device (parameters appear only as shapes until a strategy initialises them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from refdl.config.plan import Layer, ModelShape
from refdl.config.spec import RunSpec
from refdl.core.losses import LOSSES
from refdl.core.optim import make_optimizer_for
from refdl.core.task import Task
from refdl.data import Dataset, load_dataset
from refdl.models import MODELS


def resolve(spec: RunSpec) -> RunSpec:
    """``spec`` with the model's recipe (data set, optimizer, learning rate) where unset,
    validated (the microbatches are the plan's: ``refdl.config.plan``)."""
    d = MODELS.get(spec.model).defaults
    return dataclasses.replace(
        spec,
        dataset=spec.dataset or d.get("dataset", "digits"),
        optimizer=spec.optimizer or d.get("optimizer", "sgd"),
        lr=spec.lr if spec.lr is not None else d.get("lr", 0.01),
    ).validate()


def load_data(spec: RunSpec) -> Dataset:
    """The spec's data set (read from ``--data-dir`` where it needs files)."""
    return load_dataset(spec.dataset, spec.data_dir, dict(spec.data_opts))


def make_task(spec: RunSpec, dataset: Dataset) -> Task:
    """The model, loss and optimizer of a resolved ``spec`` on ``dataset``, as a Task."""
    LOSSES.get(spec.loss)
    model_def = MODELS.get(spec.model)
    model = model_def.make(dataset.info, dict(spec.model_opts))
    model = dataclasses.replace(model, remat=spec.remat, precision=spec.precision)
    optimizer, base = make_optimizer_for(spec)
    sample = dataset.train_batch(np.arange(1))["x"]
    axes = model.logical_axes(jnp.asarray(sample))
    return Task(model, spec.loss, optimizer, sample, axes, schedule=base, init=spec.init,
                cpu_compiler_options=model_def.cpu_compiler_options)  # fmt: skip


def model_shape(task: Task, dataset: Dataset, name: str) -> ModelShape:
    """The model seen without devices: per layer, each parameter's shape and logical axes."""
    params, state = task.model.abstract_variables(jnp.asarray(task.sample_x))
    layers = []
    for key in task.model.keys:
        shapes = params.get(key, {})
        axes = task.logical_axes.get(key, {})
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
        sequence=int(np.shape(task.sample_x)[1]) if splits else 0,
    )


def _get(tree, path):
    for k in path:
        tree = tree[getattr(k, "key", k)]
    return tree
