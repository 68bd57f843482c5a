"""The Strategy protocol and the registry of strategies.

A strategy owns **placement and communication** only: it receives a ``Task``
(model, loss, optimizer as pure functions), the checked ``Plan`` (mesh degrees,
workers, pipeline cuts; ``refdl.config.plan``) and the global batch of each
step, and decides where state lives and what moves between devices. It never
owns the loop, the data order, the model or the loss, which is what makes every
strategy comparable with the single-device reference ``single``.

Everything a strategy needs is built in its constructor (compiled programs
included, from abstract shapes); ``train_step`` returns what it measured in
its metrics instead of keeping it, and ``summary`` reads those metrics back from
the loop's history. Nothing is set on a strategy after construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import numpy as np

from refdl.config.plan import Plan, Traits
from refdl.config.spec import RunSpec
from refdl.core.state import TrainState, to_host
from refdl.core.task import Task
from refdl.registry import Registry

PyTree = Any
Batch = dict[str, np.ndarray]
BatchSource = Callable[[int], Batch]  # step -> the global batch of that step (the data order)
History = Mapping[str, Any]  # metric name -> per-step host values (scalars) or the last value


class Strategy:
    """One way of running ``Task.step`` on devices.

    ``init_state``/``place_state`` put the state where the strategy wants it;
    ``train_step`` performs one SGD step on the *global* batch and returns the
    new state and metrics (``loss``, a device array the loop reads when it logs,
    plus what the strategy measured); ``gather_state`` brings the full state to
    the host (checkpoints, evaluation, equivalence checks); ``summary`` gives the
    strategy's keys of ``summary.json`` from the metrics' history.
    """

    name: ClassVar[str] = ""
    traits: ClassVar[Traits] = Traits()

    def __init__(
        self, task: Task, spec: RunSpec, plan: Plan, devices: list, batches: BatchSource
    ) -> None:
        self.task, self.spec, self.plan, self.devices = task, spec, plan, devices
        self.batches = batches  # only strategies that pull their own batches (ps) call it

    @classmethod
    def executor(cls, plan: Plan) -> type[Strategy]:
        """The class that runs this strategy under ``plan``, chosen once when the run is
        built: itself, unless the strategy has several executors (``hybrid`` with pipeline
        stages runs the pipeline executor)."""
        return cls

    # -- roles under mpirun ------------------------------------------------------------------

    @property
    def drives_loop(self) -> bool:
        """Whether this process runs the training loop; ranks that do not (parameter-server
        workers, secondary servers) call ``serve`` instead."""
        return True

    @property
    def lockstep(self) -> bool:
        """Whether every process runs the loop's steps together (so under mpirun they can
        agree on the step to stop at); parameter servers' workers run their own loops."""
        return True

    def serve(self, state: TrainState, start: int, watchdog: Any = None) -> None:
        """This rank's whole part of the run when it does not drive the loop."""
        raise NotImplementedError

    def finish(self) -> None:
        """Called once on every loop-driving rank after the summary (release helper ranks)."""
        return None

    # -- state --------------------------------------------------------------------------------

    def host_template(self, seed: int) -> TrainState:
        """A host state with this strategy's checkpoint structure (for ``--resume``)."""
        return to_host(self.task.init_state(seed))

    def init_state(self, seed: int) -> TrainState:
        """The initial state from ``seed``, placed by this strategy."""
        return self.place_state(self.host_template(seed))

    def place_state(self, host_state: TrainState) -> TrainState:
        """Place a full host state (fresh or restored from a checkpoint) on the devices."""
        raise NotImplementedError

    def gather_state(self, state: TrainState) -> TrainState:
        """The full state on the host as NumPy arrays."""
        return to_host(state)

    def gather_params(self, state: TrainState) -> PyTree:
        """The full parameters on the host (for equivalence checks and evaluation)."""
        return self.gather_state(state).params

    def eval_state(self, host_state: TrainState) -> TrainState:
        """The single model evaluated from a gathered state (e.g. the replicas' average)."""
        return host_state

    # -- checkpoints (``refdl.run.checkpoint``) ---------------------------------------------

    # Whether a checkpoint holds the gathered host state: the placed state is per stage
    # (pipeline) or per process without ``jax.distributed`` (ps, decentralized over MPI).
    gathered_checkpoint = False

    def checkpoint_view(self, state: TrainState) -> TrainState:
        """The state as a checkpoint holds it: ``host_template``'s structure. By default the
        placed state itself, still sharded, so each process writes only its own shards;
        every rank that drives the loop calls it at the same step. Where the placed state
        is not one global array per leaf (``gathered_checkpoint``), the gathered host state."""
        return self.gather_state(state) if self.gathered_checkpoint else state

    def checkpoint_target(self, seed: int) -> TrainState:
        """Where a restore puts each leaf of ``checkpoint_view``: arrays (or their shapes)
        with the shardings a fresh state of this run has; host arrays where the view is
        gathered."""
        return self.host_template(seed) if self.gathered_checkpoint else self.init_state(seed)

    def from_checkpoint(self, view: TrainState) -> TrainState:
        """The placed state from a restored ``checkpoint_view``."""
        return self.place_state(view)

    # -- one step -----------------------------------------------------------------------------

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        """One step on the global ``batch``: ``(new_state, {"loss": ..., ...})``."""
        raise NotImplementedError

    def extra_metrics(self, state: TrainState) -> dict[str, Any]:
        """Metrics measured only on logged steps (e.g. consensus distance); every rank calls it."""
        return {}

    def summary(self, history: History) -> dict[str, Any]:
        """Strategy-specific keys for ``summary.json`` (e.g. ``comm_bytes_per_step``)."""
        return {}

    def compiled_steps(self) -> list[Any]:
        """The compiled program(s) one step runs, for XLA's memory analysis
        (``peak_memory_bytes_per_device``)."""
        return []

    def peak_memory_bytes_per_device(self, history: History) -> int | None:
        """The most memory one device holds during a step: XLA's memory analysis of the
        step's program(s); a strategy whose step is many programs with values held between
        them (pipeline stages) adds those up itself."""
        return peak_bytes(self.compiled_steps())

    # -- shared helpers -----------------------------------------------------------------------

    def jit(self, fn: Callable, **kwargs: Any) -> Any:
        """``jax.jit`` of a program that runs the model, compiled with the task's options for
        these devices' platform (``Task.compiler_options``)."""
        options = self.task.compiler_options(self.devices[0].platform)
        return jax.jit(fn, compiler_options=options, **kwargs)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch's shapes and dtypes (rows as step 0's, ``--batch-size`` of them)."""
        b, rows = self.spec.batch_size, self.batches(0)  # (a growing batch's later sizes too)
        return {k: jax.ShapeDtypeStruct((b, *v.shape[1:]), v.dtype) for k, v in rows.items()}

    @property
    def serialize_steps(self) -> bool:
        """Whether each step must finish before the next is dispatched: with several
        simulated CPU devices, queued steps can occupy every thread of XLA's pool inside a
        collective's rendezvous and deadlock (seen with 8 devices on 2 cores). Real
        accelerators and one CPU device need no wait."""
        return len(self.devices) > 1 and self.devices[0].platform == "cpu"


STRATEGIES: Registry[type[Strategy]] = Registry("strategy")


def register(name: str):
    """Class decorator: register a Strategy subclass under ``name``."""

    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        return STRATEGIES.register(name)(cls)

    return deco


def traits_of(name: str) -> Traits:
    """What strategy ``name`` declares; any other name gets the defaults and names its own
    cost model (a formula registered alone, for a strategy not written yet; an unknown
    name is refused by the cost models' registry, listing them)."""
    return STRATEGIES.get(name).traits if name in STRATEGIES else Traits(cost=name)


def declared_traits() -> dict[str, Traits]:
    """Every registered strategy's traits, by name (whose options another strategy may take)."""
    return {name: STRATEGIES.get(name).traits for name in STRATEGIES}


def memory_of(compiled: Any) -> Any:
    """XLA's memory analysis of a compiled program (per device), or None where the backend
    does not report it."""
    try:
        return compiled.memory_analysis()
    except Exception:  # a backend without the analysis
        return None


def peak_bytes(compiled: list[Any]) -> int | None:
    """The most memory one device holds while one of ``compiled`` runs, from XLA's memory
    analysis: arguments + outputs - the outputs written over donated arguments +
    temporaries (``None`` where the backend does not report it)."""
    peaks = [
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        for m in map(memory_of, compiled)
        if m is not None
    ]
    return int(max(peaks)) if peaks else None


def abstract(x: Any) -> Any:
    """An argument's shape, dtype and placement (what lowering needs), without its data."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))


class FirstCall:
    """A jitted program that keeps its first call's argument shapes, so its memory
    analysis can be read after the run (``compiled``) without keeping any data."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.args = fn, None

    def __call__(self, *args: Any) -> Any:
        if self.args is None:
            self.args = jax.tree.map(abstract, args)
        return self.fn(*args)

    def compiled(self) -> Any:
        """The program compiled for the first call's shapes (from JAX's cache); None if it
        was never called."""
        return None if self.args is None else self.fn.lower(*self.args).compile()


def last(history: History, key: str, default: Any = None) -> Any:
    """The last recorded value of ``key`` (a list's last element)."""
    v = history.get(key, default)
    return v[-1] if isinstance(v, list) and v else v


def steady_median(history: History, key: str) -> float | None:
    """The median of ``key`` over the steps after the first (which includes compilation)."""
    values = history.get(key) or []
    values = values[1:] or values
    return float(np.median(values)) if values else None
