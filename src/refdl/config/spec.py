"""``RunSpec``: one run's complete configuration (frozen), each field with its declared check.

Every field declares its value type (``refdl.config.values``) next to its
default, so no option exists without a check: ``validate()`` runs each field's
check and the few rules that tie fields together, without data or devices.
Which strategy accepts which option, degrees and divisibility are checked against
the strategy's declared traits, the model and the devices by ``refdl.config.plan``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from collections.abc import Iterator
from typing import Any

from refdl.config.batches import BatchSchedule
from refdl.config.choices import (
    ALLREDUCE,
    CONTEXT_ATTENTION,
    INIT_SCHEMES,
    LR_SCHEDULES,
    MUON_SCHEMES,
    OPTIMIZERS,
    ORDERS,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    PRESETS,
    PS_MODES,
    REMAT,
)
from refdl.config.codec import Compression
from refdl.config.mesh import MeshLayout, MeshSpec
from refdl.config.straggler import Straggler
from refdl.config.values import (
    Choice,
    Flag,
    Float,
    Int,
    Ints,
    Optional,
    Pairs,
    Parsed,
    Text,
    parse_typed,
)
from refdl.errors import UsageError, problems

# Options that only say how long and how loudly a run goes: a resumed run may change them.
# Every other field says how the run was started and must agree with the checkpoint's.
RUN_CONTROL_KEYS = (
    "steps",
    "out",
    "resume",
    "eval_every",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "progress",
    "timeout",
    "plot_schedule",
    "overwrite",
    "reshard",
)
# Settings that say where a run writes (or whether it may replace a run, or take another
# layout on resuming): taken from the command line only, never from a checkpoint, a recipe
# or any other file.
OUTPUT_KEYS = ("out", "resume", "overwrite", "plot_schedule", "reshard")
# Settings refused where they would change nothing, but kept by a run resumed with them.
NO_OP_KEYS = frozenset({"lr_decay_every", "lr_decay_factor", "momentum"})


# Whether a spec being made came from flags or a file (``from_dict``): its refusals then
# name flags; a library caller's ``RunSpec(...)`` is told its arguments (``as_arguments``).
FLAG_WORDS: contextvars.ContextVar[bool] = contextvars.ContextVar("flag_words", default=False)


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """While a command line is served, the specs made name flags when refused."""
    token = FLAG_WORDS.set(True)
    try:
        yield
    finally:
        FLAG_WORDS.reset(token)


def option(
    default: Any, value: Any, help: str = "", *, group: str = "", flag: str | None = None,
    metavar: str | None = None,
) -> Any:  # fmt: skip
    """A RunSpec field: its default, its declared value type, a one-line help and where the
    command line shows it (``refdl.config.cli`` makes every flag from these)."""
    meta = {"value": value, "help": help, "group": group, "flag": flag, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


def _section(group: str) -> Any:
    """``option`` for the fields of one section of ``--help``."""
    return functools.partial(option, group=group)


WHAT = _section("what to train")
OPTIMIZATION = _section("optimization")
DEVICES_GROUP, WORKERS_GROUP = (
    "devices and strategies",
    "parameter server and decentralized (also under mpirun)",
)
DEVICES = _section(DEVICES_GROUP)
WORKERS = _section(WORKERS_GROUP)
OUTPUT = _section("output")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A training run. ``lr``/``optimizer``/``dataset`` left ``None`` take the model's defaults."""

    strategy: str = WHAT("single", Text(), "parallelism strategy (see --list)")
    model: str = WHAT("lenet5", Text(), "model (see --list)")
    dataset: str | None = WHAT(
        None, Optional(Text()), "data set (default: the model's, digits for images)"
    )
    data_dir: str | None = WHAT(
        None, Optional(Text()), "folder the data set reads (mnist, cifar10, ptb, zarr)"
    )
    model_opts: tuple[tuple[str, str], ...] = WHAT(
        (), Pairs(), "model option, e.g. depth=20 or hidden=64 (repeatable)", flag="--model-opt"
    )
    data_opts: tuple[tuple[str, str], ...] = WHAT(
        (),
        Pairs(),
        "data set option, e.g. seq_len=32 or shape=cifar (repeatable)",
        flag="--data-opt",
    )
    steps: int = OPTIMIZATION(300, Int(min=1, max=10**9), "training steps")
    batch_size: int = OPTIMIZATION(64, Int(min=1, max=10**7), "global batch size")
    batch_schedule: BatchSchedule | None = OPTIMIZATION(  # noqa: RUF009 (field metadata)
        None,
        Optional(Parsed(BatchSchedule, "0:64,100:128")),
        "a growing global batch, STEP:BATCH,... from step 0 (0:64,100:128,200:256); the "
        "learning rate stays (default: --batch-size throughout)",
    )
    optimizer: str | None = OPTIMIZATION(
        None, Optional(Choice(OPTIMIZERS)), "optimizer (default: the model's)"
    )
    lr: float | None = OPTIMIZATION(
        None, Optional(Float(min=0.0, min_open=True)), "learning rate (default: the model's)"
    )
    momentum: float = OPTIMIZATION(
        0.9, Float(min=0.0, max=1.0, max_open=True), "momentum of momentum and nesterov"
    )
    weight_decay: float = OPTIMIZATION(0.0, Float(min=0.0), "L2 weight decay")
    lr_schedule: str = OPTIMIZATION("constant", Choice(LR_SCHEDULES), "learning-rate schedule")
    warmup_steps: int = OPTIMIZATION(0, Int(min=0, max=10**9), "linear warm-up steps")
    lr_decay_every: int = OPTIMIZATION(
        0, Int(min=0, max=10**9), "step schedule: decay every N steps"
    )
    lr_decay_factor: float = OPTIMIZATION(
        0.1, Float(min=0.0, max=1.0, min_open=True), "step schedule: factor"
    )
    loss: str = WHAT("cross_entropy", Text(), "loss: cross_entropy or squared")
    init: str = WHAT(
        "lecun_normal",
        Choice(INIT_SCHEMES),
        "initialisation: refdl's (lecun_normal) or torch's, keras' or mxnet's (a bare "
        "net.initialize()) default Dense/Conv draws, for comparing with their runs",
    )
    seed: int = OPTIMIZATION(0, Int(min=0, max=2**32 - 1), "seed of initialisation and data order")
    remat: str = OPTIMIZATION(
        "none",
        Choice(REMAT),
        "activation recomputation per layer: full keeps only each layer's input, selective "
        "also its matrix products' outputs",
    )
    precision: str = OPTIMIZATION(
        "fp32",
        Choice(PRECISIONS),
        "compute precision (bf16: fp32 master weights, loss, updates; fp64: everything in "
        "float64, JAX's 64-bit mode, for proofs of equivalence)",
    )
    devices: int = DEVICES(
        1,
        Int(min=1, max=1 << 16),
        "devices to use; on a CPU host, the number simulated (hybrid: 8 on a "
        "CPU host, every device on accelerators)",
    )
    mesh: MeshSpec | None = DEVICES(  # noqa: RUF009
        None,
        Optional(Parsed(MeshSpec, "data=2,model=4")),
        "mesh degrees, e.g. data=2,model=4 (-1 = the rest; default: all "
        "devices on the strategy's first axis)",
    )
    allreduce: str = DEVICES(
        "xla",
        Choice(ALLREDUCE),
        "data: allreduce algorithm; decentralized: sparse (top-k messages, CHOCO-SGD)",
    )
    sfb: str = DEVICES(
        "off",
        Choice(("off", "auto", "all")),
        "data: fully connected layers' gradients as sufficient factors (inputs and output "
        "gradients), per layer where fewer bytes (auto) or always (all)",
    )
    # Microbatches m per step (gradient accumulation; pipeline microbatches). A pipeline
    # of p stages idles (p-1)/(m+p-1) of its step (GPipe, 1F1B).
    microbatches: int | None = DEVICES(
        None,
        Optional(Int(min=1, max=1 << 16)),
        "gradient accumulation steps / pipeline microbatches (default: 4 for pipelines, else 1)",
    )
    compress: Compression | None = DEVICES(  # noqa: RUF009
        None,
        Optional(Parsed(Compression, "topk:0.01")),
        "data: gradient compression, topk:RATIO, qsgd:LEVELS, terngrad or sign; the "
        "quantizers take ,rounding=stochastic|nearest (default: none)",
    )
    zero: int = DEVICES(
        3,
        Int(min=1, max=3),
        "fsdp: ZeRO stage - 1 shards the optimizer state, 2 also the "
        "gradients, 3 also the parameters",
    )
    muon: str = DEVICES(
        "gather",
        Choice(MUON_SCHEMES),
        "fsdp with --optimizer muon: how a sharded matrix is orthogonalized - gather "
        "(every rank gathers it) or owner (one rank per matrix, results sent back)",
    )
    preset: str | None = DEVICES(
        None,
        Optional(Choice(PRESETS)),
        "hybrid: rules preset, owt = convolutions data-parallel, fully "
        "connected layers model-parallel (default: tensor rules)",
    )
    cp: str = DEVICES(
        "ring",
        Choice(CONTEXT_ATTENTION),
        "context: attention over the sequence pieces, ring (K/V around the ring) or "
        "all-to-all (Ulysses: heads for sequence)",
    )
    sequence_parallel: bool = DEVICES(
        False,
        Flag(),
        "model/hybrid: keep norms and residuals split along the sequence over model "
        "(Megatron sequence parallelism; transformer)",
    )
    stages: int | None = DEVICES(
        None,
        Optional(Int(min=1, max=1 << 16)),
        "pipeline: stages, one per device (default: --devices)",
    )
    schedule: str = DEVICES("1f1b", Choice(PIPELINE_SCHEDULES), "pipeline schedule")
    chunks: int = DEVICES(
        1, Int(min=1, max=256), "pipeline: model chunks per device for interleaved or looped-bfs"
    )
    stage_boundaries: tuple[int, ...] | None = DEVICES(
        None,
        Optional(Ints(min=1, max=1 << 20, like="2,5")),
        "pipeline: layer indices where stages start (default: balanced by parameter count)",
        metavar="I,J,...",
    )
    plot_schedule: str | None = DEVICES(
        None,
        Optional(Text()),
        "pipeline: draw the last executed step's timeline as a Gantt chart (default: none)",
        metavar="FILE.png",
    )
    ps_mode: str = WORKERS("sync", Choice(PS_MODES), "ps: consistency")
    servers: int = WORKERS(1, Int(min=1, max=1 << 16), "ps: server ranks holding parameter shards")
    ps_groups: int | None = WORKERS(
        None,
        Optional(Int(min=1, max=1 << 10)),
        "ps hierarchical: learner groups, each behind an aggregator rank (default: none)",
    )
    softsync_n: int | None = WORKERS(
        None,
        Optional(Int(min=1, max=1 << 10)),
        "ps softsync: update after every W/N gradients (1: as sync, W: as async)",
    )
    staleness: int | None = WORKERS(
        None,
        Optional(Int(min=0, max=10**6)),
        "ps ssp: no worker runs more than S steps ahead (default: none; ssp needs it)",
    )
    simulate: bool = WORKERS(False, Flag(), "ps/decentralized: every worker in this process")
    workers: int | None = WORKERS(
        None, Optional(Int(min=1, max=1024)), "--simulate: number of workers (default 4)"
    )
    ps_trace: str | None = WORKERS(
        None, Optional(Text()), "--simulate: replay this recorded arrival order (ps; default: none)"
    )
    topology: str = WORKERS(
        "ring", Text(), "decentralized: ring, torus, exp2, complete or a 0/1 adjacency file"
    )
    order: str = WORKERS(
        "atc", Choice(ORDERS), "decentralized: adapt-then-combine (atc) or combine-then-adapt"
    )
    gossip: bool = WORKERS(False, Flag(), "decentralized: random pairwise gossip per step")
    consensus_step: float | None = WORKERS(
        None,
        Optional(Float(min=0.0, max=1.0, min_open=True)),
        "decentralized --allreduce sparse: CHOCO-SGD's consensus step gamma (default 0.1)",
    )
    straggler: Straggler | None = WORKERS(  # noqa: RUF009
        None,
        Optional(Parsed(Straggler, "1:0.05")),
        "delay one worker's every step (default: none)",
        metavar="RANK:SECONDS",
    )
    timeout: float = WORKERS(
        300.0,
        Float(min=0.0, min_open=True, max=1e7),
        "under mpirun: seconds without progress before every rank aborts",
    )
    out: str | None = OUTPUT(None, Optional(Text()), "run folder (default runs/<timestamp>/)")
    resume: str | None = OUTPUT(
        None, Optional(Text()), "a run folder or checkpoint to continue from (default: none)"
    )
    eval_every: int = OUTPUT(100, Int(min=0, max=10**9), "evaluate every N steps (0 = at the end)")
    log_every: int = OUTPUT(10, Int(min=0, max=10**9), "metrics.jsonl row every N steps")
    checkpoint_every: int = OUTPUT(100, Int(min=0, max=10**9), "checkpoint every N steps")
    keep_checkpoints: int = OUTPUT(3, Int(min=1, max=10**6), "checkpoints kept")
    progress: bool = OUTPUT(
        True,
        Flag(),
        "no progress output (default: a bar on a terminal, else a line every 10 s)",
        flag="--no-progress",
    )
    overwrite: bool = OUTPUT(
        False, Flag(), "replace an --out folder that holds another run (never needed for --resume)"
    )
    reshard: bool = OUTPUT(
        False,
        Flag(),
        "with --resume: continue under another synchronous strategy, mesh or device count",
    )

    def __post_init__(self) -> None:
        """Parse the settings given as text (a mesh, a batch schedule, a codec, a straggler)
        into their types, once, then check everything: a RunSpec that exists is valid."""
        try:
            if isinstance(self.mesh, str):  # the devices resolve a -1
                object.__setattr__(self, "mesh", MeshLayout.parse(self.mesh).on(self.devices))
            parse_typed(self, skip=("mesh",))
            self.validate()
        except UsageError as e:  # a library caller is told the argument, not the flag
            if FLAG_WORDS.get():
                raise
            raise UsageError(as_arguments(str(e))) from None

    def validate(self) -> RunSpec:
        """Check every field against its declared value, then the rules that tie fields
        together; return self. Needs neither data nor devices (the constructor calls it)."""
        found = [(f, f.metadata["value"].problem(getattr(self, f.name)))
                    for f in dataclasses.fields(self)]  # fmt: skip
        bad = [f"{f.metadata.get('flag') or flag(f.name)} must be {problem}"
               for f, problem in found if problem]  # fmt: skip
        if bad:  # every field's mistake at once
            raise problems(bad)
        if self.warmup_steps > self.steps:
            raise UsageError(
                f"--warmup-steps {self.warmup_steps} is beyond --steps {self.steps}: the "
                "learning rate would never reach --lr; lower --warmup-steps or raise --steps"
            )
        if self.lr_schedule == "step" and self.lr_decay_every <= 0:
            raise UsageError("--lr-schedule step needs --lr-decay-every N with N > 0")
        off = {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}
        # A resumed run keeps its own settings (the flags given again must equal them), so
        # a setting that changes nothing and is refused for new runs since 2026-11-28
        # (this one, momentum beside Adam, a folder for a built-in data set, a pipeline's
        # options without stages) is its own, and the run continues as it was started.
        if self.resume:
            off -= NO_OP_KEYS
        decay = sorted(k for k in off if k.startswith("lr_decay_"))
        if decay and self.lr_schedule != "step":  # they would change nothing
            raise UsageError(f"{flag(decay[0])} sets the step schedule's decay; add "
                             "--lr-schedule step, or drop it")  # fmt: skip
        if "momentum" in off and self.optimizer not in (None, "momentum", "nesterov"):
            raise UsageError(f"--momentum sets the heavy ball of --optimizer momentum and "
                             f"--optimizer nesterov; --optimizer {self.optimizer} has none "
                             "(Muon's is its own, 0.95): drop --momentum")  # fmt: skip
        if self.muon != "gather" and self.optimizer != "muon":
            raise UsageError(f"--muon {self.muon} is a scheme of --optimizer muon; add it")
        if self.ps_mode == "ssp" and self.staleness is None:
            raise UsageError("--ps-mode ssp needs --staleness S (the bound, S >= 0)")
        if (self.ps_mode == "hierarchical") != (self.ps_groups is not None):
            raise UsageError("--ps-mode hierarchical and --ps-groups G go together (G learner "
                             "groups, each behind an aggregator rank)")  # fmt: skip
        if (self.ps_mode == "softsync") != (self.softsync_n is not None):
            raise UsageError("--ps-mode softsync and --softsync-n N go together (the server "
                             "updates after every W/N gradients)")  # fmt: skip
        if self.staleness is not None and self.ps_mode != "ssp":
            raise UsageError("--staleness is the bound of --ps-mode ssp; add --ps-mode ssp")
        if self.workers is not None and not self.simulate:
            raise UsageError(
                "--workers sets the simulated worker count: add --simulate (under mpirun the "
                "ranks are the workers)"
            )
        if self.batch_schedule is not None:  # (a run rebuilt for a later size holds it)
            sizes = self.batch_schedule.sizes
            if self.batch_size not in sizes:
                raise UsageError(
                    f"--batch-schedule starts at batch {sizes[0]} but --batch-size is "
                    f"{self.batch_size}: drop --batch-size (the schedule sets it) or make "
                    "them agree"
                )
        if self.reshard and not self.resume:
            raise UsageError("--reshard continues a checkpoint on another layout: add --resume RUN")
        if self.ps_trace is not None and not self.simulate:
            raise UsageError("--ps-trace replays a recorded run in the simulator: add --simulate")
        if self.mesh is not None and self.mesh.size != self.devices:
            raise UsageError(
                f"--mesh {self.mesh!s} multiplies to {self.mesh.size} devices but --devices "
                f"is {self.devices}; make the degrees multiply to {self.devices} (or use -1 "
                "for one axis)"
            )
        return self

    def given(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what the user set), as ``to_dict``
        writes them."""
        plain = self.to_dict()
        return {f.name: plain[f.name] for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The settings in their own words (JSON-ready): the typed ones as their text."""
        return {f.name: _text(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "the configuration") -> RunSpec:
        """The inverse of ``to_dict``; unknown keys are ignored (specs only grow). The spec
        is checked as it is made (``__post_init__``); a batch schedule given without a
        batch size sets it (its first)."""
        kw = cls.settings(d, where)
        with command_line():  # settings in a command line's or a file's words
            if isinstance(kw.get("batch_schedule"), str) and "batch_size" not in kw:
                kw["batch_schedule"] = BatchSchedule.parse(kw["batch_schedule"])
                kw["batch_size"] = kw["batch_schedule"].size_at(0)
            return cls(**kw)

    @classmethod
    def settings(cls, d: dict[str, Any], where: str = "the configuration") -> dict[str, Any]:
        """The RunSpec fields of a table of settings (a file, a flag set), lists as tuples;
        not checked yet (a mesh is checked against the devices the run will have)."""
        if not isinstance(d, dict):
            raise UsageError(f"{where}: not a table of settings")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        try:
            for key in ("model_opts", "data_opts"):
                if key in kw and isinstance(kw[key], list):
                    kw[key] = tuple(tuple(p) if isinstance(p, list) else p for p in kw[key])
            if isinstance(kw.get("stage_boundaries"), list):
                kw["stage_boundaries"] = tuple(kw["stage_boundaries"])
        except TypeError:
            raise UsageError(f"{where}: malformed model_opts/data_opts") from None
        return kw


def _text(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return str(value)
    if isinstance(value, tuple):
        return tuple(_text(v) for v in value)
    return value


def flag(name: str) -> str:
    """The command-line flag of a RunSpec field (``batch_size`` -> ``--batch-size``)."""
    return "--" + name.replace("_", "-")


def parse_pairs(items: list[str] | None, flag_name: str) -> tuple[tuple[str, str], ...]:
    """``["depth=20", "width=16"]`` -> ``(("depth", "20"), ("width", "16"))``."""
    out = []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag_name} takes KEY=VALUE (got {item!r})")
        given = dict(out)
        if key.strip() in given:  # one would silently win
            raise UsageError(f"{flag_name} gives {key.strip()} twice ({given[key.strip()]}, "
                             f"{value.strip()}); give it once")  # fmt: skip
        out.append((key.strip(), value.strip()))
    return tuple(out)


# What ``--reshard`` may change when resuming: where and how the state is split (the
# strategy, its devices and mesh, the synchronous strategies' options) and recomputation.
# Everything else says what is trained and how (a compression codec, a parameter server's
# or a graph's settings included), and must agree with the checkpoint's.
LAYOUT_KEYS = ("strategy", "remat", "devices", "mesh", "allreduce", "sfb", "microbatches",
               "zero", "muon", "preset", "cp", "sequence_parallel", "stages", "schedule", "chunks",
               "stage_boundaries")  # fmt: skip


_WORDS = {
    "is",
    "must",
    "needs",
    "takes",
    "does",
    "has",
    "sets",
    "replays",
    "runs",
    "uses",
    "was",
    "would",
    "of",
    "and",
    "or",
    "to",
    "with",
    "in",
    "on",
    "not",
    "a",
    "the",
}
_FLAG = re.compile(r"--([a-z][a-z0-9-]*)(?: ([^\s;:,()]+))?")


def as_arguments(message: str) -> str:
    """A CLI-shaped message in a library caller's words: each RunSpec flag becomes its
    argument (``--out runs/a`` -> ``out='runs/a'``, ``--overwrite`` -> ``overwrite=True``);
    other text is kept."""
    fields = {f.name: f.metadata["value"] for f in dataclasses.fields(RunSpec)}

    def arg(m: re.Match) -> str:
        name, value = m.group(1).replace("-", "_"), m.group(2)
        if name not in fields:
            return m.group(0)
        if isinstance(fields[name], Flag):
            return f"{name}=True" + (f" {value}" if value else "")
        if value and value not in _WORDS:
            try:
                parsed = fields[name].parse(value)
                shown = value if dataclasses.is_dataclass(parsed) else parsed
                return f"{name}={shown!r}"
            except ValueError:
                pass
        return name + (f" {value}" if value else "")

    return _FLAG.sub(arg, message)
