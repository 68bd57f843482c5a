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
  their replica - the inconsistent, cheaper variant;
- ``--allreduce sparse --compress topk:RATIO[,q8|q4]``: compressed gossip, CHOCO-SGD
  (Koloskova et al., ICML'19) with SparCML's messages. Worker i keeps a public copy
  ``xh_i`` of its replica, which every neighbour can rebuild, and ``s_i = sum_j W_ij xh_j``;
  it sends only ``q_i``, the top-k of ``x_i - xh_i`` as (index, value) pairs (values
  optionally quantized by stochastic rounding), then ``xh_i += q_i``,
  ``s_i += sum_j W_ij q_j`` and ``x_i += gamma (s_i - xh_i)`` (``--consensus-step``).
  All ``xh`` start at the common initial replica. With ``topk:1`` and ``gamma`` 1 it is
  the exact mixing above.

Three executors of the same replica step and the same mixing (``Decentralized.mix``,
written once against an ``Exchange``): one process with a replica per device
(``shard_map``, one ``ppermute`` per neighbour shift), ``--simulate`` (all
replicas on one device: the same step under ``jax.vmap`` over the replica axis),
and one replica per rank under ``mpirun`` (mpi4jax send/receive with neighbours
inside ``jit``). The tests hold a dense-``W`` oracle of the mixing.
Optimizer state stays local; BatchNorm statistics stay local. The evaluated
model is the replicas' average. ``consensus_distance`` is
``(1/n) sum_i ||x_i - x_bar||^2`` over all parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm import topology
from refdl.comm.compress import make_codec
from refdl.comm.measure import collective_bytes
from refdl.config.mesh import MeshSpec
from refdl.config.plan import Plan, Traits
from refdl.config.spec import RunSpec
from refdl.core.layers import param_count
from refdl.core.state import TrainState, place, to_host
from refdl.data.order import worker_share
from refdl.errors import UsageError
from refdl.parallel.processes import comm, data_comm, launched_rank
from refdl.strategies.base import Batch, FirstCall, History, Strategy, last, register

AXIS = "data"  # the replica axis: devices under shard_map, replicas under vmap
DEFAULT_CONSENSUS_STEP = 0.1  # CHOCO's gamma: chosen on mlp, ring of 4 (docs/strategies.md)


class Exchange(Protocol):
    """How replicas send each other a tree (``Decentralized.mix`` is written against it)."""

    def index(self) -> Any: ...

    def __call__(self, tree: Any, pairs: list[tuple[int, int]]) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Collective:
    """Replicas on the ``AXIS`` of a ``shard_map`` or a ``vmap``: ``ppermute``. Under vmap
    (``whole``) JAX takes only whole permutations, so the pairs are completed to a cyclic
    one and what the missing pairs carry is dropped."""

    n: int
    whole: bool = False

    def index(self) -> Any:
        return jax.lax.axis_index(AXIS)

    def __call__(self, tree: Any, pairs: list[tuple[int, int]]) -> Any:
        if not self.whole:
            return jax.lax.ppermute(tree, AXIS, pairs)
        perm = complete(pairs, self.n)
        got = jnp.asarray([any(d == j for _, d in pairs) for j in range(self.n)])[self.index()]
        recv = jax.lax.ppermute(tree, AXIS, perm)
        return jax.tree.map(lambda r: jnp.where(got, r, jnp.zeros_like(r)), recv)


@dataclasses.dataclass(frozen=True)
class Messages:
    """One replica per MPI rank: mpi4jax send/receive of the flattened tree, only along
    ``pairs`` (a rank that receives nothing gets zeros)."""

    comm: Any
    rank: int

    def index(self) -> int:
        return self.rank

    def __call__(self, tree: Any, pairs: list[tuple[int, int]]) -> Any:
        dest = next((d for s, d in pairs if s == self.rank), None)
        src = next((s for s, d in pairs if d == self.rank), None)
        if len({x.dtype for x in jax.tree.leaves(tree)}) > 1:  # a message: a send per leaf
            return jax.tree.map(lambda x: self._one(x, src, dest), tree)
        flat, unravel = ravel_pytree(tree)
        return unravel(self._one(flat, src, dest))

    def _one(self, x: Any, src: int | None, dest: int | None) -> Any:
        import mpi4jax

        if dest is not None and src is not None:
            return mpi4jax.sendrecv(x, x, source=src, dest=dest, comm=self.comm)
        if dest is not None:
            mpi4jax.send(x, dest, comm=self.comm)
        if src is not None:
            return mpi4jax.recv(x, src, comm=self.comm)
        return jnp.zeros_like(x)


def complete(pairs: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``pairs`` (a partial permutation of ``range(n)``) extended to a whole one.

    >>> complete([(0, 1)], 3)
    [(0, 1), (1, 2), (2, 0)]
    """
    dest = dict(pairs)
    free_src = [j for j in range(n) if j not in dest]
    free_dst = [j for j in range(n) if j not in dest.values()]
    dest.update(zip(free_src, free_dst, strict=True))
    return sorted(dest.items())


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


OPTIONS = ("topology", "order", "gossip", "simulate", "workers", "straggler",
                  "allreduce", "compress", "consensus_step")  # fmt: skip


def check_gossip(spec: RunSpec, plan: Plan) -> None:
    """Neighbours exchange replicas, so the one ``--allreduce`` is ``sparse`` (CHOCO-SGD's
    top-k messages), with a top-k codec and a fixed graph."""
    if spec.allreduce not in ("xla", "sparse"):
        raise UsageError(f"--allreduce {spec.allreduce}: decentralized averages with its "
                         "neighbours, not by an allreduce; --allreduce sparse sends them "
                         "top-k pairs (with --compress topk:RATIO)")  # fmt: skip
    if spec.allreduce != "sparse":
        if spec.compress:
            raise UsageError(f"--compress {spec.compress}: decentralized sends compressed "
                             "replicas as top-k pairs; add --allreduce sparse")  # fmt: skip
        if spec.consensus_step is not None:
            raise UsageError("--consensus-step is CHOCO-SGD's, the compressed gossip; add "
                             "--allreduce sparse --compress topk:RATIO")  # fmt: skip
        return
    if not (spec.compress and spec.compress.topk):
        raise UsageError("--allreduce sparse sends the top-k of each replica's change; add "
                         "--compress topk:RATIO (e.g. topk:0.01 or topk:0.01,q4)")  # fmt: skip
    if spec.gossip:
        raise UsageError("--allreduce sparse keeps each neighbour's public copy over a fixed "
                         "graph; --gossip changes the graph every step: drop one")  # fmt: skip


@register("decentralized")
class Decentralized(Strategy):
    """Neighbour averaging over a graph; synchronous steps, no central state."""

    traits = Traits(
        options=frozenset(OPTIONS),
        multiprocess="mpi",
        replicas=True,
        modes=("spmd", "mpi", "simulate"),
        synchronous=False,
        checks=(check_gossip,),
        cost="gossip",
    )

    kind: str = ""  # the executor, as the summary names it
    rank: int = 0  # this process's replica (under MPI, its rank)

    @classmethod
    def executor(cls, plan: Plan) -> type[Strategy]:
        """Replicas on devices (``spmd``), all in one device's vmap (``--simulate``), or
        one per MPI rank."""
        return {"spmd": OnDevices, "simulate": Serial, "mpi": OnRanks}[plan.mode]

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.n = plan.workers
        self.adj = topology.adjacency(spec.topology, self.n)
        self.w = topology.metropolis(self.adj)
        self.shifts = topology.shifts(self.adj)
        self.matchings = topology.matchings(self.adj)
        self.straggler = spec.straggler
        self.n_params = param_count(task.model.abstract_params(task.sample_x))
        self.sparse = None  # with --allreduce sparse: the messages' top-k and value bits
        if spec.allreduce == "sparse":
            self.sparse = make_codec(spec.compress).sparse(self.n_params, self.n)
            self.gamma = spec.consensus_step or DEFAULT_CONSENSUS_STEP
        matchings = range(len(self.matchings)) if spec.gossip else [None]
        # jitted; each compiles on its first call and keeps that call's shapes
        self._fns = {m: FirstCall(self.step_fn(m)) for m in matchings}

    # ----- state: replicas stacked on a leading axis (one per rank under MPI) -----

    def host_template(self, seed: int) -> TrainState:
        state = to_host(self.task.init_state(seed))
        if self.sparse is not None:  # CHOCO's public copy and its mix, at the start replica
            flat = np.asarray(ravel_pytree(state.params)[0], np.float32)
            state = state.replace(extras={"public": flat, "mixed": flat.copy()})
        return stack(state, self.n)

    def eval_state(self, host_state: TrainState) -> TrainState:
        return replica_mean(host_state)

    # ----- one step -----

    def _local(self, state: TrainState, batch: Batch) -> tuple[Any, Any, TrainState]:
        """One replica's loss, gradient and new model state on its share of the batch."""
        loss, grads, model_state = self.task.accumulated_grads(
            state.params, state.model_state, batch, self.plan.microbatches
        )
        return loss, grads, model_state

    def _step_with(self, exchange, state: TrainState, batch: Batch, matching: int | None):
        """The algorithm for one replica; ``exchange`` moves a tree between replicas."""
        loss, grads, model_state = self._local(state, batch)

        def mix(state: TrainState) -> TrainState:
            if self.sparse is not None:
                return self.compressed_mix(state, exchange=exchange)
            return state.replace(params=self.mix(state.params, exchange=exchange,
                                                 matching=matching))  # fmt: skip

        if self.spec.order == "cta":
            mixed = mix(state)
            return self.task.apply_gradients(mixed, grads, model_state), loss
        return mix(self.task.apply_gradients(state, grads, model_state)), loss

    def mix(
        self, params: Any, *, exchange: Exchange, matching: int | None = None, unpack=None
    ) -> Any:
        """``sum_j W_ij x_j`` for this replica ``i``: W's diagonal times its own parameters
        plus one exchange per neighbour shift; under ``--gossip`` the step's random
        matching instead (matched pairs average, the rest keep theirs). The one mixing of
        every executor: ``exchange(tree, pairs)`` returns, on each replica, the tree sent to
        it along ``pairs`` (zeros where none is), and ``exchange.index`` is this replica.
        ``unpack``: what is sent is a message, and this its value (default: itself)."""
        n, i = self.n, exchange.index()
        unpack = unpack or (lambda tree: tree)
        own = unpack(params)
        dtype = jax.tree.leaves(own)[0].dtype  # the weights in fp32, or fp64 in a proof
        if matching is not None:
            partner = self.matchings[matching]
            pairs = [(j, p) for j, p in enumerate(partner) if p >= 0]
            half = jnp.asarray([0.5 if p >= 0 else 0.0 for p in partner], dtype)[i]
            recv = unpack(exchange(params, pairs))
            return jax.tree.map(lambda x, r: (1 - half) * x + half * r, own, recv)
        w = jnp.asarray(self.w, dtype)
        out = jax.tree.map(lambda x: w[i, i] * x, own)
        for s in self.shifts:
            pairs = [(j, (j + s) % n) for j in range(n) if self.adj[(j + s) % n, j]]
            recv = unpack(exchange(params, pairs))
            out = jax.tree.map(lambda o, r, c=w[i, (i - s) % n]: o + c * r, out, recv)
        return out

    def compressed_mix(self, state: TrainState, *, exchange: Exchange) -> TrainState:
        """CHOCO-SGD's gossip step: send the top-k of ``x_i - xh_i`` to the neighbours,
        add it to ``xh_i`` and the mix of everyone's to ``s_i``, move ``gamma (s_i - xh_i)``.
        The quantizer's key differs per replica and step (stochastic rounding)."""
        flat, unravel = ravel_pytree(state.params)
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        message = self.sparse.pack(flat - state.extras["public"], jax.random.fold_in(
            key, exchange.index()))  # fmt: skip
        public = state.extras["public"] + self.sparse.unpack(message)
        mixed = state.extras["mixed"] + self.mix(
            message, exchange=exchange, unpack=self.sparse.unpack
        )
        return state.replace(
            params=unravel(flat + self.gamma * (mixed - public)),
            extras={"public": public, "mixed": mixed},
        )

    def step_fn(self, matching: int | None) -> Any:
        """The jitted step of every replica this process holds (the executor's)."""
        raise NotImplementedError

    def feed(self, batch: Batch) -> Any:
        """The global batch as this executor's step takes it."""
        return batch

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        step = int(np.asarray(jax.device_get(state.step)).reshape(-1)[0])
        matching = None
        if self.spec.gossip:
            matching = topology.gossip_matching(self.spec.seed, step, len(self.matchings))
        state, loss = self._fns[matching](state, self.feed(batch))
        if self.serialize_steps:
            jax.block_until_ready(state)  # simulated devices; MPI ranks wait in their messages
        return state, {"loss": loss, "comm_bytes": self._comm_bytes(matching)}

    def compiled_steps(self) -> list[Any]:
        """The step programs that ran (this rank's replica under MPI), for their memory."""
        return [c for c in (f.compiled() for f in self._fns.values()) if c is not None]

    def _comm_bytes(self, matching: int | None) -> int:
        """Bytes all workers send in one step: each sends its fp32 replica to each neighbour
        (with ``--allreduce sparse``, its top-k message)."""
        if matching is not None:
            messages = sum(p >= 0 for p in self.matchings[matching])
        else:
            messages = int(self.adj.sum())
        if self.sparse is not None:
            return messages * self.sparse.message_bytes(self.sparse.k)
        return 4 * self.n_params * messages

    def _wire_bytes(self) -> int | None:
        """Bytes the compiled step's collectives move (where one program holds them all)."""
        return None

    # ----- metrics and summary -----

    def extra_metrics(self, state: TrainState) -> dict[str, Any]:
        """``consensus_distance``: (1/n) sum_i ||x_i - x_bar||^2 over all parameters."""
        return {"consensus_distance": float(_consensus(state.params))}

    def summary(self, history: History) -> dict[str, Any]:
        out = {
            "workers": self.n,
            "executor": self.kind,
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
        wire = self._wire_bytes()
        if wire is not None:
            out["comm_bytes_per_step"] = wire
        if self.sparse is not None:
            out["compress"] = str(self.spec.compress)
            out["consensus_step"] = self.gamma
            out["sparse_message"] = {
                "n": self.sparse.n, "k": self.sparse.k, "value_bits": self.sparse.bits,
                "bytes": self.sparse.message_bytes(self.sparse.k),
                "dense_bytes": 4 * self.n_params,
            }  # fmt: skip
        return out


class OnDevices(Decentralized):
    """Each device one replica under ``shard_map``, ``ppermute`` between devices."""

    kind = "spmd"

    def __init__(self, task, spec, plan, devices, batches) -> None:
        self.mesh = MeshSpec(data=plan.workers).make(devices)
        self.sharding = NamedSharding(self.mesh, P(AXIS))
        super().__init__(task, spec, plan, devices, batches)

    def step_fn(self, matching: int | None) -> Any:
        def local(state, batch):
            state = jax.tree.map(lambda x: x[0], state)
            new, loss = self._step_with(Collective(self.n), state, batch, matching)
            return jax.tree.map(lambda x: x[None], new), loss[None]

        spec = P(AXIS)
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(spec, spec), out_specs=(spec, spec))
        return self.jit(fn, donate_argnums=0)

    def place_state(self, host_state: TrainState) -> TrainState:
        return place(host_state, self.sharding)

    def feed(self, batch: Batch) -> Any:
        return jax.device_put(batch, self.sharding)

    def _wire_bytes(self) -> int | None:
        """Bytes the compiled step's ``ppermute``s move (one program, without gossip)."""
        steps = [] if self.spec.gossip else self.compiled_steps()
        return collective_bytes(steps[0].as_text(), self.n).get("total", 0) if steps else None


class Serial(Decentralized):
    """Every replica on one device (``--simulate``): the same replica step under
    ``jax.vmap`` over the replica axis (``ppermute`` works under vmap, on whole
    permutations)."""

    kind = "serial"

    def step_fn(self, matching: int | None) -> Any:
        n = self.n

        def step(state, batch):
            shares = jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), batch)
            one = functools.partial(self._step_with, Collective(n, whole=True), matching=matching)
            return jax.vmap(one, axis_name=AXIS)(state, shares)

        return self.jit(step, donate_argnums=0)

    def place_state(self, host_state: TrainState) -> TrainState:
        return jax.device_put(host_state, self.devices[0])


class OnRanks(Decentralized):
    """One replica per MPI rank: mpi4jax messages with its neighbours inside jit."""

    gathered_checkpoint = True  # one replica per process: gathered to rank 0 to save

    kind = "mpi"

    def __init__(self, task, spec, plan, devices, batches) -> None:
        self.rank = launched_rank()
        super().__init__(task, spec, plan, devices, batches)

    def step_fn(self, matching: int | None) -> Any:
        import mpi4jax  # only under mpirun: mpi4py starts MPI when imported

        comm = data_comm()

        def step(state, batch):
            new, loss = self._step_with(Messages(comm, self.rank), state, batch, matching)
            return new, mpi4jax.allreduce(loss, op=_mpi_sum(), comm=comm) / self.n

        return self.jit(step, donate_argnums=0)

    @property
    def serialize_steps(self) -> bool:
        return True  # a rank waits in its messages

    def place_state(self, host_state: TrainState) -> TrainState:
        return jax.device_put(jax.tree.map(lambda x: x[self.rank], host_state))

    def gather_state(self, state: TrainState) -> TrainState:
        local = to_host(state)
        parts = comm().gather(local, root=0)
        if self.rank != 0:
            return stack(local, self.n)  # not used: only rank 0 writes and evaluates
        return jax.tree.map(lambda *xs: np.stack(xs), *parts)

    def feed(self, batch: Batch) -> Any:
        if self.straggler and self.straggler.rank == self.rank:
            time.sleep(self.straggler.seconds)
        return worker_share(batch, self.rank, self.n)

    def extra_metrics(self, state: TrainState) -> dict[str, Any]:
        flat = np.asarray(ravel_pytree(to_host(state.params))[0], np.float64)
        world = comm()
        total = np.zeros_like(flat)
        world.Allreduce(flat, total)
        mine = float(np.sum((flat - total / self.n) ** 2))
        return {"consensus_distance": world.allreduce(mine) / self.n}


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
