"""``RunSpec``: one run's complete, validated configuration (frozen).

Built from CLI flags (or a dict), validated once, here, with errors that say
what to change. Everything downstream trusts it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from refdl.core.optim import OPTIMIZERS, SCHEDULES
from refdl.errors import UsageError
from refdl.mesh import MeshSpec

# Settings that define the trajectory: resuming with a different value is an error.
TRAJECTORY_KEYS = (
    "model",
    "dataset",
    "data_dir",
    "model_opts",
    "data_opts",
    "batch_size",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "lr_schedule",
    "warmup_steps",
    "lr_decay_every",
    "lr_decay_factor",
    "loss",
    "seed",
    "compress",
)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A training run. ``lr``/``optimizer``/``dataset`` left ``None`` take the model's defaults."""

    strategy: str = "single"
    model: str = "lenet5"
    dataset: str | None = None
    data_dir: str | None = None
    model_opts: tuple[tuple[str, str], ...] = ()
    data_opts: tuple[tuple[str, str], ...] = ()
    steps: int = 300
    batch_size: int = 64
    optimizer: str | None = None
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    lr_decay_every: int = 0
    lr_decay_factor: float = 0.1
    loss: str = "cross_entropy"
    seed: int = 0
    devices: int = 1
    mesh: str | None = None
    allreduce: str = "xla"
    # Microbatches m per step (gradient accumulation; pipeline microbatches). A pipeline
    # of p stages idles (p-1)/(m+p-1) of its step (GPipe, 1F1B); default 4 for pipelines.
    microbatches: int | None = None
    compress: str | None = None
    preset: str | None = None
    stages: int | None = None
    schedule: str = "1f1b"
    chunks: int = 1
    stage_boundaries: tuple[int, ...] | None = None
    plot_schedule: str | None = None
    # Parameter server (ps) and decentralized training.
    ps_mode: str = "sync"  # sync | async | ssp
    servers: int = 1
    staleness: int | None = None  # ssp bound S
    simulate: bool = False  # run ps/decentralized workers in one process, deterministically
    workers: int | None = None  # --simulate: number of workers (default 4)
    ps_trace: str | None = None  # --simulate: replay this recorded arrival order
    topology: str = "ring"  # ring | torus | exp2 | complete | PATH (adjacency file)
    order: str = "atc"  # atc (adapt-then-combine) | cta (combine-then-adapt, D-PSGD)
    gossip: bool = False  # randomized pairwise gossip instead of full neighbour averaging
    straggler: str | None = None  # RANK:SECONDS, delay one worker's every step
    timeout: float = 300.0  # under mpirun: seconds without progress before every rank aborts
    out: str | None = None
    resume: str | None = None
    eval_every: int = 100
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    progress: bool = True

    def with_model_defaults(self) -> RunSpec:
        """Fill ``dataset``, ``optimizer`` and ``lr`` from the model's recipe where unset."""
        from refdl.models import MODELS

        d = MODELS.get(self.model).defaults
        microbatches = self.microbatches
        if microbatches is None:  # pipelines default to 4 microbatches, everything else to 1
            piped = self.strategy == "pipeline" or (
                self.strategy == "hybrid"
                and self.mesh
                and "pipe" in self.mesh
                and MeshSpec.parse(self.mesh, self.devices).pipe > 1
            )
            microbatches = 4 if piped else 1
        return dataclasses.replace(
            self,
            microbatches=microbatches,
            dataset=self.dataset or d.get("dataset", "digits"),
            optimizer=self.optimizer or d.get("optimizer", "sgd"),
            lr=self.lr if self.lr is not None else d.get("lr", 0.01),
        )

    def validate(self) -> RunSpec:
        """Check every field that can be checked without data or devices; return self."""
        from refdl.core.losses import LOSSES
        from refdl.data import DATASETS
        from refdl.models import MODELS
        from refdl.strategies import STRATEGIES

        STRATEGIES.get(self.strategy)
        MODELS.get(self.model)
        LOSSES.get(self.loss)
        if self.dataset is not None:
            DATASETS.get(self.dataset)
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise UsageError(
                f"unknown --optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}"
            )
        if self.lr_schedule not in SCHEDULES:
            raise UsageError(
                f"unknown --lr-schedule {self.lr_schedule!r}; choose one of: {', '.join(SCHEDULES)}"
            )
        positive = {"steps": self.steps, "batch_size": self.batch_size, "devices": self.devices}
        for name, value in positive.items():
            if value <= 0:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be > 0 (got {value})")
        nonneg = {
            "eval_every": self.eval_every,
            "log_every": self.log_every,
            "checkpoint_every": self.checkpoint_every,
            "warmup_steps": self.warmup_steps,
            "weight_decay": self.weight_decay,
        }
        for name, value in nonneg.items():
            if value < 0:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be >= 0 (got {value})")
        if self.stages is not None and self.stages < 1:
            raise UsageError(f"--stages must be >= 1 (got {self.stages})")
        if self.chunks < 1:
            raise UsageError(f"--chunks must be >= 1 (got {self.chunks})")
        from refdl.pipeline.schedule import SCHEDULES as PIPELINE_SCHEDULES

        if self.schedule not in PIPELINE_SCHEDULES:
            raise UsageError(
                f"unknown --schedule {self.schedule!r}; "
                f"choose one of: {', '.join(PIPELINE_SCHEDULES)}"
            )
        if self.plot_schedule and self.strategy not in ("pipeline", "hybrid"):
            raise UsageError(
                "--plot-schedule draws a pipeline schedule: use --strategy pipeline (or hybrid "
                "with pipe > 1)"
            )
        if self.microbatches < 1:
            raise UsageError(f"--microbatches must be >= 1 (got {self.microbatches})")
        from refdl.comm.allreduce import ALGORITHMS

        if self.allreduce not in ALGORITHMS:
            raise UsageError(
                f"unknown --allreduce {self.allreduce!r}; choose one of: {', '.join(ALGORITHMS)}"
            )
        if self.keep_checkpoints < 1:
            raise UsageError(f"--keep-checkpoints must be >= 1 (got {self.keep_checkpoints})")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be a finite number > 0 (got {self.lr})")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1) (got {self.momentum})")
        self._validate_distributed()
        if self.lr_schedule == "step" and self.lr_decay_every <= 0:
            raise UsageError("--lr-schedule step needs --lr-decay-every N with N > 0")
        return self

    def make_optimizer(self, updates_per_step: int = 1) -> Any:
        """The run's optax optimizer and its learning-rate schedule; with
        ``updates_per_step`` > 1 (asynchronous parameter servers) the schedule advances
        once per that many updates, i.e. once per step of the loop."""
        from refdl.core.optim import make_optimizer, make_schedule

        base = make_schedule(
            self.lr,
            self.lr_schedule,
            total_steps=self.steps,
            warmup_steps=self.warmup_steps,
            decay_every=self.lr_decay_every,
            decay_factor=self.lr_decay_factor,
        )
        schedule = base if updates_per_step == 1 else (lambda n: base(n // updates_per_step))
        optimizer = make_optimizer(
            self.optimizer, schedule, momentum=self.momentum, weight_decay=self.weight_decay
        )
        return optimizer, base

    def _validate_distributed(self) -> None:
        """The ps/decentralized flags: values, and that they go with their strategy."""
        if self.ps_mode not in ("sync", "async", "ssp"):
            raise UsageError(f"unknown --ps-mode {self.ps_mode!r}; choose one of: sync, async, ssp")
        if self.staleness is not None and self.staleness < 0:
            raise UsageError(f"--staleness must be >= 0 (got {self.staleness})")
        if self.ps_mode == "ssp" and self.staleness is None:
            raise UsageError("--ps-mode ssp needs --staleness S (the bound, S >= 0)")
        if self.staleness is not None and self.ps_mode != "ssp":
            raise UsageError("--staleness is the bound of --ps-mode ssp; add --ps-mode ssp")
        if self.servers < 1:
            raise UsageError(f"--servers must be >= 1 (got {self.servers})")
        if self.workers is not None and self.workers < 1:
            raise UsageError(f"--workers must be >= 1 (got {self.workers})")
        if self.timeout <= 0:
            raise UsageError(f"--timeout must be > 0 seconds (got {self.timeout})")
        if self.order not in ("atc", "cta"):
            raise UsageError(f"unknown --order {self.order!r}; choose atc or cta")
        ps_only = {
            "ps_mode": self.ps_mode != "sync",
            "servers": self.servers != 1,
            "ps_trace": self.ps_trace is not None,
        }
        dec_only = {
            "topology": self.topology != "ring",
            "order": self.order != "atc",
            "gossip": self.gossip,
        }
        for names, strategy in ((ps_only, "ps"), (dec_only, "decentralized")):
            for key, given in names.items():
                if given and self.strategy != strategy:
                    flag = "--" + key.replace("_", "-")
                    raise UsageError(f"{flag} is an option of --strategy {strategy}")
        if (self.simulate or self.workers is not None) and self.strategy not in (
            "ps",
            "decentralized",
        ):
            raise UsageError("--simulate and --workers are for --strategy ps or decentralized")
        if self.workers is not None and not self.simulate:
            raise UsageError(
                "--workers sets the simulated worker count: add --simulate (under mpirun the "
                "ranks are the workers)"
            )
        if self.ps_trace is not None and not self.simulate:
            raise UsageError("--ps-trace replays a recorded run in the simulator: add --simulate")
        if self.straggler is not None:
            straggler_of(self.straggler)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples of pairs become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        """The inverse of ``to_dict``; unknown keys are ignored (specs only grow)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for key in ("model_opts", "data_opts"):
            if key in kw:
                kw[key] = tuple(tuple(p) for p in kw[key])
        if kw.get("stage_boundaries") is not None:
            kw["stage_boundaries"] = tuple(kw["stage_boundaries"])
        return cls(**kw)


def straggler_of(text: str | None) -> tuple[int, float] | None:
    """``"2:0.05"`` -> ``(2, 0.05)``: the rank (or simulated worker) and its delay per step."""
    if text is None:
        return None
    rank, sep, secs = str(text).partition(":")
    try:
        out = (int(rank), float(secs))
    except ValueError:
        out = None
    if not sep or out is None or out[0] < 0 or not (out[1] >= 0 and math.isfinite(out[1])):
        raise UsageError(f"--straggler takes RANK:SECONDS, e.g. 1:0.05 (got {text!r})")
    return out


def parse_pairs(items: list[str] | None, flag: str) -> tuple[tuple[str, str], ...]:
    """``["depth=20", "width=16"]`` -> ``(("depth", "20"), ("width", "16"))``."""
    out = []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} takes KEY=VALUE (got {item!r})")
        out.append((key.strip(), value.strip()))
    return tuple(out)
