"""The parameter server across ``mpirun`` ranks: server and worker event loops, with
mpi4jax messages inside ``jax.jit``.

Server ``s`` (rank ``s < K``) holds its shard and optimizer state. Sync: it
receives every worker's gradient in worker order, averages, updates and replies
to all. Async / SSP: it applies each gradient as it arrives (any source) and
replies to that worker as soon as SSP allows (``ssp.release_allowed``),
recording the arrival order. A worker (rank ``>= K``) pulls the shards once,
then per clock computes its share's gradient, pushes each shard's part to its
server and pulls the new shard back (one ``sendrecv`` per server). Hierarchical: an
aggregator (ranks ``1..G``) sums its group's gradients in worker order, pushes the sum
to the server and passes the reply on; to a worker it is its server.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
from mpi4py import MPI

from refdl.core.state import TrainState, to_host
from refdl.parallel.processes import data_comm
from refdl.strategies.ps.ssp import TRAILER, release_allowed, softsync_closes, softsync_scale

GRAD, PARAMS, INIT, GATHER, STOP = 11, 12, 13, 14, 15


class Server:
    """One server rank's shard, optimizer state and event loop (mpi4jax inside jit)."""

    def __init__(self, ps: Any) -> None:
        self.ps, self.MPI = ps, MPI
        self.comm = data_comm()
        self.s = ps.rank
        self.status = MPI.Status()
        self.state = None
        self.trace: list[tuple[int, int, int]] = []
        self.applied = 0
        self.version = 0
        self._fns: dict[Any, Any] = {}

    def start(self, state: TrainState) -> None:
        """Take this server's shard of ``state`` and send it to every worker."""
        ps = self.ps
        self.state = state
        self.acc = None  # softsync's running sum of the update being gathered
        self.leaves = ps.layout.split(state.params)[self.s]
        self.opt = state.opt_state[self.s]
        self.start_step = int(np.asarray(state.step))
        self.completed = [self.start_step] * ps.w
        self.waiting: list[int] = []
        self.read = [0] * ps.w
        flat = ps.layout.flat(self.leaves)
        for child in ps.children():  # once per run: eager is fine
            mpi4jax.send(flat, child, tag=INIT, comm=self.comm)

    def _sync_fn(self):
        """Receive every worker's gradient in worker order (hierarchical: every aggregator's
        sum, with its group's mean loss), average, update, reply to all."""
        ps, comm, s = self.ps, self.comm, self.s
        size = ps.layout.group_sizes[s] + TRAILER

        def round_(leaves, opt):
            acc, losses = jnp.zeros(size - TRAILER, jnp.float32), []
            for child in ps.children():
                msg = mpi4jax.recv(jnp.zeros(size), child, tag=GRAD, comm=comm)
                acc, losses = acc + msg[:-TRAILER], [*losses, msg[-TRAILER]]
            leaves, opt = ps.update_shard(leaves, opt, ps.layout.unflat(acc, s), 1.0 / ps.w)
            flat = ps.layout.flat(leaves)
            for child in ps.children():
                mpi4jax.send(flat, child, tag=PARAMS, comm=comm)
            return leaves, opt, jnp.stack(losses)

        return ps.jit(round_)

    def _async_fn(self):
        """Receive one gradient from any worker (source in ``self.status``) and apply it.

        The update is ``ParameterServer.update``, the very compiled function the simulator
        runs, so a replay of the recorded arrival order reproduces the run bit for bit
        (asynchronous runs amplify even one-ulp differences)."""
        ps = self.ps
        receive, unpack = self._receive_any()
        pack = jax.jit(ps.layout.flat)

        def apply_one(leaves, opt):
            msg = receive()
            leaves, opt = ps.update(leaves, opt, unpack(msg), 1.0 / ps.w)
            return leaves, opt, pack(leaves), msg[-TRAILER], msg[-1]

        return apply_one

    def _receive_any(self):
        """Compiled: receive one gradient message from any worker (its source then in
        ``self.status``), and unpack a message into this server's shard."""
        ps, comm, s = self.ps, self.comm, self.s
        size = ps.layout.group_sizes[s] + TRAILER
        receive = jax.jit(
            lambda: mpi4jax.recv(
                jnp.zeros(size), self.MPI.ANY_SOURCE, tag=GRAD, comm=comm, status=self.status
            )
        )
        unpack = jax.jit(lambda msg: ps.layout.unflat(msg[:-TRAILER], s))
        return receive, unpack

    def _softsync_one(self, losses: list[float]) -> None:
        """One arrival; on every c-th, the update and the replies to its contributors."""
        ps = self.ps
        if "softsync" not in self._fns:  # adds with ParameterServer.accumulate, as simulated
            self._fns["softsync"] = self._receive_any()
        receive, unpack = self._fns["softsync"]
        if self.acc is None:
            self.acc, self.chunk = [jnp.zeros_like(x) for x in self.leaves], []
        msg = receive()
        losses.append(float(msg[-TRAILER]))  # waits for the receive: then status is set
        w = self.status.Get_source() - ps.k
        scale = jnp.float32(softsync_scale(ps.per_update, self.version - self.read[w]))
        self.acc = ps.accumulate(self.acc, unpack(msg), scale)
        self.trace.append((w, int(msg[-1]), self.read[w]))
        self.applied += 1
        self.completed[w] += 1
        self.chunk.append(w)
        if softsync_closes(self.chunk, ps.per_update, self.completed, ps.spec.steps):
            self.leaves, self.opt = ps.update(self.leaves, self.opt, self.acc, 1.0)
            self.version += 1
            flat = ps.layout.flat(self.leaves)
            for v in self.chunk:
                self.read[v] = self.version
                self._send_fn(ps.k + v)(flat)
            self.acc = None

    def _send_fn(self, dest: int):
        """A compiled send of this shard's parameters to ``dest`` (eager mpi4jax calls
        recompile every time)."""
        key = ("send", dest)
        if key not in self._fns:
            self._fns[key] = jax.jit(
                lambda flat: mpi4jax.send(flat, dest, tag=PARAMS, comm=self.comm)
            )
        return self._fns[key]

    def _fn(self, name: str):
        if name not in self._fns:
            self._fns[name] = {"sync": self._sync_fn, "async": self._async_fn}[name]()
        return self._fns[name]

    def pump(self, until: int, watchdog: Any = None) -> list[float]:
        """Handle messages until ``until`` gradients are applied (or STOP); the losses."""

        ps, losses = self.ps, []
        while self.applied < until:
            self.comm.Probe(source=self.MPI.ANY_SOURCE, tag=self.MPI.ANY_TAG, status=self.status)
            tag = self.status.Get_tag()
            if tag == GATHER:
                self.comm.recv(source=0, tag=GATHER)
                self.comm.send((to_host(self.leaves), to_host(self.opt)), dest=0, tag=GATHER)
                continue
            if tag == STOP:
                self.comm.recv(source=0, tag=STOP)
                return losses
            if ps.spec.ps_mode == "softsync":
                self._softsync_one(losses)
            elif ps.synchronous:
                self.leaves, self.opt, ls = self._fn("sync")(self.leaves, self.opt)
                losses.extend(np.asarray(ls).tolist())
                self.applied += ps.w
                self.version += 1
            else:
                self.leaves, self.opt, flat, loss, clock = self._fn("async")(self.leaves, self.opt)
                losses.append(float(loss))  # waits for the receive: only then is status set
                w = self.status.Get_source() - ps.k
                self.trace.append((w, int(clock), self.read[w]))
                self.applied += 1
                self.version += 1
                self.completed[w] += 1
                self.waiting.append(w)  # every push waits for its reply, the last one too
                for v in sorted(self.waiting):
                    if release_allowed(self.completed[v], self.completed, ps.spec.steps, ps.bound):
                        self.waiting.remove(v)
                        self.read[v] = self.version
                        self._send_fn(ps.k + v)(flat)
            if watchdog is not None:
                watchdog.beat()
        return losses

    def serve_forever(self, watchdog: Any = None) -> None:
        """Servers 1..K-1: apply gradients and answer gathers until server 0 says STOP."""
        self.pump(float("inf"), watchdog)


class Aggregator:
    """A learner group's aggregator (hierarchical): its workers' server, the server's
    worker."""

    def __init__(self, ps: Any) -> None:
        self.ps = ps
        self.members = ps.members(ps.rank - ps.k)

    def run(self, state: TrainState, start: int, watchdog: Any = None) -> None:
        """Pass the initial parameters on, then per clock: sum the group's gradients in
        worker order, push the sum (with the group's mean loss) up, pass the reply down."""
        ps, comm = self.ps, data_comm()
        size = ps.layout.group_sizes[0]
        flat = mpi4jax.recv(jnp.zeros(size), 0, tag=INIT, comm=comm)
        for m in self.members:
            mpi4jax.send(flat, m, tag=INIT, comm=comm)

        def round_(flat):
            acc, loss, clock = jnp.zeros(size, jnp.float32), jnp.float32(0), jnp.float32(0)
            for m in self.members:
                msg = mpi4jax.recv(jnp.zeros(size + TRAILER), m, tag=GRAD, comm=comm)
                acc, loss, clock = acc + msg[:-TRAILER], loss + msg[-TRAILER], msg[-1]
            up = jnp.concatenate([acc, jnp.stack([loss / len(self.members), clock])])
            flat = mpi4jax.sendrecv(up, flat, source=0, dest=0, sendtag=GRAD, recvtag=PARAMS,
                                    comm=comm)  # fmt: skip
            for m in self.members:
                mpi4jax.send(flat, m, tag=PARAMS, comm=comm)
            return flat

        round_ = jax.jit(round_)
        for _ in range(start, ps.spec.steps):
            flat = round_(flat)
            jax.block_until_ready(flat)
            if watchdog is not None:
                watchdog.beat()


class Worker:
    """One worker rank: pull the shards, then per clock compute, push, pull."""

    def __init__(self, ps: Any) -> None:
        self.ps = ps
        self.w = ps.rank - ps.k - ps.g

    def _step_fn(self):
        ps, comm = self.ps, data_comm()

        def exchange(params, grads, loss, clock):
            gsplit, psplit = ps.layout.split(grads), ps.layout.split(params)
            new = []
            for s in range(ps.k):
                msg = jnp.concatenate([ps.layout.flat(gsplit[s]), jnp.stack([loss, clock])])
                peer = ps.parent(self.w, s)
                got = mpi4jax.sendrecv(
                    msg,
                    ps.layout.flat(psplit[s]),
                    source=peer,
                    dest=peer,
                    sendtag=GRAD,
                    recvtag=PARAMS,
                    comm=comm,
                )
                new.append(ps.layout.unflat(got, s))
            return ps.layout.join(new)

        exchange = jax.jit(exchange)

        def step(params, batch, clock):
            # The gradient is ParameterServer.grads, the simulator's own compiled function
            # (bit-identical replays); the messages to every server go in one call.
            loss, grads = ps.grads(params, batch)
            return exchange(params, grads, loss, clock)

        return step

    def run(self, state: TrainState, start: int, watchdog: Any = None) -> None:
        """Pull the initial shards, then ``clock`` = ``start``.. ``steps - 1``: compute the
        gradient of this worker's share, push it, pull the new parameters."""
        ps, comm = self.ps, data_comm()
        psplit = ps.layout.split(state.params)
        groups = []
        for s in range(ps.k):
            got = mpi4jax.recv(ps.layout.flat(psplit[s]), ps.parent(self.w, s), tag=INIT,
                               comm=comm)  # fmt: skip
            groups.append(ps.layout.unflat(got, s))
        params = ps.layout.join(groups)
        step = self._step_fn()
        delay = ps.straggler.seconds if ps.straggler and ps.straggler.rank == ps.rank else 0.0
        for clock in range(start, ps.spec.steps):
            if delay:
                time.sleep(delay)
            batch = ps.share(clock, self.w)
            params = step(params, batch, jnp.float32(clock))
            jax.block_until_ready(params)
            if watchdog is not None:
                watchdog.beat()
