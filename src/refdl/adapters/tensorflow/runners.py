"""TensorFlow's own training of a Keras twin, as the studies ran it.

- ``single``: a ``tf.function`` step (``GradientTape``, the Keras optimizer);
- ``data`` on ``devices`` > 1: ``MirroredStrategy`` over that many logical CPU
  devices in this process; each replica gets its slice of the global batch, its
  loss is its share of the global mean, and the optimizer sums the replicas'
  gradients (an all-reduce) before one update;
- ``data`` on ``workers`` > 1: ``MultiWorkerMirroredStrategy`` across processes
  (``TF_CONFIG`` on loopback, gRPC ring all-reduce), the same step;
- ``ps``: ``ParameterServerStrategy``: one ps task holds the variables, the
  workers run steps that a ``ClusterCoordinator`` in the chief schedules on
  whichever worker is free (asynchronous, as Jaeger et al. ran it). Update k
  computes the gradient of worker share ``k mod W`` of global batch ``k // W``,
  scaled by 1/W (refdl's ``ps --ps-mode async``).

Learning rates are refdl's per step; Keras' SGD folds the learning rate into its
velocity (``v = m v - lr g``), which equals optax's ``-lr (g + m trace)`` while the
rate is constant (refdl's default schedules are). L2 weight decay is added to the
gradient, as refdl does (Keras' ``weight_decay`` is decoupled, a different rule).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from refdl.adapters.children import free_ports, wait_all
from refdl.adapters.exchange import Flat


def _tf():
    import tensorflow as tf

    return tf


def make_optimizer(name: str, momentum: float) -> Any:
    """The Keras optimizer that computes refdl's ``name`` (learning rate set per step)."""
    import keras

    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.0)
    if name in ("momentum", "nesterov"):
        return keras.optimizers.SGD(learning_rate=0.0, momentum=momentum,
                                    nesterov=name == "nesterov")  # fmt: skip
    if name == "adam":
        return _adam_class()(learning_rate=0.0, epsilon=1e-8)
    raise ValueError(f"no Keras twin for optimizer {name!r}")


def _adam_class() -> type:
    """Keras' Adam with the epsilon where optax (and PyTorch) put it: ``m_hat / (sqrt(v_hat)
    + eps)``. Keras folds the bias corrections into the step size, which moves epsilon
    inside, ``m / (sqrt(v) + eps)``: the same rule for large gradients, a 30x larger
    epsilon at step 1 for the small ones (seen: LSTM biases 11 % apart after one step)."""
    import keras
    from keras import ops

    class Adam(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            lr = ops.cast(learning_rate, variable.dtype)
            gradient = ops.cast(gradient, variable.dtype)
            t = ops.cast(self.iterations + 1, variable.dtype)
            m = self._momentums[self._get_variable_index(variable)]
            v = self._velocities[self._get_variable_index(variable)]
            self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
            self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v),
                                            1 - self.beta_2))  # fmt: skip
            m_hat = m / (1 - ops.power(ops.cast(self.beta_1, variable.dtype), t))
            v_hat = v / (1 - ops.power(ops.cast(self.beta_2, variable.dtype), t))
            self.assign_sub(variable, lr * m_hat / (ops.sqrt(v_hat) + self.epsilon))

    return Adam


def loss_terms(name: str, out: Any, y: Any) -> Any:
    """Per-term losses (one per example, or per token) of refdl's loss ``name``."""
    tf = _tf()
    if name == "cross_entropy":
        return tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(y, tf.int32), out)
    if name == "squared":
        target = tf.one_hot(tf.cast(y, tf.int32), tf.shape(out)[-1], dtype=out.dtype)
        return 0.5 * tf.reduce_sum(tf.square(out - target), axis=-1)
    raise ValueError(f"no TensorFlow twin for loss {name!r}")


class Trainer:
    """The model, optimizer and one replica's step, built in the current strategy scope."""

    def __init__(self, job: dict[str, Any], params: Flat, terms: int) -> None:
        from refdl.adapters.tensorflow.models import build

        tf = _tf()
        self.job, self.tf = job, tf
        self.model = build(job["layers"], params)
        self.opt = make_optimizer(job["optimizer"], job["momentum"])
        self.opt.build(self.model.trainable_variables)
        self.terms = float(terms)  # loss terms in the global batch: the mean's divisor
        self.scale = 1.0

    def replica_step(self, x: Any, y: Any) -> Any:
        """Loss share of this replica; gradients applied (summed over replicas by TF)."""
        tf, job = self.tf, self.job
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            out = self.model(x, training=True)
            loss = tf.reduce_sum(loss_terms(job["loss"], out, y)) / self.terms
        # Dense gradients (an embedding's IndexedSlices too), as refdl's and PyTorch's are:
        # a sparse gradient would let Adam skip the decay of the rows a batch misses.
        grads = [tf.convert_to_tensor(g) * self.scale for g in tape.gradient(loss, variables)]
        if job["weight_decay"]:
            grads = [g + job["weight_decay"] * v for g, v in zip(grads, variables, strict=True)]
        self.opt.apply_gradients(zip(grads, variables, strict=True))
        return loss

    def set_lr(self, lr: float) -> None:
        self.opt.learning_rate.assign(lr)


def _terms(batch: dict[str, np.ndarray]) -> int:
    return int(np.prod(batch["y"].shape))


def _shards(batch: dict[str, np.ndarray], n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return list(zip(np.split(batch["x"], n), np.split(batch["y"], n), strict=True))


def train_single(job: dict[str, Any], params: Flat, batches: list[dict]) -> tuple[dict, Flat, Flat]:
    """Plain TensorFlow: one process, one device."""
    from refdl.adapters.tensorflow.models import export

    tf = _tf()
    trainer = Trainer(job, params, _terms(batches[0]))
    step = tf.function(trainer.replica_step)
    losses, times, first = [], [], {}
    for t, (batch, lr) in enumerate(zip(batches, job["lrs"], strict=True)):
        t0 = time.perf_counter()
        trainer.set_lr(lr)
        losses.append(float(step(tf.constant(batch["x"]), tf.constant(batch["y"]))))
        times.append(time.perf_counter() - t0)
        if t == 0:
            first = export(trainer.model, job["layers"])
    return ({"losses": losses, "step_times": times, "impl": "tf.function + GradientTape"},
            export(trainer.model, job["layers"]), first)  # fmt: skip


def train_mirrored(job: dict[str, Any], params: Flat, batches: list[dict],
                   strategy: Any = None, index: int = 0) -> tuple[dict, Flat, Flat]:  # fmt: skip
    """``MirroredStrategy`` over ``job['devices']`` logical CPUs (or, given ``strategy``,
    ``MultiWorkerMirroredStrategy`` with this process as worker ``index``)."""
    from refdl.adapters.tensorflow.models import export

    tf = _tf()
    if strategy is None:
        n = job["devices"]
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        trainer = Trainer(job, params, _terms(batches[0]))

    @tf.function
    def step(x, y):
        per = strategy.run(trainer.replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per, axis=None)

    losses, times, first = [], [], {}
    for t, (batch, lr) in enumerate(zip(batches, job["lrs"], strict=True)):
        shards = _shards(batch, replicas)
        t0 = time.perf_counter()
        trainer.set_lr(lr)
        xs = strategy.experimental_distribute_values_from_function(
            lambda ctx, s=shards: tf.constant(s[ctx.replica_id_in_sync_group][0])
        )
        ys = strategy.experimental_distribute_values_from_function(
            lambda ctx, s=shards: tf.constant(s[ctx.replica_id_in_sync_group][1]))  # fmt: skip
        losses.append(float(step(xs, ys)))
        times.append(time.perf_counter() - t0)
        if t == 0:
            first = export(trainer.model, job["layers"])
    impl = type(strategy).__name__ + f" ({replicas} replicas)"
    return ({"losses": losses, "step_times": times, "impl": impl},
            export(trainer.model, job["layers"]), first)  # fmt: skip


# -- processes on loopback --------------------------------------------------------------------


def spawn(folder: Path, role: str, index: int, tf_config: dict, log: Path) -> subprocess.Popen:
    """A process of this adapter in ``role`` with ``TF_CONFIG`` set (output to ``log``)."""
    env = {**os.environ, "TF_CONFIG": json.dumps(tf_config), "GRPC_FAIL_FAST": "use_caller"}
    return subprocess.Popen(
        [sys.executable, "-m", "refdl.adapters.tensorflow", str(folder), role, str(index)],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def train_multiworker(folder: Path, job: dict[str, Any]) -> None:
    """``MultiWorkerMirroredStrategy``: ``job['workers']`` processes; worker 0 writes."""
    n = job["workers"]
    addrs = [f"127.0.0.1:{p}" for p in free_ports(n)]
    logs = [folder / f"worker-{i}.log" for i in range(n)]
    procs = [spawn(folder, "mwms", i, {"cluster": {"worker": addrs},
                                       "task": {"type": "worker", "index": i}}, logs[i])
             for i in range(n)]  # fmt: skip
    wait_all(procs, logs, job["timeout"], "TensorFlow")


def multiworker_process(folder: Path, index: int) -> None:
    """One worker of ``train_multiworker``."""
    from refdl.adapters.exchange import read_job, write_result

    tf = _tf()
    job, params, batches = read_job(folder)
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    result, final, first = train_mirrored(job, params, batches, strategy, index)
    if index == 0:
        write_result(folder, result, final, first)


def train_ps(folder: Path, job: dict[str, Any], params: Flat, batches: list[dict]):
    """``ParameterServerStrategy``: a ps task and ``job['workers']`` worker tasks as
    processes; this process is the chief, whose coordinator schedules the updates."""
    from refdl.adapters.tensorflow.models import export

    tf = _tf()
    w = job["workers"]
    ports = free_ports(w + 2)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
               "worker": [f"127.0.0.1:{p}" for p in ports[2:]]}  # fmt: skip
    logs = [folder / "ps-0.log"] + [folder / f"worker-{i}.log" for i in range(w)]
    procs = [spawn(folder, "ps", 0, {"cluster": cluster, "task": {"type": "ps", "index": 0}},
                   logs[0])]  # fmt: skip
    procs += [spawn(folder, "worker", i, {"cluster": cluster,
                                          "task": {"type": "worker", "index": i}}, logs[i + 1])
              for i in range(w)]  # fmt: skip
    try:
        os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                              "task": {"type": "chief", "index": 0}})  # fmt: skip
        os.environ["GRPC_FAIL_FAST"] = "use_caller"
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        share = _terms(batches[0]) // w
        with strategy.scope():
            trainer = Trainer(job, params, share)  # a worker's share's mean loss ...
            trainer.scale = 1.0 / w  # ... and its gradient scaled by 1/W, as refdl's async

            trainer.set_lr(job["lrs"][0])  # constant (refdl checks before launching)

        def replica(x, y):
            read = tf.timestamp()
            loss = trainer.replica_step(x, y)
            with tf.control_dependencies([loss]):
                applied = tf.timestamp()
            return loss, read, applied

        @tf.function
        def update(x, y):
            return strategy.run(replica, args=(x, y))

        t0 = time.perf_counter()
        remote = []
        for batch in batches:
            for x, y in _shards(batch, w):
                remote.append(coordinator.schedule(update, args=(tf.constant(x), tf.constant(y))))
        coordinator.join()
        wall = time.perf_counter() - t0
        values = [r.fetch() for r in remote]
        result = {
            "update_losses": [float(v[0]) for v in values],
            "updates": [[float(v[1]), float(v[2])] for v in values],
            "wall_s": wall,
            "impl": f"ParameterServerStrategy (1 ps, {w} workers, ClusterCoordinator)",
        }
        return result, export(trainer.model, job["layers"]), {}
    finally:
        for proc in procs:
            proc.kill()


def server_process(folder: Path, role: str, index: int) -> None:
    """A ps or worker task of ``train_ps``: a gRPC server that serves until killed."""
    tf = _tf()
    config = json.loads(os.environ["TF_CONFIG"])
    server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name=role,
                                  task_index=index, protocol="grpc", start=True)  # fmt: skip
    server.join()
