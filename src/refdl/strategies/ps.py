"""``ps``: parameter-server training (the survey's centralized architecture).

Ranks ``0..K-1`` are servers holding the parameters, sharded by bytes
(``--servers K``); ranks ``K..N-1`` are workers. A worker computes the gradient
of its share of a global batch at the parameters it last received, pushes each
shard's gradient to its server and pulls the new shard back (one mpi4jax
``sendrecv`` per server, inside ``jit``). Servers apply the optimizer.

- ``--ps-mode sync``: a server waits for every worker's gradient of the step,
  averages them in worker order and applies one update: the trajectory equals
  ``single``/``data``.
- ``--ps-mode async``: a server applies each gradient as it arrives (any source,
  scaled by 1/W, the worker's share of the batch) and returns fresh parameters
  to that worker at once.
- ``--ps-mode ssp --staleness S``: stale-synchronous parallel (Ho et al. 2013):
  as async, but a worker may start clock c only when every worker has
  completed clock c - S; the server holds its reply until then.

Staleness of an applied gradient is recorded in *clocks* - how many clocks the
worker ran ahead of the slowest worker's completed work when it read the
parameters (SSP's bound S applies to it) - and in *updates* - how many updates
the server applied between the read and this one (the async-SGD definition).
Server 0 records the arrival order ``(worker, clock, version read)``; the
in-process simulator (``--simulate``) replays such a trace (``--ps-trace``)
or generates one from a timing model (every worker's step takes 1 s, a
``--straggler`` adds its delay), and is the oracle for the multi-process run.

A "step" of the loop is W gradient applications (one per worker in sync),
i.e. one global batch of samples, so step counts compare with ``single``.
The learning-rate schedule advances once per step. BatchNorm models are refused:
workers would keep unsynchronised batch statistics the server never sees.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from refdl import dist
from refdl.core.layers import param_count
from refdl.core.state import TrainState, to_host
from refdl.data.order import worker_share
from refdl.errors import UsageError
from refdl.spec import straggler_of
from refdl.strategies.base import Batch, Strategy, register

GRAD, PARAMS, INIT, GATHER, STOP = 11, 12, 13, 14, 15
DEFAULT_SIMULATED_WORKERS = 4
TRAILER = 2  # each gradient message ends with (loss, clock)


class Layout:
    """Parameter leaves assigned to K servers, balanced by bytes (largest leaf first to
    the least-loaded server), and each server's leaves packed as one flat fp32 vector."""

    def __init__(self, params: Any, servers: int) -> None:
        leaves, self.treedef = jax.tree.flatten(params)
        self.shapes = [np.shape(x) for x in leaves]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        if servers > len(leaves):
            raise UsageError(
                f"--servers {servers}: the model has only {len(leaves)} parameter arrays to "
                f"shard; use --servers <= {len(leaves)}"
            )
        load = [0] * servers
        self.groups: list[list[int]] = [[] for _ in range(servers)]
        for i in sorted(range(len(leaves)), key=lambda i: (-self.sizes[i], i)):
            s = min(range(servers), key=lambda s: (load[s], s))
            self.groups[s].append(i)
            load[s] += self.sizes[i]
        for g in self.groups:
            g.sort()
        self.group_sizes = [sum(self.sizes[i] for i in g) for g in self.groups]

    def split(self, tree: Any) -> list[list[Any]]:
        leaves = jax.tree.leaves(tree)
        return [[leaves[i] for i in g] for g in self.groups]

    def join(self, groups: list[list[Any]]) -> Any:
        leaves: list[Any] = [None] * len(self.sizes)
        for g, vals in zip(self.groups, groups, strict=True):
            for i, v in zip(g, vals, strict=True):
                leaves[i] = v
        return jax.tree.unflatten(self.treedef, leaves)

    def flat(self, leaves: list[Any]) -> jax.Array:
        return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])

    def unflat(self, vec: jax.Array, s: int) -> list[jax.Array]:
        out, off = [], 0
        for i in self.groups[s]:
            out.append(vec[off : off + self.sizes[i]].reshape(self.shapes[i]))
            off += self.sizes[i]
        return out


def release_allowed(clock: int, completed: list[int], steps: int, bound: float) -> bool:
    """May a worker start ``clock``? Always for the end of the run, else only within
    ``bound`` clocks of the slowest worker's completed count (SSP; async: infinite)."""
    return clock >= steps or clock - min(completed) <= bound


def simulate_trace(
    workers: int, start: int, steps: int, bound: float, step_s: list[float]
) -> list[tuple[int, int, int]]:
    """The arrival order of an async/SSP run under a timing model: ``(worker, clock,
    version read)`` per applied gradient. Worker w's gradient takes ``step_s[w]``;
    ties go to the lower worker index. Deterministic."""
    completed = [start] * workers
    arrive = {w: step_s[w] for w in range(workers)} if start < steps else {}
    read = dict.fromkeys(range(workers), 0)
    waiting: list[int] = []
    trace, version = [], 0
    while arrive:
        w = min(arrive, key=lambda w: (arrive[w], w))
        now = arrive.pop(w)
        trace.append((w, completed[w], read[w]))
        version += 1
        completed[w] += 1
        if completed[w] < steps:
            waiting.append(w)
        for v in sorted(waiting):
            if release_allowed(completed[v], completed, steps, bound):
                waiting.remove(v)
                read[v] = version
                arrive[v] = now + step_s[v]
    return trace


def staleness_of(trace: list[Any], workers: int, start: int) -> tuple[list[int], list[int]]:
    """Per applied gradient: (clock staleness, update staleness), from the arrival order."""
    completed = [start] * workers
    min_at = [start]  # the slowest worker's completed clocks after v updates
    for w, _, _ in trace:
        completed[w] += 1
        min_at.append(min(completed))
    clocks = [int(c) - min_at[v] for _, c, v in trace]
    updates = [i - int(v) for i, (_, _, v) in enumerate(trace)]
    return clocks, updates


def histogram(values: list[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}


@register("ps")
class ParameterServer(Strategy):
    """Servers hold the parameters and the optimizer; workers push gradients, pull parameters."""

    multiprocess = "mpi"

    @classmethod
    def predict_cost(cls, model_cost, hw, batch, workers, opts):
        from refdl.perf import costs

        return costs.ps(model_cost, hw, batch, workers, opts)

    def __init__(self, task, spec, devices) -> None:
        super().__init__(task, spec, devices)
        if spec.mesh or spec.allreduce != "xla" or spec.compress or spec.preset:
            raise UsageError("--mesh, --allreduce, --compress and --preset are not ps options")
        self.k = spec.servers
        if dist.under_mpi():
            size, self.rank = dist.launched_size(), dist.launched_rank()
            if self.k >= size:
                raise UsageError(
                    f"--servers {self.k} leaves no worker among {size} ranks; launch at least "
                    f"{self.k + 1} ranks (mpirun -n {self.k + 1}) or lower --servers"
                )
            self.w = size - self.k
            self.mode = "mpi"
        elif spec.simulate:
            self.rank, self.w, self.mode = 0, spec.workers or DEFAULT_SIMULATED_WORKERS, "simulate"
        else:
            raise UsageError(
                "--strategy ps needs server and worker ranks: run it under mpirun -n N "
                "(N >= --servers + 1), or simulate it in one process with --simulate"
            )
        if spec.microbatches < 1 or spec.batch_size % (self.w * spec.microbatches):
            raise UsageError(
                f"--batch-size {spec.batch_size} does not split into {self.w} worker shares of "
                f"{spec.microbatches} microbatches; use a multiple of "
                f"{self.w * spec.microbatches}"
            )
        abstract_params, abstract_state = task.model.abstract_variables(jnp.asarray(task.sample_x))
        if jax.tree.leaves(abstract_state):
            raise UsageError(
                f"--strategy ps does not support {spec.model} (BatchNorm statistics would stay "
                "on the workers); use mlp, lenet5, lstm_lm or transformer"
            )
        self.straggler = straggler_of(spec.straggler)
        if self.straggler and not self.k <= self.straggler[0] < self.k + self.w:
            raise UsageError(
                f"--straggler {spec.straggler}: rank {self.straggler[0]} is not a worker "
                f"(workers are ranks {self.k}..{self.k + self.w - 1})"
            )
        if spec.ps_trace and spec.ps_mode == "sync":
            raise UsageError("--ps-trace replays an async or ssp run; add --ps-mode async|ssp")
        self.bound = {"sync": 0, "async": float("inf"), "ssp": spec.staleness}[spec.ps_mode]
        # One lr-schedule step per loop step: async/SSP apply W gradients per step.
        self.opt, _ = spec.make_optimizer(1 if spec.ps_mode == "sync" else self.w)
        self.layout = Layout(abstract_params, self.k)
        self.trace: list[tuple[int, int, int]] = []
        self.trace_start = 0
        self.step_times: list[float] = []
        self.batch_of = None  # set by the loop: step -> global batch
        self._apply = jax.jit(self._apply_group)
        self._grad = jax.jit(self._worker_grads)

    # ----- roles and state -----

    @property
    def role(self) -> str:
        if self.mode == "simulate":
            return "simulator"
        return "server" if self.rank < self.k else "worker"

    @property
    def drives_loop(self) -> bool:
        return self.mode == "simulate" or self.rank == 0

    def host_template(self, seed: int) -> TrainState:
        s = to_host(self.task.init_state(seed))
        groups = self.layout.split(s.params)
        return s.replace(opt_state=tuple(to_host(self.opt.init(g)) for g in groups))

    def init_state(self, seed: int) -> TrainState:
        return self.place_state(self.host_template(seed))

    def place_state(self, host_state: TrainState) -> TrainState:
        self.n_params = param_count(host_state.params)
        return jax.device_put(host_state, self.devices[0])

    # ----- the math shared by every executor -----

    def _apply_group(self, leaves, opt_state, grads, scale):
        """One optimizer update of a server's shard with ``scale * grads``."""
        grads = [g * scale for g in grads]
        updates, opt_state = self.opt.update(grads, opt_state, leaves)
        return [p + u for p, u in zip(leaves, updates, strict=True)], opt_state

    def _worker_grads(self, params, batch):
        loss, grads, _ = self.task.accumulated_grads(params, {}, batch, self.spec.microbatches)
        return loss, grads

    def _share(self, step: int, worker: int) -> Batch:
        return worker_share(self.batch_of(step), worker, self.w)

    # ----- one-process simulator -----

    def _sim_trace(self, start: int) -> list[tuple[int, int, int]]:
        if self.spec.ps_trace:
            return self._load_trace(start)
        step_s = [1.0] * self.w
        if self.straggler:
            step_s[self.straggler[0] - self.k] += self.straggler[1]
        return simulate_trace(self.w, start, self.spec.steps, self.bound, step_s)

    def _load_trace(self, start: int) -> list[tuple[int, int, int]]:
        path = Path(self.spec.ps_trace)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--ps-trace {path}: cannot read it as JSON ({e})") from None
        trace = data.get("ps_trace") if isinstance(data, dict) else data
        if not trace:
            raise UsageError(f"--ps-trace {path}: no ps_trace recorded there (an async/ssp run)")
        if data.get("workers", self.w) != self.w or start != 0:
            raise UsageError(
                f"--ps-trace {path}: recorded with {data.get('workers')} workers from step 0; "
                f"replay it with --workers {data.get('workers')} and no --resume"
            )
        if len(trace) != self.w * self.spec.steps:
            raise UsageError(
                f"--ps-trace {path}: {len(trace)} updates recorded, but --steps "
                f"{self.spec.steps} x {self.w} workers needs {self.w * self.spec.steps}"
            )
        return [tuple(int(v) for v in e) for e in trace]

    def _simulate_step(self, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        step = int(np.asarray(state.step))
        groups = self.layout.split(state.params)
        opt = list(state.opt_state)
        losses = []
        if self.spec.ps_mode == "sync":
            acc = None
            for w in range(self.w):
                loss, grads = self._grad(state.params, self._share(step, w))
                losses.append(loss)
                acc = grads if acc is None else jax.tree.map(jnp.add, acc, grads)
            gsplit = self.layout.split(acc)
            for s in range(self.k):
                groups[s], opt[s] = self._apply(groups[s], opt[s], gsplit[s], 1.0 / self.w)
        else:
            if not self.trace:  # a fresh (or resumed) simulation: the whole arrival order
                self.trace_start = step
                self._events = self._sim_trace(step)
                self._needed = Counter(v for _, _, v in self._events)
                self._snapshots = {0: state.params}
                self._version = 0
            params = state.params
            for w, clock, v in self._events[len(self.trace) : len(self.trace) + self.w]:
                read = self._snapshots[v]
                self._needed[v] -= 1
                if not self._needed[v]:
                    del self._snapshots[v]
                loss, grads = self._grad(read, self._share(clock, w))
                losses.append(loss)
                gsplit = self.layout.split(grads)
                for s in range(self.k):
                    groups[s], opt[s] = self._apply(groups[s], opt[s], gsplit[s], 1.0 / self.w)
                params = self.layout.join(groups)
                self._version += 1
                if self._needed[self._version]:
                    self._snapshots[self._version] = params
                self.trace.append((w, clock, v))
        new = state.replace(
            step=state.step + 1, params=self.layout.join(groups), opt_state=tuple(opt)
        )
        return new, {"loss": jnp.mean(jnp.stack(losses))}

    # ----- MPI executor -----

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        t0 = time.perf_counter()
        step = self._simulate_step if self.mode == "simulate" else self._server_round
        out = step(state)
        jax.block_until_ready(out[0])
        self.step_times.append(time.perf_counter() - t0)
        return out[0], {**out[1], "comm_bytes": self._comm_bytes()}

    def _server(self) -> _Server:
        if not hasattr(self, "_srv"):
            self._srv = _Server(self)
        return self._srv

    def _server_round(self, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        srv = self._server()
        if srv.state is None:
            srv.start(state)
        losses = srv.pump(srv.applied + self.w)
        new = state.replace(
            step=state.step + 1,
            params=self.layout.join([srv.leaves, *self.layout.split(state.params)[1:]]),
            opt_state=(srv.opt, *state.opt_state[1:]),
        )
        self.trace, self.trace_start = srv.trace, srv.start_step
        return new, {"loss": float(np.mean(losses))}

    def serve(self, state: TrainState, start: int, watchdog: Any = None) -> None:
        if self.role == "server":
            srv = self._server()
            srv.start(state)
            srv.serve_forever(watchdog)
        else:
            _Worker(self, state, start).run(watchdog)

    def gather_state(self, state: TrainState) -> TrainState:
        """Server 0 asks servers 1..K-1 for their shards (and optimizer states)."""
        if self.mode == "simulate" or self.k == 1:
            return to_host(state)
        host = to_host(state)
        groups = self.layout.split(host.params)
        opt = list(host.opt_state)
        world = dist.data_comm()
        for s in range(1, self.k):
            world.send(None, dest=s, tag=GATHER)
            groups[s], opt[s] = world.recv(source=s, tag=GATHER)
        return host.replace(params=self.layout.join(groups), opt_state=tuple(opt))

    def finish(self) -> None:
        if self.mode == "mpi" and self.rank == 0:
            for s in range(1, self.k):
                dist.data_comm().send(None, dest=s, tag=STOP)

    # ----- reporting -----

    def _comm_bytes(self) -> int:
        """Bytes sent per step: W gradient pushes (with trailers) and W parameter pulls."""
        return self.w * (8 * self.n_params + 4 * TRAILER * self.k)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ps_mode": self.spec.ps_mode,
            "servers": self.k,
            "workers": self.w,
            "executor": self.mode,
            "staleness_bound": self.spec.staleness,
            "server_param_bytes": [4 * n for n in self.layout.group_sizes],
            "comm_bytes_per_step": self._comm_bytes(),
            "straggler": self.spec.straggler,
        }
        if self.spec.ps_mode != "sync" and self.trace:
            clocks, updates = staleness_of(self.trace, self.w, self.trace_start)
            out.update(
                staleness_histogram=histogram(clocks),
                staleness_max=max(clocks),
                staleness_updates_histogram=histogram(updates),
                staleness_updates_mean=float(np.mean(updates)),
                ps_trace=[list(e) for e in self.trace],
            )
        else:
            out.update(staleness_histogram={"0": self.w * len(self.step_times)}, staleness_max=0)
        return out


class _Server:
    """One server rank's shard, optimizer state and event loop (mpi4jax inside jit)."""

    def __init__(self, ps: ParameterServer) -> None:
        from mpi4py import MPI

        self.ps, self.MPI = ps, MPI
        self.comm = dist.data_comm()
        self.s = ps.rank
        self.status = MPI.Status()
        self.state = None
        self.trace: list[tuple[int, int, int]] = []
        self.applied = 0
        self.version = 0
        self._fns: dict[Any, Any] = {}

    def start(self, state: TrainState) -> None:
        """Take this server's shard of ``state`` and send it to every worker."""
        import mpi4jax

        ps = self.ps
        self.state = state
        self.leaves = ps.layout.split(state.params)[self.s]
        self.opt = state.opt_state[self.s]
        self.start_step = int(np.asarray(state.step))
        self.completed = [self.start_step] * ps.w
        self.waiting: list[int] = []
        self.read = [0] * ps.w
        flat = ps.layout.flat(self.leaves)
        for w in range(ps.w):  # once per run: eager is fine
            mpi4jax.send(flat, ps.k + w, tag=INIT, comm=self.comm)

    def _sync_fn(self):
        """Receive every worker's gradient in worker order, average, update, reply to all."""
        import mpi4jax

        ps, comm, s = self.ps, self.comm, self.s
        size = ps.layout.group_sizes[s] + TRAILER

        def round_(leaves, opt):
            acc, losses = jnp.zeros(size - TRAILER, jnp.float32), []
            for w in range(ps.w):
                msg = mpi4jax.recv(jnp.zeros(size), ps.k + w, tag=GRAD, comm=comm)
                acc, losses = acc + msg[:-TRAILER], [*losses, msg[-TRAILER]]
            leaves, opt = ps._apply_group(leaves, opt, ps.layout.unflat(acc, s), 1.0 / ps.w)
            flat = ps.layout.flat(leaves)
            for w in range(ps.w):
                mpi4jax.send(flat, ps.k + w, tag=PARAMS, comm=comm)
            return leaves, opt, jnp.stack(losses)

        return jax.jit(round_)

    def _async_fn(self):
        """Receive one gradient from any worker (source in ``self.status``) and apply it.

        The update is ``ParameterServer._apply``, the very compiled function the simulator
        runs, so a replay of the recorded arrival order reproduces the run bit for bit
        (asynchronous runs amplify even one-ulp differences)."""
        import mpi4jax

        ps, comm, s = self.ps, self.comm, self.s
        size = ps.layout.group_sizes[s] + TRAILER
        receive = jax.jit(
            lambda: mpi4jax.recv(
                jnp.zeros(size), self.MPI.ANY_SOURCE, tag=GRAD, comm=comm, status=self.status
            )
        )
        unpack = jax.jit(lambda msg: ps.layout.unflat(msg[:-TRAILER], s))
        pack = jax.jit(ps.layout.flat)

        def apply_one(leaves, opt):
            msg = receive()
            leaves, opt = ps._apply(leaves, opt, unpack(msg), 1.0 / ps.w)
            return leaves, opt, pack(leaves), msg[-TRAILER], msg[-1]

        return apply_one

    def _send_fn(self, dest: int):
        """A compiled send of this shard's parameters to ``dest`` (eager mpi4jax calls
        recompile every time)."""
        import mpi4jax

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
            if ps.spec.ps_mode == "sync":
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


class _Worker:
    """One worker rank: pull the shards, then per clock compute, push, pull."""

    def __init__(self, ps: ParameterServer, state: TrainState, start: int) -> None:
        self.ps, self.start = ps, start
        self.w = ps.rank - ps.k
        self.params = state.params

    def _step_fn(self):
        import mpi4jax

        ps, comm = self.ps, dist.data_comm()

        def exchange(params, grads, loss, clock):
            gsplit, psplit = ps.layout.split(grads), ps.layout.split(params)
            new = []
            for s in range(ps.k):
                msg = jnp.concatenate([ps.layout.flat(gsplit[s]), jnp.stack([loss, clock])])
                got = mpi4jax.sendrecv(
                    msg,
                    ps.layout.flat(psplit[s]),
                    source=s,
                    dest=s,
                    sendtag=GRAD,
                    recvtag=PARAMS,
                    comm=comm,
                )
                new.append(ps.layout.unflat(got, s))
            return ps.layout.join(new)

        exchange = jax.jit(exchange)

        def step(params, batch, clock):
            # The gradient is ParameterServer._grad, the simulator's own compiled function
            # (bit-identical replays); the messages to every server go in one call.
            loss, grads = ps._grad(params, batch)
            return exchange(params, grads, loss, clock)

        return step

    def run(self, watchdog: Any = None) -> None:
        import mpi4jax

        ps, comm = self.ps, dist.data_comm()
        psplit = ps.layout.split(self.params)
        groups = []
        for s in range(ps.k):
            got = mpi4jax.recv(ps.layout.flat(psplit[s]), s, tag=INIT, comm=comm)
            groups.append(ps.layout.unflat(got, s))
        params = ps.layout.join(groups)
        step = self._step_fn()
        delay = ps.straggler[1] if ps.straggler and ps.straggler[0] == ps.rank else 0.0
        for clock in range(self.start, ps.spec.steps):
            if delay:
                time.sleep(delay)
            batch = ps._share(clock, self.w)
            params = step(params, batch, jnp.float32(clock))
            jax.block_until_ready(params)
            if watchdog is not None:
                watchdog.beat()
