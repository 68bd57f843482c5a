"""A new strategy written in user code: local SGD (periodic model averaging), registered
by name, checked against its serial oracle and, with period 1, against ``data``.

    .venv/bin/python examples/local_sgd.py

Each of P workers keeps a replica and takes optimizer steps on its share of the
global batch; every ``PERIOD`` steps the replicas are averaged (Stich, "Local SGD
converges fast and communicates little", ICLR 2019). A strategy is placement and
communication only: the model, loss, optimizer and data order come from refdl.
"""

from __future__ import annotations

from refdl.parallel.processes import simulate_devices

simulate_devices(8)  # before JAX starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import refdl  # noqa: E402
from refdl.core.state import to_host  # noqa: E402


@refdl.register_strategy("localsgd")
class LocalSGD(refdl.Strategy):
    """Replicas on the ``data`` axis (one per device), averaged every ``period`` steps."""

    period = 2  # steps between averagings
    traits = refdl.Traits(axes=("data",), options=frozenset({"mesh"}), batch_stats=False)

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.n = plan.mesh.data
        self.sharding = NamedSharding(plan.mesh.make(devices), P("data"))

        def local(state, batch):  # one replica (leading axis of 1) and its share
            state = jax.tree.map(lambda x: x[0], state)
            loss, grads, model_state = task.accumulated_grads(
                state.params, state.model_state, batch, plan.microbatches
            )
            new = task.apply_gradients(state, grads, model_state)
            average = new.step % self.period == 0  # communicate every `period` steps
            mean = jax.lax.pmean(new.params, "data")
            params = jax.tree.map(lambda m, x: jnp.where(average, m, x), mean, new.params)
            return jax.tree.map(lambda x: x[None], new.replace(params=params)), loss[None]

        mesh = self.sharding.mesh
        step = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        self._step = jax.jit(step, donate_argnums=0)

    def host_template(self, seed):  # the replicas, stacked on a leading axis
        one = to_host(self.task.init_state(seed))
        return jax.tree.map(lambda x: np.stack([x] * self.n), one)

    def place_state(self, host_state):
        return jax.device_put(host_state, self.sharding)

    def train_step(self, state, batch):
        state, loss = self._step(state, jax.device_put(batch, self.sharding))
        return state, {"loss": loss}

    def eval_state(self, host_state):  # the evaluated model is the replicas' average
        return jax.tree.map(lambda x: x.mean(0) if x.dtype.kind == "f" else x[0], host_state)

    def gather_params(self, state):
        return self.eval_state(to_host(state)).params


@refdl.register_strategy("localsgd1")
class EveryStep(LocalSGD):
    """Local SGD that averages after every step."""

    period = 1


def oracle(spec: refdl.RunSpec, steps: int, period: int):
    """The same algorithm, serially on one device: every replica in turn, then a plain
    average every ``period`` steps."""
    run = refdl.build(refdl.RunSpec(**{**spec.__dict__, "strategy": "single", "devices": 1}))
    task, n = run.task, spec.devices
    replicas = [task.init_state(spec.seed) for _ in range(n)]
    step = jax.jit(lambda s, b: task.step(s, b))
    for t in range(steps):
        batch = run.batch(t)
        share = len(batch["x"]) // n
        replicas = [step(r, {k: v[i * share:(i + 1) * share] for k, v in batch.items()})[0]
                    for i, r in enumerate(replicas)]  # fmt: skip
        if (t + 1) % period == 0:
            mean = jax.tree.map(lambda *xs: sum(xs) / n, *[r.params for r in replicas])
            replicas = [r.replace(params=mean) for r in replicas]
    return jax.tree.map(lambda *xs: sum(xs) / n, *[r.params for r in replicas])


def main() -> None:
    spec = refdl.RunSpec(strategy="localsgd", devices=4, model="mlp", batch_size=32,
                         progress=False)  # fmt: skip
    got = refdl.run_steps(spec, 6)
    diff = refdl.compare(oracle(spec, 6, LocalSGD.period), got.params)
    print(f"local SGD, 4 workers, period {LocalSGD.period}, 6 steps, against the serial oracle: "
          f"{diff}")  # fmt: skip
    assert diff.max_abs < 1e-6
    wrong = refdl.compare(oracle(spec, 6, 3), got.params)
    print(f"the same check against an oracle with the wrong period (3) fails: {wrong}")
    assert wrong.max_abs > 1e-4  # the check can fail
    # Averaging after every plain-SGD step is averaging the gradients: data parallelism.
    sgd = refdl.RunSpec(**{**spec.__dict__, "optimizer": "sgd", "strategy": "localsgd1"})
    data = refdl.RunSpec(**{**sgd.__dict__, "strategy": "data"})
    diff = refdl.assert_equivalent(sgd, 4, reference=data, rtol=1e-5, atol=1e-6)
    print(f"local SGD with period 1 and plain SGD equals data parallelism: {diff}")
    final = {**spec.__dict__, "steps": 150, "eval_every": 0, "overwrite": True}  # rerunnable
    summary = refdl.fit(refdl.RunSpec(**final), out="runs/localsgd")
    print(f"local SGD, 150 steps: test accuracy {summary['test_accuracy']:.3f}")
    assert summary["test_accuracy"] > 0.9


if __name__ == "__main__":
    main()
