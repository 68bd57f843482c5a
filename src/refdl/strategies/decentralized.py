"""``decentralized``: every worker keeps a replica and averages with its graph neighbours.

Each step worker i takes a local optimizer step on its share of the global batch
and mixes parameters with its neighbours through a doubly stochastic ``W``
(Metropolis weights of ``--topology``; ``refdl.comm.topology``):

- ``--order atc`` (adapt-then-combine, default): ``x_i <- sum_j W_ij (x_j - eta g_j(x_j))``;
- ``--order cta`` (combine-then-adapt, Lian et al. 2017's D-PSGD):
  ``x_i <- sum_j W_ij x_j - eta g_i(x_i)``, the gradient taken at the local,
  un-mixed replica, so computing it can overlap the exchange;
- ``--gossip``: randomized pairwise gossip (Boyd et al. 2006): each step one
  random matching of the graph's edges, matched pairs average, the rest keep
  their replica - the inconsistent, cheaper variant.

Three executors of the same algorithm: one process with a replica per device
(``shard_map``, one ``ppermute`` per neighbour shift), ``--simulate`` (all
replicas on one device, dense ``W`` - the serial oracle), and one replica per
rank under ``mpirun`` (mpi4jax send/receive with neighbours inside ``jit``).
Optimizer state stays local; BatchNorm statistics stay local. The evaluated
model is the replicas' average. ``consensus_distance`` is
``(1/n) sum_i ||x_i - x_bar||^2`` over all parameters.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm import topology
from refdl.config.mesh import MeshSpec
from refdl.config.plan import Traits
from refdl.config.spec import straggler_of
from refdl.core.layers import param_count
from refdl.core.state import TrainState, to_host
from refdl.data.order import worker_share
from refdl.parallel.processes import comm, data_comm, launched_rank
from refdl.strategies.base import Batch, History, Strategy, last, register


def stack(tree: Any, n: int) -> Any:
    """n copies of every leaf along a new leading axis (the replica axis)."""
    return jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tree)


def replica_mean(tree: Any) -> Any:
    """The average over the replica axis (float leaves; others take replica 0)."""
    return jax.tree.map(
        lambda x: (
            np.mean(x, 0, dtype=np.float64).astype(x.dtype)
            if np.issubdtype(x.dtype, np.floating)
            else x[0]
        ),
        tree,
    )


@register("decentralized")
class Decentralized(Strategy):
    """Neighbour averaging over a graph; synchronous steps, no central state."""

    traits = Traits(
        options=frozenset({"topology", "order", "gossip", "simulate", "workers", "straggler"}),
        multiprocess="mpi",
        workers=True,
    )

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.mode = {"mpi": "mpi", "simulate": "serial", "spmd": "spmd"}[plan.mode]
        self.n = plan.workers
        self.rank = launched_rank() if self.mode == "mpi" else 0
        self.adj = topology.adjacency(spec.topology, self.n)
        self.w = topology.metropolis(self.adj)
        self.shifts = topology.shifts(self.adj)
        self.matchings = topology.matchings(self.adj)
        self.straggler = straggler_of(spec.straggler)
        self.n_params = param_count(task.model.abstract_params(task.sample_x))
        if self.mode == "spmd":
            self.mesh = MeshSpec(data=self.n).make(devices)
            self.sharding = NamedSharding(self.mesh, P("data"))
        build = {"spmd": self._spmd_fn, "serial": self._serial_fn, "mpi": self._mpi_fn}[self.mode]
        matchings = range(len(self.matchings)) if spec.gossip else [None]
        self._fns = {m: build(m) for m in matchings}  # jitted; each compiles on its first call

    # ----- state: replicas stacked on a leading axis (one per rank under MPI) -----

    def host_template(self, seed: int) -> TrainState:
        return stack(to_host(self.task.init_state(seed)), self.n)

    def place_state(self, host_state: TrainState) -> TrainState:
        if self.mode == "mpi":
            return jax.device_put(jax.tree.map(lambda x: x[self.rank], host_state))
        if self.mode == "serial":
            return jax.device_put(host_state, self.devices[0])
        return jax.device_put(host_state, self.sharding)

    def gather_state(self, state: TrainState) -> TrainState:
        if self.mode != "mpi":
            return to_host(state)
        local = to_host(state)
        parts = comm().gather(local, root=0)
        if self.rank != 0:
            return stack(local, self.n)  # not used: only rank 0 writes and evaluates
        return jax.tree.map(lambda *xs: np.stack(xs), *parts)

    def eval_state(self, host_state: TrainState) -> TrainState:
        return replica_mean(host_state)

    # ----- one step -----

    def _local(self, state: TrainState, batch: Batch) -> tuple[Any, Any, TrainState]:
        """One replica's loss, gradient and new model state on its share of the batch."""
        loss, grads, model_state = self.task.accumulated_grads(
            state.params, state.model_state, batch, self.plan.microbatches
        )
        return loss, grads, model_state

    def _step_with(self, mix, state: TrainState, batch: Batch):
        """The algorithm for one replica; ``mix`` averages a parameter tree with neighbours."""
        loss, grads, model_state = self._local(state, batch)
        if self.spec.order == "cta":
            mixed = state.replace(params=mix(state.params))
            return self.task.apply_gradients(mixed, grads, model_state), loss
        new = self.task.apply_gradients(state, grads, model_state)
        return new.replace(params=mix(new.params)), loss

    def _spmd_fn(self, matching: int | None):
        """shard_map step: each device one replica, one ppermute per shift (or matching)."""
        n, w = self.n, jnp.asarray(self.w, jnp.float32)

        def mix(params):
            i = jax.lax.axis_index("data")
            if matching is not None:
                partner = self.matchings[matching]
                pairs = [(j, p) for j, p in enumerate(partner) if p >= 0]
                has = jnp.asarray([p >= 0 for p in partner])[i]
                recv = jax.lax.ppermute(params, "data", pairs)
                return jax.tree.map(lambda x, r: jnp.where(has, 0.5 * (x + r), x), params, recv)
            out = jax.tree.map(lambda x: w[i, i] * x, params)
            for s in self.shifts:
                pairs = [(j, (j + s) % n) for j in range(n) if self.adj[(j + s) % n, j]]
                recv = jax.lax.ppermute(params, "data", pairs)
                coef = w[i, (i - s) % n]
                out = jax.tree.map(lambda o, r, c=coef: o + c * r, out, recv)
            return out

        def local(state, batch):
            state = jax.tree.map(lambda x: x[0], state)
            new, loss = self._step_with(mix, state, batch)
            return jax.tree.map(lambda x: x[None], new), loss[None]

        fn = jax.shard_map(
            local, mesh=self.mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data"))
        )
        return self.jit(fn, donate_argnums=0)

    def _serial_fn(self, matching: int | None):
        """The oracle: every replica on one device, ``vmap`` over replicas, dense W."""
        n = self.n
        if matching is None:
            w = self.w
        else:
            w = np.eye(n)
            for i, p in enumerate(self.matchings[matching]):
                if p >= 0:
                    w[i, i], w[i, p] = 0.5, 0.5
        w = jnp.asarray(w, jnp.float32)

        def step(state, batch):
            shares = jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), batch)
            loss, grads, model_state = jax.vmap(self._local)(state, shares)

            def mix(params):
                return jax.tree.map(lambda x: jnp.einsum("ij,j...->i...", w, x), params)

            if self.spec.order == "cta":
                mixed = state.replace(params=mix(state.params))
                new = jax.vmap(self.task.apply_gradients)(mixed, grads, model_state)
            else:
                new = jax.vmap(self.task.apply_gradients)(state, grads, model_state)
                new = new.replace(params=mix(new.params))
            return new, loss

        return self.jit(step, donate_argnums=0)

    def _mpi_fn(self, matching: int | None):
        """One rank's step: its replica, mpi4jax send/receive with neighbours inside jit."""
        import mpi4jax  # only under mpirun: mpi4py starts MPI when imported

        comm, n, r, w = data_comm(), self.n, self.rank, self.w

        def mix(params):
            flat, unravel = ravel_pytree(params)
            if matching is not None:
                p = self.matchings[matching][r]
                if p < 0:
                    return params
                recv = mpi4jax.sendrecv(flat, flat, source=p, dest=p, comm=comm)
                return unravel(0.5 * (flat + recv))
            out = float(w[r, r]) * flat
            for s in self.shifts:
                dest, src = (r + s) % n, (r - s) % n
                send, recv = bool(self.adj[dest, r]), bool(self.adj[r, src])
                if send and recv:
                    got = mpi4jax.sendrecv(flat, flat, source=src, dest=dest, comm=comm)
                elif send:
                    mpi4jax.send(flat, dest, comm=comm)
                    continue
                elif recv:
                    got = mpi4jax.recv(flat, src, comm=comm)
                else:
                    continue
                out = out + float(w[r, src]) * got
            return unravel(out)

        def step(state, batch):
            new, loss = self._step_with(mix, state, batch)
            mean_loss = mpi4jax.allreduce(loss, op=_mpi_sum(), comm=comm) / n
            return new, mean_loss

        return self.jit(step, donate_argnums=0)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        step = int(np.asarray(jax.device_get(state.step)).reshape(-1)[0])
        matching = None
        if self.spec.gossip:
            matching = topology.gossip_matching(self.spec.seed, step, len(self.matchings))
        if self.mode == "mpi":
            if self.straggler and self.straggler[0] == self.rank:
                time.sleep(self.straggler[1])
            batch = worker_share(batch, self.rank, self.n)
        elif self.mode == "spmd":
            batch = jax.device_put(batch, self.sharding)
        state, loss = self._fns[matching](state, batch)
        if self.serialize_steps or self.mode == "mpi":
            jax.block_until_ready(state)  # simulated devices; MPI ranks wait in their messages
        return state, {"loss": loss, "comm_bytes": self._comm_bytes(matching)}

    def _comm_bytes(self, matching: int | None) -> int:
        """Bytes all workers send in one step: each sends its fp32 replica to each neighbour."""
        if matching is not None:
            messages = sum(p >= 0 for p in self.matchings[matching])
        else:
            messages = int(self.adj.sum())
        return 4 * self.n_params * messages

    # ----- metrics and summary -----

    def extra_metrics(self, state: TrainState) -> dict[str, Any]:
        """``consensus_distance``: (1/n) sum_i ||x_i - x_bar||^2 over all parameters."""
        if self.mode == "mpi":
            flat = np.asarray(ravel_pytree(to_host(state.params))[0], np.float64)
            world = comm()
            total = np.zeros_like(flat)
            world.Allreduce(flat, total)
            mine = float(np.sum((flat - total / self.n) ** 2))
            value = world.allreduce(mine) / self.n
        else:
            value = float(_consensus(state.params))
        return {"consensus_distance": value}

    def summary(self, history: History) -> dict[str, Any]:
        return {
            "workers": self.n,
            "executor": self.mode,
            "topology": self.spec.topology,
            "order": self.spec.order,
            "gossip": self.spec.gossip,
            "degree_mean": float(self.adj.sum(1).mean()),
            "spectral_gap": topology.spectral_gap(self.w),
            "mixing_matrix": self.w.round(6).tolist() if self.n <= 16 else None,
            "consensus_distance": last(history, "consensus_distance"),
            "comm_bytes_per_step": self._comm_bytes(None) if not self.spec.gossip else None,
            "comm_bytes_per_step_analytic": self._comm_bytes(None),
        }


@jax.jit
def _consensus(params: Any) -> jax.Array:
    """(1/n) sum_i ||x_i - x_bar||^2 for replicas stacked on axis 0."""
    leaves = jax.tree.leaves(params)
    n = leaves[0].shape[0]
    return sum(jnp.sum((x - jnp.mean(x, 0, keepdims=True)) ** 2) for x in leaves) / n


@functools.lru_cache(maxsize=1)
def _mpi_sum():
    from mpi4py import MPI

    return MPI.SUM
