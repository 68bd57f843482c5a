"""Collective stacks by generation (``stacks.toml``): which software moved the bytes.

A library's own name (``nccl``, ``mpi``, ``gloo``) is its current stack: each profile's
``[achieved.links.<library>]`` figures, fitted per machine to nccl-tests, OSU and gloo
runs of 2019 on (2017 for gloo). A **dated stack** (``nccl-2.0-mpi``: NCCL 2.0 with one
MPI process per GPU, as DeepBench ran it in 2017) carries its own latency and fraction of
line rate, fitted by ``scripts/fit_achieved.py`` to the calibration part's collectives of
that stack, on the link kind they ran on (``pcie``, ``nvlink``, ``network``), with the
80 % bounds of their residuals, and how its rings cross nodes (``rings = "flat"``: one
ring through every device, as NCCL 2.0 and Baidu's ring all-reduce ran; refdl's current
model is two levels). On another link kind, or for a stack listed without
measurements, the current stack's figures stand in and the interval is widened as for a
borrowed link (``refdl.perf.intervals``).
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from importlib import resources
from typing import Any

from refdl.errors import UsageError

LIBRARIES = ("nccl", "mpi", "gloo")
LINK_KINDS = ("pcie", "nvlink", "network")


@dataclasses.dataclass(frozen=True)
class StackLink:
    """A stack's fitted figures on one kind of link."""

    latency_s: float
    fraction: float  # of the link's line rate
    points: int
    source: str
    log_q10: float | None = None  # 80 % bounds of log(measured / predicted) over the
    log_q90: float | None = None  # calibration collectives fitted (None: too few)


@dataclasses.dataclass(frozen=True)
class Stack:
    """A named collective stack: its library, its years, and what it was measured to do."""

    name: str
    library: str
    years: str
    description: str
    links: dict[str, StackLink]  # link kind -> figures (empty: never measured)
    flat: bool = False  # across nodes one ring through every device (2017's), not two levels

    @property
    def current(self) -> bool:
        """Whether this is a library's current stack (the profiles' own figures)."""
        return self.name == self.library


@functools.cache
def table() -> dict[str, Stack]:
    """The stacks refdl knows, by name (the libraries' current ones first)."""
    text = resources.files("refdl.hw").joinpath("stacks.toml").read_text()
    raw = tomllib.loads(text).get("stack", {})
    out = {lib: Stack(lib, lib, "current", f"{lib}: the profiles' fitted figures", {})
           for lib in LIBRARIES}  # fmt: skip
    for name, s in raw.items():
        out[name] = _parse(name, s)
    return out


def _parse(name: str, s: dict[str, Any]) -> Stack:
    if s.get("library") not in LIBRARIES:
        raise ValueError(f"stacks.toml: stack {name}: library must be one of {LIBRARIES}")
    links = {}
    for kind, f in s.get("links", {}).items():
        if kind not in LINK_KINDS:
            raise ValueError(f"stacks.toml: stack {name}: link kind {kind} not in {LINK_KINDS}")
        links[kind] = StackLink(float(f["latency_s"]), float(f["fraction"]), int(f["points"]),
                                str(f["source"]), f.get("log_q10"), f.get("log_q90"))  # fmt: skip
    if s.get("rings", "hierarchical") not in ("flat", "hierarchical"):
        raise ValueError(f"stacks.toml: stack {name}: rings is flat or hierarchical")
    return Stack(name, s["library"], str(s.get("years", "")), str(s.get("description", "")),
                 links, s.get("rings") == "flat")  # fmt: skip


def help_text() -> str:
    """``--library``'s help in ``refdl predict`` and ``refdl plan``: the libraries and the
    dated stacks ``stacks.toml`` names."""
    dated = ", ".join(n for n, s in table().items() if not s.current)
    return (
        f"{', '.join(LIBRARIES[:-1])} or {LIBRARIES[-1]} (default: the profile's), or a "
        f"dated stack of one: {dated} (refdl.hw.stacks)"
    )


def get(name: str) -> Stack:
    """The stack ``name`` (a library or a dated stack), or one line naming the choices."""
    stacks = table()
    if name not in stacks:
        raise UsageError(f"unknown --library {name!r}; choose a library or one of its dated "
                         f"stacks: {', '.join(stacks)}")  # fmt: skip
    return stacks[name]


def note(name: str, kind: str, interval: bool = True) -> str | None:
    """What a prediction with stack ``name`` on a ``kind`` link rests on, in words (None
    for a library's current stack: the profile's own figures); ``interval``: and what
    its collective's stated interval is (a step's is its own, from steps)."""
    stack = get(name)
    if stack.current:
        return None
    if (own := stack.links.get(kind)) is not None:
        return (f"{name} ({stack.years}): its own figures on {kind} links, fitted to "
                f"{own.points} collectives of that stack ({own.fraction:.2f} of line rate)"
                + (", and its own residuals' 80 % interval" if interval else ""))  # fmt: skip
    return (f"{name} ({stack.years}) was never measured on {kind} links in refdl's data set: "
            f"today's {stack.library} figures stand in"
            + (", the interval widened as for a borrowed link" if interval else ""))  # fmt: skip
