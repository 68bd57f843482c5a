"""``Request``: one ``refdl validate`` comparison, typed, as its command line gave it.

The CLI (``refdl.validate.__main__``) parses flags into a Request; the library
(``exact``, ``asynchronous``, ``results``) reads its fields and never an argparse
namespace. The mesh is parsed once here (``MeshLayout``), the rest are plain values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from refdl.config.mesh import MeshLayout
from refdl.config.values import Optional, Parsed, parse_typed

# The strategies' options refdl validate takes as refdl train does (the same RunSpec fields).
SPEC_OPTIONS = ("zero", "mesh", "sequence_parallel", "chunks", "cp", "topology")


@dataclasses.dataclass(frozen=True)
class Request:
    """The framework, the strategy and model compared, refdl's settings for them, and how
    the comparison is judged (tolerances, seeds) or read (a framework's log)."""

    framework: str = "torch"
    strategy: str = "single"
    ps_mode: str = "sync"
    model: str = "lenet5"
    steps: int | None = None
    workers: int | None = None
    devices: int | None = None
    batch_size: int = 64
    microbatches: int | None = None
    schedule: str = "1f1b"
    optimizer: str | None = None
    lr: float | None = None
    dataset: str | None = None
    seed: int = 0
    precision: str = "fp32"
    # the strategies' options refdl train has (``SPEC_OPTIONS``), None where not given
    zero: int | None = None
    mesh: MeshLayout | None = dataclasses.field(
        default=None, metadata={"value": Optional(Parsed(MeshLayout, "data=2,model=2"))}
    )
    sequence_parallel: bool | None = None
    chunks: int | None = None
    cp: str | None = None
    topology: str | None = None
    # the comparison
    param_rtol: float | None = None
    loss_rtol: float | None = None
    first_step_rtol: float | None = None
    plant_bug: str | None = None
    perturb: float = 0.0
    torch_batchnorm: str = "composite"
    torch_muon_ns: str = "bf16"  # torch.optim.Muon's Newton-Schulz as shipped, or native
    timeout: float = 600.0
    # --results: a framework's log judged against refdl's prediction and seeds
    results: str | None = None
    hw: str = "local"
    seeds: int = 10
    config: str | None = None
    set: tuple[str, ...] | None = None
    scalars: str | None = None
    seed_cache: str | None = None

    def __post_init__(self) -> None:
        parse_typed(self)

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> Request:
        """The request from a table of the flags' values (unknown keys ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in given.items() if k in names}
        if isinstance(kw.get("set"), list):
            kw["set"] = tuple(kw["set"])
        return cls(**kw)

    def spec_options(self) -> dict[str, Any]:
        """The strategies' options given (as refdl train takes them: the mesh as its text)."""
        names = ("zero", "mesh", "sequence_parallel", "chunks", "cp", "topology")
        return {k: (str(v) if k == "mesh" else v) for k in names
                if (v := getattr(self, k)) is not None}  # fmt: skip
