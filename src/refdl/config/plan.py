"""Every degree, divisibility and option check of a run, in one place, before any device.

``plan(spec, strategy, traits, model, ...)`` takes a validated ``RunSpec``, the
strategy's declared ``Traits``, a device-free view of the model (``ModelShape``:
parameter shapes and logical axis names, from ``jax.eval_shape``) and the rank
count, and returns the ``Plan`` the strategy executes: mesh degrees, workers,
microbatches, pipeline cuts. Anything that does not fit raises a one-line
``UsageError`` saying what to change. Strategies do not check again.

The checks, in order: options that belong to other strategies; the launcher
(``mpirun``); the mesh (degrees multiply to the devices, axes the strategy does
not use are 1); the batch (the global batch splits into ``data`` shards of
``microbatches`` equal parts, or into worker shares); the layers (every
dimension a mesh axis splits divides by its degree; a pipeline has a layer per
stage and valid cuts); and each strategy's own numbers (servers, stragglers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np

from refdl.config.choices import LOOPED, SPARSE_ALLREDUCE, chunks_of
from refdl.config.mesh import AXES, MeshSpec
from refdl.config.rules import PRESET_RULES, MeshAxes, degree
from refdl.config.spec import RunSpec, flag
from refdl.errors import UsageError, problems, together

DEFAULT_SIMULATED_WORKERS = 4
# RunSpec fields that only some strategies accept (each declares which in its Traits).
STRATEGY_OPTIONS = (
    "mesh", "allreduce", "compress", "zero", "preset", "stages", "schedule", "chunks",
    "stage_boundaries", "plot_schedule", "ps_mode", "servers", "ps_groups", "softsync_n",
    "staleness", "simulate", "workers", "ps_trace", "topology", "order", "gossip",
    "consensus_step", "straggler", "cp", "sequence_parallel", "sfb", "muon",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Traits:
    """What a strategy declares, so that everything outside ``refdl.strategies`` asks it
    instead of comparing its name: the checks here, the CLI, validate, predict, bench.

    ``axes``: the mesh axes it may split over (``()``: one device); ``options``: the
    fields of ``STRATEGY_OPTIONS`` it accepts; ``multiprocess``: how it runs under
    ``mpirun`` (``spmd``: one runtime over all ranks; ``mpi``: a runtime per rank;
    ``None``: one process only); ``replicas``: its unit is a worker (a rank, a device
    or a simulated worker) holding a whole replica, not a mesh axis; ``modes``: where a
    worker strategy runs (``spmd`` on devices, ``mpi`` ranks, ``simulate`` in one
    process); ``has_servers``: some ranks are parameter servers (``--servers``);
    ``straggler_modes``: the modes ``--straggler`` can delay a worker in; ``pipeline``: it
    runs a pipeline schedule even with one stage (a ``pipe`` axis > 1 also makes one);
    ``shards_params``: a ZeRO stage (``--zero``) shards its state over its data axis;
    ``batch_stats``: whether it supports models with batch statistics (BatchNorm);
    ``whole_sequences``: each device's step sees whole sequences (a mixture-of-experts
    router ranks a sequence's tokens; ``context`` gives a device a piece of each);
    ``synchronous``: its parameters after N steps equal ``single``'s; ``consistency``:
    the ``--ps-mode`` values it takes and, of them, ``synchronous_modes`` those in which
    it is synchronous (see ``synchronous_with``); ``fills_host``: with neither
    ``--devices`` nor ``--mesh`` it takes the whole host (8 simulated CPU devices or
    every accelerator) and factors them over its axes.

    The strategy's own rules travel with it: ``checks`` are run by ``plan`` on the
    checked ``Plan`` (each ``check(spec, plan)`` raises a one-line UsageError), and
    ``cost`` names its step-cost formula in ``refdl.perf.costs.FORMULAS`` (which the
    strategy module never imports).
    """

    axes: tuple[str, ...] = ()
    options: frozenset[str] = frozenset()
    multiprocess: str | None = None
    replicas: bool = False
    modes: tuple[str, ...] = ("spmd",)
    has_servers: bool = False
    straggler_modes: tuple[str, ...] = ("mpi",)
    pipeline: bool = False
    shards_params: bool = False
    batch_stats: bool = True
    whole_sequences: bool = True
    synchronous: bool = True
    synchronous_modes: tuple[str, ...] = ()
    fills_host: bool = False
    checks: tuple[Callable[[RunSpec, Plan], None], ...] = ()
    cost: str = ""

    def synchronous_with(self, ps_mode: str | None) -> bool:
        """Whether a run with this consistency mode (``--ps-mode``; None: the default)
        equals ``single`` step by step."""
        if self.synchronous_modes:
            return ps_mode is None or ps_mode in self.synchronous_modes
        return self.synchronous

    def pipe_degree(self, spec: RunSpec) -> int:
        """The pipeline stages ``spec`` asks of this strategy (1 when it runs none)."""
        if "pipe" not in self.axes:
            return 1
        if spec.mesh:
            return spec.mesh.pipe
        return (spec.stages or spec.devices) if self.axes[0] == "pipe" else 1

    def microbatches(self, spec: RunSpec) -> int:
        """``--microbatches``, else 4 for a pipeline of several stages and 1 otherwise."""
        if spec.microbatches is not None:
            return spec.microbatches
        return 4 if self.pipe_degree(spec) > 1 else 1


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer seen without devices: its parameters' shapes and logical axis names."""

    key: str
    params: Mapping[str, tuple[tuple[int, ...], tuple[str | None, ...]]]

    @property
    def size(self) -> int:
        return int(sum(math.prod(shape) for shape, _ in self.params.values()))


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model seen without devices (``refdl.assemble.model_shape`` builds it)."""

    name: str
    layers: tuple[Layer, ...]
    batch_stats: bool = False
    train_size: int = 1 << 62  # training examples of the data set
    # tokens per example where positions mix only through attention (a context axis may
    # split them); 0 for models without such a sequence (images, recurrences)
    sequence: int = 0

    @property
    def leaves(self) -> int:
        return sum(len(layer.params) for layer in self.layers)

    @property
    def experts(self) -> int:
        """Experts per mixture-of-experts layer (their weights' ``expert`` dimension); 0
        for a model without any."""
        return max(
            (shape[axes.index("expert")] for layer in self.layers
             for shape, axes in layer.params.values() if "expert" in axes),
            default=0,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the checks decided: the strategy executes exactly this."""

    mesh: MeshSpec
    microbatches: int
    rules: Mapping[str, MeshAxes]
    batch_axes: MeshAxes
    # spmd: one runtime over all devices (all ranks' under mpirun, via jax.distributed);
    # mpi: a runtime per rank, messages between them; simulate: every worker in one process
    mode: str = "spmd"
    workers: int = 1  # ps / decentralized workers
    servers: int = 0  # ps servers
    groups: int = 0  # ps hierarchical: aggregator ranks, one per learner group
    chunks: int = 1  # pipeline chunks per device
    cuts: tuple[
        int, ...
    ] = ()  # pipeline: layer index where each virtual stage after the first starts


def plan(
    spec: RunSpec,
    strategy: str,
    traits: Traits,
    model: ModelShape,
    *,
    ranks: int = 1,
    owners: Mapping[str, Traits] | None = None,
) -> Plan:
    """Check ``spec`` for ``strategy`` on ``model`` with ``ranks`` MPI ranks; the Plan."""
    spec = dataclasses.replace(spec, microbatches=traits.microbatches(spec))
    given = [f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) != f.default]
    together(
        lambda: check_options(given, strategy, traits, owners or {strategy: traits}),
        lambda: check_launch(spec, strategy, traits, ranks),
        lambda: check_precision(spec, traits, ranks),
        lambda: check_batch_fits(spec.batch_size, model.train_size),
    )
    if not traits.batch_stats and model.batch_stats:
        raise UsageError(
            f"--strategy {strategy} does not support {model.name} (BatchNorm statistics would "
            "stay on the workers); use mlp, lenet5, lstm_lm or transformer"
        )
    if not traits.batch_stats and model.experts:
        raise UsageError(
            f"--strategy {strategy} keeps no model state on its workers, where {model.name}'s "
            "routers count their dropped tokens; use --strategy data, fsdp or hybrid"
        )
    if model.experts and not traits.whole_sequences:
        raise UsageError(
            f"--strategy {strategy} gives each device a piece of every sequence, and "
            f"{model.name}'s router ranks whole sequences; use --strategy hybrid with "
            "--mesh context=..,expert=.."
        )
    checked = (_worker_plan if traits.replicas else _mesh_plan)(
        spec, strategy, traits, model, ranks, owners or {strategy: traits}
    )
    for check in traits.checks:  # the strategy's own rules, on what was decided
        check(spec, checked)
    if spec.batch_schedule is not None:  # every batch of the schedule splits as the first
        if traits.replicas:
            raise UsageError(
                f"--batch-schedule grows the batch of the strategies that step in lockstep; "
                f"--strategy {strategy}'s workers take their own shares, drop it"
            )
        for b in spec.batch_schedule.sizes[1:]:
            later = dataclasses.replace(spec, batch_size=b, batch_schedule=None)
            plan(later, strategy, traits, model, ranks=ranks, owners=owners)
    return checked


def _mesh_plan(
    spec: RunSpec,
    strategy: str,
    traits: Traits,
    model: ModelShape,
    ranks: int,
    owners: Mapping[str, Traits],
) -> Plan:
    """The strategies over mesh axes: degrees, rules, batch split, layers, pipeline cuts."""
    m = spec.microbatches
    mesh = mesh_of(spec, strategy, traits, owners)
    preset = spec.preset or "tensor"
    rules, batch_axes = PRESET_RULES[preset]
    if mesh.pipe > 1 and spec.preset:
        raise UsageError(f"--preset {spec.preset} does not combine with pipe > 1")
    if mesh.fsdp > 1:
        if spec.preset:
            raise UsageError(f"--preset {spec.preset} does not combine with an fsdp axis")
        # The batch is split over both, fsdp-major. (data-major, XLA's partitioner in jax
        # 0.10.2 gave wrong gradients for lstm_lm and resnet on data=2,fsdp=2,model=2 on CPU;
        # tests/strategies/test_equivalence.py holds that mesh.)
        batch_axes = ("fsdp", "data")
    if mesh.expert > 1:  # the expert axis splits the batch too (GShard, DeepSpeed-MoE)
        batch_axes = (*((batch_axes,) if isinstance(batch_axes, str) else batch_axes), "expert")
    together(
        lambda: check_batch(spec.batch_size, degree(mesh, batch_axes), m),
        lambda: (check_experts(spec, mesh, model), check_layers(mesh, model, rules)),
        lambda: check_sequence(spec, mesh, model),
    )
    idle = []  # an axis's options where the mesh has no such axis would change nothing
    if mesh.context == 1 and spec.cp != "ring":
        idle.append(f"--cp {spec.cp} sets how a context axis attends; the mesh has none "
                    "(add context=N to --mesh, or drop it)")  # fmt: skip
    if mesh.model == 1 and spec.preset is not None:
        idle.append(f"--preset {spec.preset} splits layers over a model axis; the mesh has "
                    "none (add model=N to --mesh, or drop it)")  # fmt: skip
    if idle and not spec.resume:  # a resumed run's own settings, kept as it was started
        raise problems(idle)
    chunks, cuts = spec.chunks, ()
    if mesh.pipe > 1 or traits.pipeline:
        if ranks > 1:
            raise UsageError(
                "pipe > 1 runs its stages from one host process; launch it without mpirun"
            )
        cuts = pipeline_cuts(spec, model, mesh.pipe)
        chunks = chunks_of(spec.schedule, spec.chunks)
    else:  # a pipeline's options without stages would change nothing
        unused = [f"--chunks {spec.chunks}"] * (spec.chunks != 1)
        unused += [f"--schedule {spec.schedule}"] * (spec.schedule != "1f1b")
        if spec.stage_boundaries is not None:
            unused.append(f"--stage-boundaries {','.join(map(str, spec.stage_boundaries))}")
        if spec.resume:  # a resumed run's own settings, kept as it was started
            unused = []
        unused += [f"--plot-schedule {spec.plot_schedule}"] * bool(spec.plot_schedule)
        if unused:
            raise problems([f"{u} needs pipeline stages (pipe > 1)" for u in unused])
    return Plan(mesh, m, rules, batch_axes, "spmd", chunks=chunks, cuts=cuts)


def check_options(
    given: Iterable[str], strategy: str, traits: Traits, owners: Mapping[str, Traits]
) -> None:
    """Options given that ``strategy`` does not accept name the strategies that do.
    ``given``: the fields the user set (a command line knows them all; a spec, those off
    their defaults, so ``--zero 3`` with ``single`` is caught where the flags are known)."""
    for key in given:
        if key not in STRATEGY_OPTIONS or key in traits.options:
            continue
        takers = sorted(name for name, t in owners.items() if key in t.options)
        where = f"--strategy {', '.join(takers)}" if takers else "no strategy here"
        raise UsageError(f"{flag(key)} is an option of {where}, not of --strategy {strategy}")


def check_precision(spec: RunSpec, traits: Traits, ranks: int) -> None:
    """``--precision fp64`` (the proofs) where every number stays in float64: not through a
    codec's fp32 values, nor through the fp32 messages of the servers and gossip under
    mpirun (their ``--simulate`` and device executors keep float64)."""
    if spec.precision != "fp64":
        return
    if not jax.config.x64_enabled:  # its arrays would silently be fp32
        raise UsageError(
            "--precision fp64 needs JAX's 64-bit mode: run inside "
            "refdl.core.precision.scope('fp64') (refdl train and refdl.testing do)"
        )
    if spec.compress or spec.allreduce in SPARSE_ALLREDUCE:
        what = f"--compress {spec.compress}" if spec.compress else f"--allreduce {spec.allreduce}"
        raise UsageError(f"{what} sends fp32 values; --precision fp64 is for exact runs, drop one")
    if ranks > 1 and traits.multiprocess == "mpi":
        raise UsageError(
            "--precision fp64 runs the parameter server and gossip in one "
            "process (--simulate or --devices); under mpirun they send fp32"
        )


def check_launch(spec: RunSpec, strategy: str, traits: Traits, ranks: int) -> None:
    """Under ``mpirun`` (``ranks`` > 1): the strategy must run across ranks, once per rank."""
    if ranks <= 1:
        return
    if traits.multiprocess is None:
        raise UsageError(
            f"--strategy {strategy} runs in one process; launch it without mpirun, or use "
            "data, model, hybrid, ps or decentralized across ranks"
        )
    if spec.simulate:
        raise UsageError("--simulate runs every worker in one process; launch it without mpirun")
    if spec.devices not in (1, ranks):
        raise UsageError(
            f"under mpirun --devices is the number of ranks ({ranks}), not {spec.devices}; "
            "drop --devices"
        )


def mesh_of(
    spec: RunSpec, strategy: str, traits: Traits, owners: Mapping[str, Traits] | None = None
) -> MeshSpec:
    """The mesh degrees: ``--mesh`` (all devices on the strategy's first axis by default);
    axes the strategy does not use must be 1 (the message names the strategies that use
    them, among ``owners``)."""
    n = spec.devices
    if not traits.axes:
        if n != 1:
            raise UsageError(
                f"--strategy {strategy} runs on one device, not {n}; "
                "drop --devices or pick a parallel strategy"
            )
        return MeshSpec()
    if traits.axes == ("pipe",) and spec.stages is not None and spec.stages != n:
        raise UsageError(
            f"--strategy {strategy} runs one stage per device: --stages {spec.stages} needs "
            f"--devices {spec.stages}"
        )
    mesh = spec.mesh or MeshSpec(**{traits.axes[0]: n})
    check_axes(strategy, traits, mesh.as_dict(), str(spec.mesh), owners)
    return mesh


def check_axes(strategy: str, traits: Traits, degrees: Mapping[str, int], mesh: str,
               owners: Mapping[str, Traits] | None = None) -> None:  # fmt: skip
    """Axes of ``degrees`` (``--mesh`` ``mesh``) the strategy does not split over must be
    1; the message names the strategies that use them, among ``owners``."""
    unused = [a for a in AXES if a not in traits.axes and degrees.get(a, 1) != 1]
    if unused:
        only = ", ".join(traits.axes)
        takers = sorted(n for n, t in (owners or {}).items() if set(unused) <= set(t.axes))
        where = f"use --strategy {' or '.join(takers)}" if takers else "no strategy here takes it"
        raise UsageError(
            f"--strategy {strategy} splits over {only}, not {', '.join(unused)}; {where} for "
            f"--mesh {mesh}"
        )


def check_batch_fits(batch_size: int, examples: int) -> None:
    """A batch is drawn from the training set: it cannot be larger."""
    if batch_size > examples:
        raise UsageError(
            f"--batch-size {batch_size} is larger than the {examples} training "
            "examples of the data set; use a smaller batch"
        )


def check_batch(global_batch: int, shards: int, microbatches: int = 1) -> None:
    """The global batch must split into ``shards`` of ``microbatches`` equal parts."""
    if microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1 (got {microbatches})")
    unit = shards * microbatches
    if global_batch % unit:
        lo = (global_batch // unit) * unit
        hint = f"{lo} or {lo + unit}" if lo else f"{unit}"
        raise UsageError(
            f"--batch-size {global_batch} does not split into {shards} shards x "
            f"{microbatches} microbatches; use a multiple of {unit} (e.g. {hint})"
        )


def check_layers(mesh: MeshSpec, model: ModelShape, rules: Mapping[str, MeshAxes]) -> None:
    """Every dimension the rules split must divide by its mesh degree; say which does not."""
    for layer in model.layers:
        for name, (shape, axes) in layer.params.items():
            for dim, logical in enumerate(axes):
                k = degree(mesh, rules.get(logical)) if logical else 1
                if k > 1 and shape[dim] % k:
                    raise UsageError(
                        f"--mesh {mesh}: {k}-way split of layer "
                        f"{layer.key}'s {logical} width {shape[dim]} (parameter {name} "
                        f"{tuple(shape)}) is not even; use a degree dividing {shape[dim]} or "
                        "change the width with --model-opt"
                    )


def check_experts(spec: RunSpec, mesh: MeshSpec, model: ModelShape) -> None:
    """An ``expert`` axis splits the experts of a mixture-of-experts model: there must be
    some, in a number the degree divides, under the default rules."""
    if mesh.expert == 1:
        return
    if not model.experts:
        raise UsageError(
            f"an expert axis splits the experts of a mixture-of-experts model, and "
            f"{model.name} has none; use --model moe"
        )
    if model.experts % mesh.expert:
        raise UsageError(
            f"expert={mesh.expert} does not divide the {model.experts} experts of "
            f"{model.name}; use a degree dividing {model.experts} or --model-opt experts=N"
        )
    if spec.preset:
        raise UsageError(f"--preset {spec.preset} does not combine with an expert axis")


def check_sequence(spec: RunSpec, mesh: MeshSpec, model: ModelShape) -> None:
    """A ``context`` axis and ``--sequence-parallel`` split the sequence: the model must have
    one that only attention mixes, of a length the degree divides (and, for Ulysses'
    all-to-all, heads the degree divides)."""
    splits = [(mesh.context, "a context axis")] if mesh.context > 1 else []
    if spec.sequence_parallel:
        if mesh.model == 1:
            raise UsageError(
                "--sequence-parallel splits the sequence over the model axis: give model > 1"
            )
        splits.append((mesh.model, "--sequence-parallel"))
    for degree_, what in splits:
        if not model.sequence:
            raise UsageError(
                f"{what} splits a sequence that only attention mixes, and {model.name} has "
                "none; use --model transformer"
            )
        if model.sequence % degree_:
            raise UsageError(
                f"{what} of degree {degree_} does not divide the sequence of "
                f"{model.sequence} tokens; use a degree dividing {model.sequence} or "
                "--data-opt seq_len=N with N a multiple of it"
            )
    if mesh.context > 1 and spec.cp == "all-to-all":
        check_layers(mesh, model, {"heads": "context"})
    if mesh.context > 1 and spec.sequence_parallel:
        raise UsageError(
            "--sequence-parallel and a context axis both split the sequence; use one of them"
        )


def pipeline_cuts(spec: RunSpec, model: ModelShape, p: int) -> tuple[int, ...]:
    """Where the ``p x chunks`` virtual stages start: ``--stage-boundaries``, equal chunks
    for ``interleaved``, else balanced by parameter count (``balance``). ZB-V has two
    chunks per device; the looped schedules ``--chunks``."""
    m, n = spec.microbatches, len(model.layers)
    if p == 1 and spec.schedule != "1f1b":  # one stage: no order of stages to choose
        raise UsageError(
            f"--schedule {spec.schedule} orders the work of 2 or more pipeline stages, and "
            "this run has 1; give --devices 2 or more (or --stages), or drop --schedule"
        )
    check_schedule(spec.schedule, spec.chunks, m, p, n, model.name)
    v = chunks_of(spec.schedule, spec.chunks)
    if spec.stage_boundaries is not None:
        cuts = list(spec.stage_boundaries)
        ordered = cuts == sorted(set(cuts)) and all(0 < c < n for c in cuts)
        if len(cuts) != p * v - 1 or not ordered:
            raise UsageError(
                f"--stage-boundaries {','.join(map(str, cuts))}: need {p * v - 1} increasing "
                f"layer indices between 1 and {n - 1} for {p * v} stages"
            )
        return tuple(cuts)
    if spec.schedule == "interleaved":
        return tuple(range(n // (p * v), n, n // (p * v)))
    return tuple(balance([max(layer.size, 1) for layer in model.layers], p * v))


def check_schedule(schedule: str, chunks: int, microbatches: int, pipe: int, layers: int,
                   name: str, even: bool = True) -> None:  # fmt: skip
    """Refuse a schedule ``pipe`` stages of ``layers`` layers cannot run (``layers`` 0:
    not known, not checked): train's rules, which ``refdl predict`` prices by too.
    ``even=False`` (a transformer's mesh in predict, which prices published layouts)
    leaves out the rules on how layers and microbatches divide: Megatron-LM and
    torchtitan run uneven chunks, and Zero Bubble's 8 x 3 chunks of a 22-layer model give
    its embedding and its output layer a chunk each (at most ``layers + 2`` chunks)."""
    m, p = microbatches, pipe
    if chunks != 1 and schedule not in LOOPED:
        raise UsageError(f"--chunks {chunks} needs --schedule interleaved or looped-bfs")
    v = chunks_of(schedule, chunks)
    if schedule == "dualpipev" and m < 2 * p:
        raise UsageError(
            f"--schedule dualpipev needs at least 2 x stages = {2 * p} microbatches (got {m}); "
            f"use --microbatches {2 * p} or more"
        )
    if even and schedule == "interleaved" and m % p:
        raise UsageError(
            f"--schedule interleaved needs microbatches divisible by stages ({m} % {p} != 0); "
            f"use --microbatches {p * -(-m // p)}"
        )
    most = layers if even else layers + 2  # the embedding and the output layer a chunk each
    if layers and p * v > most:
        extra = "" if even else " (and its embedding and output layer)"
        raise UsageError(
            f"{p} stages x {v} chunks = {p * v} need at least as many layers; {name} has "
            f"{layers}{extra}: use fewer stages (--stages, or --mesh pipe=) or --chunks"
        )
    if even and schedule == "interleaved" and layers and layers % (p * v):
        raise UsageError(
            f"--schedule interleaved needs the {layers} layers of {name} to divide "
            f"into {p} x {v} = {p * v} equal chunks; change the stages or --chunks"
        )


def balance(costs: list[int], parts: int) -> list[int]:
    """Cut points splitting ``costs`` into ``parts`` contiguous non-empty groups that
    minimise the largest group's sum (exact, by dynamic programming).

    >>> balance([1, 1, 1, 1], 2)
    [2]
    """
    n = len(costs)
    prefix = np.concatenate([[0], np.cumsum(costs)])
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for j in range(1, parts + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, c
    cuts, i = [], n
    for j in range(parts, 0, -1):
        i = cut[j][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def _worker_plan(
    spec: RunSpec,
    strategy: str,
    traits: Traits,
    model: ModelShape,
    ranks: int,
    owners: Mapping[str, Traits],
) -> Plan:
    """ps and decentralized: workers are ranks, devices or simulated workers."""
    m = spec.microbatches
    servers = spec.servers if traits.has_servers else 0
    groups = 0
    if ranks > 1:
        mode = "mpi"
        if servers >= ranks:
            raise UsageError(
                f"--servers {servers} leaves no worker among {ranks} ranks; launch at least "
                f"{servers + 1} ranks (mpirun -n {servers + 1}) or lower --servers"
            )
        workers = ranks - servers
        if spec.ps_mode == "hierarchical" and traits.has_servers:
            groups = check_groups(spec, ranks)
            workers -= groups
    elif spec.simulate:
        mode = "simulate"
        if spec.ps_mode == "hierarchical":
            raise UsageError("--ps-mode hierarchical runs its aggregators as ranks: launch it "
                             "under mpirun (refdl launch -n 7 ... --ps-groups 2)")  # fmt: skip
        if spec.devices != 1:
            raise UsageError("--simulate runs every worker on one device; drop --devices")
        workers = spec.workers or DEFAULT_SIMULATED_WORKERS
        if servers > workers:
            raise UsageError(
                f"--servers {servers} is more than the {workers} simulated workers; shards "
                f"beyond one per worker only add messages: use --servers <= {workers}"
            )
    elif "spmd" not in traits.modes:
        who, least = ("server and worker", "--servers + 1") if servers else ("worker", "2")
        raise UsageError(
            f"--strategy {strategy} needs {who} ranks: run it under mpirun -n N "
            f"(N >= {least}), or simulate it in one process with --simulate"
        )
    else:
        mode, workers = "spmd", spec.devices
    if spec.batch_size % (workers * m):
        raise UsageError(
            f"--batch-size {spec.batch_size} does not split into {workers} worker shares of "
            f"{m} microbatches; use a multiple of {workers * m}"
        )
    if servers > model.leaves:
        raise UsageError(
            f"--servers {servers}: the model has only {model.leaves} parameter arrays to "
            f"shard; use --servers <= {model.leaves}"
        )
    straggler = spec.straggler
    if straggler is not None:
        if mode not in traits.straggler_modes:
            raise UsageError("--straggler delays one rank of an mpirun job; launch under mpirun")
        lo = servers + groups  # ps: servers are ranks 0..K-1 (also when simulated)
        if not lo <= straggler.rank < lo + workers:
            raise UsageError(
                f"--straggler {spec.straggler}: rank {straggler.rank} is not a worker "
                f"(workers are ranks {lo}..{lo + workers - 1})"
            )
    mesh = MeshSpec(data=workers if mode == "spmd" else 1)
    return Plan(mesh, m, {}, "data", mode, workers=workers, servers=servers, groups=groups)


def check_groups(spec: RunSpec, ranks: int) -> int:
    """``--ps-mode hierarchical``: one server, ``G`` aggregators, ``G`` equal groups of
    learners in the rest of the ranks; returns ``G``."""
    g = spec.ps_groups or 0
    workers = ranks - spec.servers - g
    if spec.servers != 1:
        raise UsageError("--ps-mode hierarchical has one root server; drop --servers")
    if workers < g or workers % g:
        raise UsageError(
            f"--ps-groups {g} with {ranks} ranks leaves {workers} learners, not {g} equal "
            f"groups: launch 1 + {g} + a multiple of {g} ranks (e.g. -n {1 + 3 * g})"
        )
    return g
