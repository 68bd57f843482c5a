"""``RunSpec``: one run's complete configuration (frozen), each field with its declared check.

Every field declares its value type (``refdl.config.values``) next to its
default, so no option exists without a check: ``validate()`` runs each field's
check and the few rules that tie fields together, without data or devices.
Which strategy accepts which option, degrees and divisibility are checked once
more, against the model and the devices, by ``refdl.config.checks``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from typing import Any

from refdl.config.choices import (
    ALLREDUCE,
    INIT_SCHEMES,
    LR_SCHEDULES,
    OPTIMIZERS,
    ORDERS,
    PIPELINE_SCHEDULES,
    PRESETS,
    PS_MODES,
)
from refdl.config.mesh import MeshSpec
from refdl.config.values import Choice, Flag, Float, Int, Ints, Optional, Pairs, Text
from refdl.errors import UsageError

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
)
# Settings that say where a run writes (or whether it may replace a run): taken from the
# command line only, never from a checkpoint, a recipe or any other file.
OUTPUT_KEYS = ("out", "resume", "overwrite", "plot_schedule")


def option(default: Any, value: Any, help: str = "") -> Any:
    """A RunSpec field: its default, its declared value type and a one-line help."""
    return dataclasses.field(default=default, metadata={"value": value, "help": help})


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A training run. ``lr``/``optimizer``/``dataset`` left ``None`` take the model's defaults."""

    strategy: str = option("single", Text(), "parallelism strategy")
    model: str = option("lenet5", Text(), "model")
    dataset: str | None = option(None, Optional(Text()), "data set (default: the model's)")
    data_dir: str | None = option(None, Optional(Text()), "folder the data set reads")
    model_opts: tuple[tuple[str, str], ...] = option((), Pairs(), "model options")
    data_opts: tuple[tuple[str, str], ...] = option((), Pairs(), "data set options")
    steps: int = option(300, Int(min=1, max=10**9), "training steps")
    batch_size: int = option(64, Int(min=1, max=10**7), "global batch size")
    optimizer: str | None = option(None, Optional(Choice(OPTIMIZERS)), "optimizer")
    lr: float | None = option(None, Optional(Float(min=0.0, min_open=True)), "learning rate")
    momentum: float = option(0.9, Float(min=0.0, max=1.0, max_open=True), "momentum")
    weight_decay: float = option(0.0, Float(min=0.0), "L2 weight decay")
    lr_schedule: str = option("constant", Choice(LR_SCHEDULES), "learning-rate schedule")
    warmup_steps: int = option(0, Int(min=0, max=10**9), "linear warm-up steps")
    lr_decay_every: int = option(0, Int(min=0, max=10**9), "step schedule: decay period")
    lr_decay_factor: float = option(
        0.1, Float(min=0.0, max=1.0, min_open=True), "step schedule: factor"
    )
    loss: str = option("cross_entropy", Text(), "loss")
    init: str = option(
        "lecun_normal", Choice(INIT_SCHEMES), "initialisation: refdl's or a framework's default"
    )
    seed: int = option(0, Int(min=0, max=2**32 - 1), "seed of initialisation and data order")
    devices: int = option(1, Int(min=1, max=1 << 16), "devices (simulated on a CPU host)")
    mesh: str | None = option(None, Optional(Text()), "mesh degrees, e.g. data=2,model=4")
    allreduce: str = option("xla", Choice(ALLREDUCE), "data: allreduce algorithm")
    # Microbatches m per step (gradient accumulation; pipeline microbatches). A pipeline
    # of p stages idles (p-1)/(m+p-1) of its step (GPipe, 1F1B); default 4 for pipelines.
    microbatches: int | None = option(None, Optional(Int(min=1, max=1 << 16)), "microbatches")
    compress: str | None = option(None, Optional(Text()), "data: gradient compression")
    zero: int = option(
        3, Int(min=1, max=3), "fsdp: ZeRO stage (1 optimizer state, 2 + gradients, 3 + parameters)"
    )
    preset: str | None = option(None, Optional(Choice(PRESETS)), "hybrid: rules preset")
    stages: int | None = option(None, Optional(Int(min=1, max=1 << 16)), "pipeline stages")
    schedule: str = option("1f1b", Choice(PIPELINE_SCHEDULES), "pipeline schedule")
    chunks: int = option(1, Int(min=1, max=256), "pipeline: chunks per device")
    stage_boundaries: tuple[int, ...] | None = option(
        None, Optional(Ints(min=1, max=1 << 20)), "pipeline: layer indices where stages start"
    )
    plot_schedule: str | None = option(None, Optional(Text()), "pipeline: Gantt chart file")
    # Parameter server (ps) and decentralized training.
    ps_mode: str = option("sync", Choice(PS_MODES), "ps: consistency")
    servers: int = option(1, Int(min=1, max=1 << 16), "ps: server ranks")
    staleness: int | None = option(None, Optional(Int(min=0, max=10**6)), "ps ssp: bound S")
    simulate: bool = option(False, Flag(), "ps/decentralized: every worker in one process")
    workers: int | None = option(None, Optional(Int(min=1, max=1024)), "simulated workers")
    ps_trace: str | None = option(None, Optional(Text()), "ps: replay this arrival order")
    topology: str = option("ring", Text(), "decentralized: graph or adjacency file")
    order: str = option("atc", Choice(ORDERS), "decentralized: atc or cta")
    gossip: bool = option(False, Flag(), "decentralized: randomized pairwise gossip")
    straggler: str | None = option(None, Optional(Text()), "RANK:SECONDS delay per step")
    timeout: float = option(
        300.0, Float(min=0.0, min_open=True, max=1e7), "seconds without progress (mpirun)"
    )
    out: str | None = option(None, Optional(Text()), "run folder")
    resume: str | None = option(None, Optional(Text()), "run folder or checkpoint")
    eval_every: int = option(100, Int(min=0, max=10**9), "evaluate every N steps")
    log_every: int = option(10, Int(min=0, max=10**9), "metrics row every N steps")
    checkpoint_every: int = option(100, Int(min=0, max=10**9), "checkpoint every N steps")
    keep_checkpoints: int = option(3, Int(min=1, max=10**6), "checkpoints kept")
    progress: bool = option(True, Flag(), "progress bar")
    overwrite: bool = option(False, Flag(), "replace a run folder holding another run")

    def validate(self) -> RunSpec:
        """Check every field against its declared value, then the rules that tie fields
        together; return self. Needs neither data nor devices."""
        for f in dataclasses.fields(self):
            problem = f.metadata["value"].problem(getattr(self, f.name))
            if problem:
                raise UsageError(f"{flag(f.name)} must be {problem}")
        if self.warmup_steps > self.steps:
            raise UsageError(
                f"--warmup-steps {self.warmup_steps} is beyond --steps {self.steps}: the "
                "learning rate would never reach --lr; lower --warmup-steps or raise --steps"
            )
        if self.lr_schedule == "step" and self.lr_decay_every <= 0:
            raise UsageError("--lr-schedule step needs --lr-decay-every N with N > 0")
        if self.ps_mode == "ssp" and self.staleness is None:
            raise UsageError("--ps-mode ssp needs --staleness S (the bound, S >= 0)")
        if self.staleness is not None and self.ps_mode != "ssp":
            raise UsageError("--staleness is the bound of --ps-mode ssp; add --ps-mode ssp")
        if self.workers is not None and not self.simulate:
            raise UsageError(
                "--workers sets the simulated worker count: add --simulate (under mpirun the "
                "ranks are the workers)"
            )
        if self.ps_trace is not None and not self.simulate:
            raise UsageError("--ps-trace replays a recorded run in the simulator: add --simulate")
        straggler_of(self.straggler)
        if self.mesh is not None:
            MeshSpec.parse(self.mesh, self.devices)
        return self

    @property
    def pipe_degree(self) -> int:
        """Pipeline stages this spec asks for (1 when it is not a pipeline)."""
        if self.strategy == "pipeline":
            return self.stages or self.devices
        if self.strategy == "hybrid" and self.mesh and "pipe" in self.mesh:
            return MeshSpec.parse(self.mesh, self.devices).pipe
        return 1

    def with_microbatches(self) -> RunSpec:
        """``microbatches`` filled: 4 for pipelines, else 1."""
        if self.microbatches is not None:
            return self
        return dataclasses.replace(self, microbatches=4 if self.pipe_degree > 1 else 1)

    def given(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what the user set)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples of pairs become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "the configuration") -> RunSpec:
        """The inverse of ``to_dict``; unknown keys are ignored (specs only grow). Lists
        become tuples; call ``validate`` before trusting the values."""
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
        return cls(**kw)


def flag(name: str) -> str:
    """The command-line flag of a RunSpec field (``batch_size`` -> ``--batch-size``)."""
    return "--" + name.replace("_", "-")


def straggler_of(text: str | None) -> tuple[int, float] | None:
    """``"2:0.05"`` -> ``(2, 0.05)``: the rank (or simulated worker) and its delay per step."""
    if text is None:
        return None
    rank, sep, secs = str(text).partition(":")
    try:
        out = (int(rank), float(secs))
    except ValueError:
        out = None
    if not sep or out is None or out[0] < 0 or not (0 <= out[1] <= 3600 and math.isfinite(out[1])):
        raise UsageError(f"--straggler takes RANK:SECONDS, e.g. 1:0.05 (got {text!r})")
    return out


def parse_pairs(items: list[str] | None, flag_name: str) -> tuple[tuple[str, str], ...]:
    """``["depth=20", "width=16"]`` -> ``(("depth", "20"), ("width", "16"))``."""
    out = []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag_name} takes KEY=VALUE (got {item!r})")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def differing(saved: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """The keys ``given`` sets that say how a run was started and differ from ``saved``."""
    out = []
    for key, value in given.items():
        if key in RUN_CONTROL_KEYS or key not in saved:
            continue
        if _norm(value) != _norm(saved[key]):
            out.append(key)
    return out


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
                return f"{name}={fields[name].parse(value)!r}"
            except ValueError:
                pass
        return name + (f" {value}" if value else "")

    return _FLAG.sub(arg, message)


def config_key(settings: dict[str, Any]) -> str:
    """A short hash of the settings that say how a run was started (not how long or how
    loudly it runs; fields at their defaults left out, so it survives new fields): two
    runs continue each other's checkpoints only when their keys are equal."""
    defaults = {f.name: f.default for f in dataclasses.fields(RunSpec)}
    kept = {k: _norm(v) for k, v in settings.items()
            if k not in RUN_CONTROL_KEYS and _norm(v) != _norm(defaults.get(k, ...))}  # fmt: skip
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _norm(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return [_norm(x) for x in v]
    return v
