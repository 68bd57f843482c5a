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
- ``--ps-mode hierarchical --ps-groups G``: Rudra's learner groups (Gupta et al.,
  ICDM'16), synchronous: ranks ``1..G`` aggregate their group's gradients (summed in
  worker order) and push the sum to the one server, which adds the G sums, updates and
  replies to the aggregators, who pass the parameters on: ``single``'s trajectory.
- ``--ps-mode softsync --softsync-n N``: n-softsync (same paper): the server sums the
  gradients as they arrive, each weighted ``1/(c·max(1, σ))`` (c = W/N per update, σ
  its staleness in updates: the staleness-dependent rate), updates once per c and
  replies to those c workers. N = 1 is sync; N = W is async with the rate divided by σ.

Staleness of an applied gradient is recorded in *clocks* - how many clocks the
worker ran ahead of the slowest worker's completed work when it read the
parameters (SSP's bound S applies to it) - and in *updates* - how many updates
the server applied between the read and this one (the async-SGD definition).
Server 0 records the arrival order ``(worker, clock, version read)``; the
in-process simulator (``--simulate``, ``simulate.py``) replays such a trace
(``--ps-trace``) or generates one from a timing model, and is the oracle for
the multi-process run (``mpi.py``). The algorithm itself - sharding, SSP's
release rule, staleness - is ``ssp.py``.

A "step" of the loop is W gradient applications (one per worker in sync),
i.e. one global batch of samples, so step counts compare with ``single``.
The learning-rate schedule advances once per step. BatchNorm models are refused:
workers would keep unsynchronised batch statistics the server never sees.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from refdl.config.plan import Plan, Traits
from refdl.config.spec import RunSpec
from refdl.core.layers import param_count
from refdl.core.optim import make_optimizer_for
from refdl.core.state import TrainState, to_host
from refdl.data.order import worker_share
from refdl.errors import UsageError
from refdl.parallel.processes import data_comm, launched_rank
from refdl.strategies.base import Batch, History, Strategy, abstract, register
from refdl.strategies.ps.simulate import Simulator
from refdl.strategies.ps.ssp import (
    TRAILER,
    Layout,
    histogram,
    softsync_updates,
    staleness_of,
)


def check_consistency(spec: RunSpec, plan: Plan) -> None:
    """A trace replays an inconsistent run; softsync has one server and equal updates."""
    if spec.ps_trace and spec.ps_mode in ("sync", "hierarchical"):
        raise UsageError("--ps-trace replays an async, ssp or softsync run; add --ps-mode "
                         "async|ssp|softsync")  # fmt: skip
    if spec.ps_mode == "softsync":
        n = spec.softsync_n or 1
        if plan.servers != 1:
            raise UsageError("--ps-mode softsync has one server (its order is the one the "
                             "replay needs); drop --servers")  # fmt: skip
        if plan.workers % n:
            raise UsageError(f"--softsync-n {n}: the {plan.workers} workers do not split into "
                             f"{n} equal updates; use a divisor of {plan.workers}")  # fmt: skip


@register("ps")
class ParameterServer(Strategy):
    """Servers hold the parameters and the optimizer; workers push gradients, pull parameters."""

    gathered_checkpoint = True  # the servers' shards and optimizer states, gathered to save

    traits = Traits(
        options=frozenset(
            {"ps_mode", "servers", "ps_groups", "staleness", "simulate", "workers", "ps_trace"}
            | {"straggler", "softsync_n"}
        ),
        multiprocess="mpi",
        replicas=True,
        modes=("mpi", "simulate"),
        has_servers=True,
        straggler_modes=("mpi", "simulate"),
        batch_stats=False,
        synchronous_modes=("sync", "hierarchical"),
        checks=(check_consistency,),
        cost="parameter_server",
    )

    kind: str = ""  # the executor, as the summary names it
    rank: int = 0  # under mpirun, this process's rank

    @classmethod
    def executor(cls, plan: Plan) -> type[Strategy]:
        """Every worker and server in this process (``--simulate``), or one per MPI rank."""
        return {"simulate": Simulated, "mpi": OnRanks}[plan.mode]

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.k, self.w = plan.servers, plan.workers
        self.g = plan.groups  # aggregator ranks k..k+g-1 (hierarchical), else 0
        self.synchronous = self.traits.synchronous_with(spec.ps_mode)
        self.straggler = spec.straggler
        self.bound = 0 if self.synchronous else spec.staleness
        if spec.ps_mode in ("async", "softsync"):
            self.bound = float("inf")
        # softsync: c gradients per update, N updates per step; async/SSP: 1 and W
        self.per_update = self.w // spec.softsync_n if spec.softsync_n else 1
        updates = 1 if self.synchronous else self.w // self.per_update
        # One lr-schedule step per loop step: async/SSP apply W gradients per step.
        self.opt, _ = make_optimizer_for(spec, updates, task.logical_axes)
        params = task.model.abstract_params(task.sample_x)
        self.layout = Layout(params, self.k)
        self.n_params = param_count(params)
        self.update = self.jit(self.update_shard)
        self.accumulate = self.jit(self.accumulate_shard)
        self.grads = self.jit(self.worker_grads)
        self.role = self.make_role()

    def make_role(self) -> Any:
        """What this process plays: the simulator, or a rank's server, aggregator or worker."""
        raise NotImplementedError

    def children(self) -> list[int]:
        """The ranks a server hears from: the aggregators, or every worker."""
        first = self.k + self.g
        return list(range(self.k, first)) if self.g else list(range(first, first + self.w))

    def members(self, group: int) -> list[int]:
        """The worker ranks behind aggregator ``group`` (equal groups, in rank order)."""
        size = self.w // self.g
        first = self.k + self.g + group * size
        return list(range(first, first + size))

    def parent(self, worker: int, server: int) -> int:
        """The rank worker ``worker`` exchanges server ``server``'s shard with."""
        return self.k + worker // (self.w // self.g) if self.g else server

    def host_template(self, seed: int) -> TrainState:
        s = to_host(self.task.init_state(seed))
        groups = self.layout.split(s.params)
        return s.replace(opt_state=tuple(to_host(self.opt.init(g)) for g in groups))

    def place_state(self, host_state: TrainState) -> TrainState:
        return jax.device_put(host_state, self.devices[0])

    # ----- the math every executor shares (compiled once: replays are bit-identical) -----
    # ``update`` and ``grads`` are these two compiled; the executors call them, nothing else.

    def update_shard(self, leaves, opt_state, grads, scale):
        """One optimizer update of a server's shard with ``scale * grads``."""
        grads = [g * scale for g in grads]
        updates, opt_state = self.opt.update(grads, opt_state, leaves)
        return [p + u for p, u in zip(leaves, updates, strict=True)], opt_state

    def accumulate_shard(self, acc, grads, scale):
        """softsync: ``acc + scale * grads`` (a server's running weighted sum)."""
        return [a + g * scale for a, g in zip(acc, grads, strict=True)]

    def worker_grads(self, params, batch):
        """A worker's loss and gradient on its share of a batch."""
        loss, grads, _ = self.task.accumulated_grads(params, {}, batch, self.plan.microbatches)
        return loss, grads

    def share(self, step: int, worker: int) -> Batch:
        """Worker ``worker``'s share of the global batch of ``step`` (from the batch source)."""
        return worker_share(self.batches(step), worker, self.w)

    def compiled_steps(self) -> list[Any]:
        """A worker's gradient program on its share of a batch and each server's update
        of its shard, compiled from shapes alone (under mpirun rank 0, which writes the
        summary, is a server and never runs the workers' program)."""
        params = self.task.model.abstract_params(self.task.sample_x)
        share = {k: abstract(v) for k, v in self.share(0, 0).items()}
        programs = [self.grads.lower(params, share).compile()]
        for leaves in self.layout.split(params):
            opt = jax.eval_shape(self.opt.init, leaves)
            programs.append(self.update.lower(leaves, opt, leaves, 1.0).compile())
        return programs

    # ----- one step of the loop: W gradient applications -----

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        t0 = time.perf_counter()
        state, metrics = self.round(state)
        jax.block_until_ready(state)
        return state, {**metrics, "comm_bytes": self._comm_bytes(),
                       "ps_step_s": time.perf_counter() - t0}  # fmt: skip

    def round(self, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """One loop step: W gradients applied (by the executor's servers)."""
        raise NotImplementedError

    # ----- reporting -----

    def _comm_bytes(self) -> int:
        """Bytes sent per step: W gradient pushes (with trailers) and W parameter pulls;
        hierarchical: as many again for the G aggregators' pushes and pulls."""
        return (self.w + self.g) * (8 * self.n_params + 4 * TRAILER * self.k)

    def summary(self, history: History) -> dict[str, Any]:
        trace = self.role.trace if self.drives_loop else []
        start = getattr(self.role, "start_step", 0) or 0
        out: dict[str, Any] = {
            "ps_mode": self.spec.ps_mode,
            "servers": self.k,
            "workers": self.w,
            "executor": self.kind,
            "staleness_bound": self.spec.staleness,
            "server_param_bytes": [4 * n for n in self.layout.group_sizes],
            "ps_groups": self.g,
            "softsync_n": self.spec.softsync_n,
            "gradients_per_update": self.per_update,
            "comm_bytes_per_step": self._comm_bytes(),
            "straggler": self.spec.straggler and str(self.spec.straggler),
        }
        if not self.synchronous and trace:
            update_of = None
            if self.spec.ps_mode == "softsync":
                update_of = softsync_updates(trace, self.w, start, self.spec.steps,
                                             self.per_update)  # fmt: skip
            clocks, updates = staleness_of(trace, self.w, start, update_of)
            out.update(
                staleness_histogram=histogram(clocks),
                staleness_max=max(clocks),
                staleness_updates_histogram=histogram(updates),
                staleness_updates_mean=float(np.mean(updates)),
                ps_trace=[list(e) for e in trace],
            )
        else:
            steps = len(history.get("ps_step_s") or [])
            out.update(staleness_histogram={"0": self.w * steps}, staleness_max=0)
        return out


class Simulated(ParameterServer):
    """Every worker and server in this process, in the order a timing model (or a recorded
    trace) gives (``refdl.strategies.ps.simulate``)."""

    kind = "simulate"

    def make_role(self) -> Any:
        return Simulator(self)

    def round(self, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        return self.role.step(state)


class OnRanks(ParameterServer):
    """Servers, aggregators and workers are MPI ranks (``refdl.strategies.ps.mpi``); only
    server 0 runs the loop, the other ranks ``serve``."""

    kind = "mpi"

    def __init__(self, task, spec, plan, devices, batches) -> None:
        self.rank = launched_rank()
        super().__init__(task, spec, plan, devices, batches)

    def make_role(self) -> Any:
        from refdl.strategies.ps import mpi  # mpi4py starts MPI when imported

        if self.rank < self.k:
            return mpi.Server(self)
        return mpi.Aggregator(self) if self.rank < self.k + self.g else mpi.Worker(self)

    @property
    def drives_loop(self) -> bool:
        return self.rank == 0

    @property
    def lockstep(self) -> bool:
        return False  # only server 0 runs the loop

    def round(self, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        srv = self.role
        if srv.state is None:
            srv.start(state)
        losses = srv.pump(srv.applied + self.w)
        new = state.replace(
            step=state.step + 1,
            params=self.layout.join([srv.leaves, *self.layout.split(state.params)[1:]]),
            opt_state=(srv.opt, *state.opt_state[1:]),
        )
        return new, {"loss": float(np.mean(losses))}

    def serve(self, state: TrainState, start: int, watchdog: Any = None) -> None:
        if self.rank < self.k:
            self.role.start(state)
            self.role.serve_forever(watchdog)
        else:
            self.role.run(state, start, watchdog)

    def gather_state(self, state: TrainState) -> TrainState:
        """Server 0 asks servers 1..K-1 for their shards (and optimizer states)."""
        if self.k == 1:
            return to_host(state)
        from refdl.strategies.ps.mpi import GATHER

        host = to_host(state)
        groups = self.layout.split(host.params)
        opt = list(host.opt_state)
        world = data_comm()
        for s in range(1, self.k):
            world.send(None, dest=s, tag=GATHER)
            groups[s], opt[s] = world.recv(source=s, tag=GATHER)
        return host.replace(params=self.layout.join(groups), opt_state=tuple(opt))

    def finish(self) -> None:
        if self.rank == 0:
            from refdl.strategies.ps.mpi import STOP

            for s in range(1, self.k):
                data_comm().send(None, dest=s, tag=STOP)
