"""Hardware profiles: one TOML file per machine in ``refdl/hw/profiles/``, loaded by name
or path and validated key by key (a bad file names the key that is wrong).

A profile holds the device (peak FLOP/s per dtype, memory bandwidth and
capacity) and its links (``intra``: inside a node, ``inter``: between nodes),
each with latency, line rate, the fraction of it a collective achieves, and
the source of every figure. ``Link.alpha_beta()`` gives the perf model's
alpha (latency) and beta (seconds per byte at the achievable rate).

Peaks give a bound. ``[achieved]`` adds what software delivered on such a machine
(fitted to published measurements, ``scripts/fit_achieved.py``): per operation class
(``conv``, ``gemm``) and precision a fraction of peak FLOP/s, a fraction of memory
bandwidth, and per communication library (``nccl``, ``mpi``, ``gloo``) and link a
latency and a fraction of line rate. ``HardwareProfile.view`` returns the profile the
cost formulas read for either: ``bound`` (peaks) or ``expected`` (achieved).
"""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from pathlib import Path
from typing import Any

from refdl.config.files import loads_toml, printable, read_text
from refdl.errors import UsageError
from refdl.hw.stacks import LIBRARIES
from refdl.hw.stacks import get as stack_of
from refdl.perf.collectives import Link
from refdl.perf.ops import HOST_KINDS, KINDS, InStep, OpRate


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """A link: latency (s), line rate (bytes/s per direction), achievable fraction, source."""

    latency_s: float
    bandwidth: float
    achievable: float
    source: str
    nics_per_node: int = 1  # inter: NICs a node's devices share (DGX A100: 8)

    def alpha_beta(self) -> Link:
        return Link(alpha=self.latency_s, beta=1.0 / (self.bandwidth * self.achievable))


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One device: peak FLOP/s by dtype, memory bandwidth (bytes/s) and capacity (bytes)."""

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: float
    source: str
    # Optional, measured by calibration (0 / False when a profile does not give them):
    dispatch_s: float = 0.0  # host time to launch one compiled step (a jitted call)
    op_overhead_s: float = 0.0  # fixed time per executed operation (kernel / thunk)
    shared_cores: bool = False  # several devices share one host's cores (simulated devices)
    # Operations inside a training step against the same alone ([device.in_step],
    # refdl.perf.ops.InStep); None: as alone.
    in_step: InStep | None = None
    # Hockney t0 / rate per operation kind ([device.ops.<kind>], refdl.perf.ops); empty:
    # the roofline plus op_overhead_s is used instead.
    ops: dict[str, OpRate] = dataclasses.field(default_factory=dict)


PRECISIONS = {"fp32": "float32", "tf32": "tf32", "bf16": "bfloat16", "fp16": "float16"}
OP_CLASSES = ("conv", "gemm", "transformer")  # transformer: GPT-scale layers (many GPUs)
TWIN = {"float16": "bfloat16", "bfloat16": "float16"}  # 16-bit dtypes: one peak, one fraction
# cuDNN's Winograd convolutions (Lavin & Gray, CVPR 2016) do up to 2.25x fewer
# multiplications than the direct convolution XLA's FLOP count assumes
WINOGRAD = 2.25


@dataclasses.dataclass(frozen=True)
class AchievedLink:
    """What a communication library delivered on a link: latency and fraction of line rate."""

    latency_s: float
    fraction: float
    source: str


@dataclasses.dataclass(frozen=True)
class Achieved:
    """What software delivered on this machine, with sources (``[achieved]``)."""

    fractions: dict[str, dict[str, float]]  # op class -> dtype -> fraction of that peak
    memory: float  # fraction of memory bandwidth
    device_source: str
    links: dict[str, dict[str, AchievedLink]]  # library -> "intra"/"inter" -> figures
    library: str  # the default library of this machine

    def fraction(self, op_class: str, dtype: str) -> float:
        """The achieved fraction of ``dtype``'s peak for ``op_class`` (else its float32
        figure, else the other class's, else 1)."""
        alias = TWIN.get(dtype, dtype)
        for cls in (op_class, *[c for c in OP_CLASSES if c != op_class]):
            table = self.fractions.get(cls, {})
            for key in (dtype, alias):  # fp16 and bf16 share the matrix units' peak
                if key in table:
                    return table[key]
        for cls in (op_class, *OP_CLASSES):
            if "float32" in self.fractions.get(cls, {}):
                return self.fractions[cls]["float32"]
        return 1.0


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """A machine: its device, its links, and how many devices share a node. A profile
    without ``[device]`` describes a network alone (a published MPI or gloo benchmark's
    cluster): it predicts collectives, not steps."""

    name: str
    description: str
    devices_per_node: int
    device: DeviceSpec | None
    links: dict[str, LinkSpec]
    achieved: Achieved | None = None
    # the device's own memory bandwidth, kept by a view that folds memory-bound work into
    # its fractions (memory_bandwidth inf): what a pass over real bytes takes (B/s)
    stream_bandwidth: float | None = None
    # the device's datasheet peak of the view's precision, kept by an expected view (its
    # float32 entry an achieved rate): what a matrix product's shape is priced against
    # (refdl.perf.gemm); None in a bound, which prices no shape
    datasheet_flops: float | None = None

    def default_library(self) -> str:
        """The communication library predictions assume unless told (``--library``)."""
        return self.achieved.library if self.achieved else "nccl"

    def link_kind(self, level: str) -> str:
        """``network`` between nodes; inside a node ``nvlink`` or ``pcie`` (the kinds a
        dated stack's figures were measured on, ``refdl.hw.stacks``)."""
        if level == "inter":
            return "network"
        text = (self.links[level].source + self.description).lower()
        return "nvlink" if "nvlink" in text and "pcie" not in self.name else "pcie"

    def stack_figures(self, library: str, level: str) -> Any:
        """A dated stack's own figures (``refdl.hw.stacks.StackLink``) on ``level``'s kind
        of link; None for a library's current stack or a kind it never ran on."""
        return stack_of(library).links.get(self.link_kind(level))

    def borrowed_link(self, library: str, level: str) -> bool:
        """Whether the achieved figures of ``library`` on ``level`` are borrowed: none of
        this link's own collectives was fitted (``scripts/fit_achieved.py`` then writes
        the median of fitted links, its source starting "no ..."), or there are none; for
        a dated stack, whether it was never measured on this kind of link."""
        if not stack_of(library).current:
            return self.stack_figures(library, level) is None
        a = self.achieved
        link = a.links.get(library, {}).get(level) if a else None
        return link is None or link.source.startswith("no ")

    def borrowed_device(self, dtype: str, op_class: str | None = None) -> bool:
        """Whether no achieved device fraction of ``dtype`` (or its 16-bit twin) was fitted
        for this device (of ``op_class`` where one is named): the expectation then rests
        on another dtype's or class's, or on peaks."""
        if self.achieved is None:
            return True
        tables = self.achieved.fractions
        pick = tables.values() if op_class is None else [tables.get(op_class, {})]
        return not any(k in t for t in pick for k in (dtype, TWIN.get(dtype, dtype)))

    def need_device(self) -> DeviceSpec:
        """The device, or a usage error naming a profile that describes a network alone."""
        if self.device is None:
            raise UsageError(
                f"hardware profile {self.name} has no [device] (it describes a network "
                "alone): it predicts collectives, not steps; pick a profile with a device"
            )
        return self.device

    def dtype_for(self, precision: str) -> str:
        """The peak a precision runs at: fp32 at TF32's where the card has one (cuDNN's and
        cuBLAS's default for fp32 convolutions and matrix products on such cards, and
        JAX's default precision)."""
        if precision == "fp32" and "tf32" in self.need_device().peak_flops:
            return "tf32"
        return PRECISIONS.get(precision, "float32")

    def view(
        self,
        kind: str = "bound",
        precision: str = "fp32",
        op_class: str = "gemm",
        library: str | None = None,
        architecture: float = 1.0,
    ) -> HardwareProfile:
        """This profile as the cost formulas should read it: ``bound`` (peak FLOP/s of
        ``precision``, line rates at the links' ``achievable``) or ``expected`` (the
        ``[achieved]`` fractions for ``op_class`` and ``library``, the device's scaled by
        the model's ``architecture`` factor, ``refdl.perf.architectures``; a profile
        without them is its own expectation). Memory traffic scales with the precision's bytes. The
        bound leaves memory out (XLA's byte count, taken before fusion, overstates it),
        runs links at line rate, fp32 at the TF32 peak where there is one (the default
        of cuDNN and cuBLAS on such cards), and allows convolutions Winograd's saving."""
        if kind not in ("bound", "expected"):
            raise ValueError(kind)
        if precision not in PRECISIONS:
            raise UsageError(
                f"unknown --precision {precision!r}; choose one of: {', '.join(PRECISIONS)}"
            )
        name = library or self.default_library()  # a library or a dated stack
        library = stack_of(name).library
        links = dict(self.links)
        if kind == "bound":
            links = {k: dataclasses.replace(v, achievable=1.0) for k, v in links.items()}
        a = self.achieved if kind == "expected" else None
        if a is not None:
            for level, got in a.links.get(library, {}).items():
                if level in links:
                    links[level] = dataclasses.replace(
                        links[level], latency_s=got.latency_s, achievable=got.fraction
                    )
        if kind == "expected":  # a dated stack's own figures, on the kinds it ran on
            for level in links:
                if (own := self.stack_figures(name, level)) is not None:
                    links[level] = dataclasses.replace(
                        links[level], latency_s=own.latency_s, achievable=own.fraction
                    )
        d = self.device
        if d is None:  # a network alone: only its links have a view
            return dataclasses.replace(self, links=links)
        dtype = self.dtype_for(precision)
        peak = d.peak_flops.get(dtype, d.peak_flops["float32"])
        bw = d.memory_bandwidth * (2.0 if precision in ("bf16", "fp16") else 1.0)
        if kind == "bound":
            bw = math.inf  # XLA counts every operation's bytes before fusion: no bound
            if op_class == "conv":  # Winograd F(2x2,3x3): 2.25x fewer multiplications
                peak *= WINOGRAD
        if a is not None:  # the fractions were fitted to whole steps: memory-bound work
            peak *= a.fraction(op_class, dtype) * architecture  # is inside them, and XLA's
            bw = math.inf  # byte count, taken before fusion, is no estimate of traffic
        datasheet = d.peak_flops.get(dtype, d.peak_flops["float32"])
        flops = {**d.peak_flops, "float32": peak}
        device = dataclasses.replace(d, peak_flops=flops, memory_bandwidth=bw)
        return dataclasses.replace(self, device=device, links=links,
                                   stream_bandwidth=d.memory_bandwidth,
                                   datasheet_flops=datasheet if kind == "expected"
                                   else None)  # fmt: skip

    @property
    def peak_flops(self) -> float:
        """float32 peak FLOP/s (the dtype refdl trains in)."""
        return self.need_device().peak_flops["float32"]

    @property
    def memory_bandwidth(self) -> float:
        return self.need_device().memory_bandwidth

    def allreduce_time(self, n: float, workers: int, algo: str = "ring",
                       level: str | None = None) -> float:  # fmt: skip
        """An allreduce of ``n`` bytes over ``workers`` devices: ``algo`` on the link for
        that many (``level`` forces one); a ring that spans nodes runs in two levels
        (``allreduce_hierarchical``)."""
        from refdl.perf.collectives import ALLREDUCE, allreduce_hierarchical

        per_node = self.devices_per_node
        if (level is None and algo == "ring" and workers > per_node
                and "inter" in self.links and "intra" in self.links):  # fmt: skip
            inter = self.links["inter"]
            return allreduce_hierarchical(n, workers, per_node, self.links["intra"].alpha_beta(),
                                          inter.alpha_beta(), inter.nics_per_node)  # fmt: skip
        link = self.links[level] if level else self.link(workers)
        return ALLREDUCE[algo](n, workers, link.alpha_beta())

    def link(self, workers: int) -> LinkSpec:
        """The link a collective over ``workers`` devices is limited by: ``intra`` while they
        fit in a node, else ``inter``."""
        if workers <= self.devices_per_node and "intra" in self.links:
            return self.links["intra"]
        if "inter" in self.links:
            return self.links["inter"]
        return self.links["intra"]


def _positive(raw: dict, key: str, where: str, path: str) -> float:
    if key not in raw:
        raise UsageError(f"hardware profile {path}: key {where}{key} is missing")
    value = raw[key]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise UsageError(
            f"hardware profile {path}: key {where}{key} must be a positive number (got {value!r})"
        )
    return float(value)


def _nonneg(raw: dict, key: str, path: str, name: str = "") -> float:
    value = raw.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        name = name or f"device.{key}"
        raise UsageError(f"hardware profile {path}: key {name} must be a number >= 0")
    return float(value)


def _flag(raw: dict, key: str, path: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise UsageError(f"hardware profile {path}: key device.{key} must be true or false")
    return value


def _op_rates(dev: dict, path: str) -> dict[str, OpRate]:
    """The optional ``[device.ops.<kind>]`` tables: ``t0_s`` >= 0, ``rate`` > 0, ``source``."""
    raw = dev.get("ops", {})
    if not isinstance(raw, dict):
        raise UsageError(f"hardware profile {path}: key device.ops must be a table of kinds")
    out = {}
    for kind, table in raw.items():
        where = f"device.ops.{kind}."
        if kind not in KINDS + HOST_KINDS or not isinstance(table, dict):
            raise UsageError(
                f"hardware profile {path}: key device.ops.{kind}: not a table of an operation "
                f"kind ({', '.join(KINDS + HOST_KINDS)})"
            )
        _known(table, ("t0_s", "rate", "source"), where, path)
        t0 = table.get("t0_s")
        if isinstance(t0, bool) or not isinstance(t0, (int, float)) or not t0 >= 0:
            raise UsageError(f"hardware profile {path}: key {where}t0_s must be a number >= 0")
        out[kind] = OpRate(
            float(t0), _positive(table, "rate", where, path), _text(table, "source", where, path)
        )
    return out


def _in_step(dev: dict, path: str) -> InStep | None:
    """``[device.in_step]``: factors (numbers >= 0) and the hand-off (s >= 0), with source."""
    table = dev.get("in_step")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise UsageError(f"hardware profile {path}: device.in_step must be a table")
    keys = [f.name for f in dataclasses.fields(InStep) if f.name != "source"]
    unknown = sorted(set(table) - {*keys, "source"})
    if unknown:
        raise UsageError(
            f"hardware profile {path}: key device.in_step.{unknown[0]} is not one of "
            f"{', '.join(keys)}, source"
        )
    values = {k: _nonneg(table, k, path, f"device.in_step.{k}") for k in keys if k in table}
    return InStep(**values, source=_text(table, "source", "device.in_step.", path))


def _text(raw: dict, key: str, where: str, path: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value.strip() or not value.isprintable():
        raise UsageError(f"hardware profile {path}: key {where}{key} must be a non-empty "
                         "string without control characters")  # fmt: skip
    return value


def _known(table: dict, keys: tuple[str, ...], where: str, path: str) -> None:
    """A table's keys are the ones it may have: a misspelt key is refused, not ignored."""
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise UsageError(f"hardware profile {path}: key {where}{printable(unknown[0])} is not "
                         f"one of {', '.join(keys)}")  # fmt: skip


DEVICE_KEYS = ("name", "peak_flops", "memory_bandwidth", "memory_bytes", "source",
               "dispatch_s", "op_overhead_s", "shared_cores", "in_step", "ops")  # fmt: skip
LINK_KEYS = ("latency_s", "bandwidth", "achievable", "source", "nics_per_node")


TOP_LEVEL = ("name", "description", "devices_per_node", "device", "links", "achieved")


def _device(dev: Any, path: str) -> DeviceSpec:
    """``[device]``: peaks, memory, and the calibrated operation rates where measured."""
    if not isinstance(dev, dict):
        raise UsageError(f"hardware profile {path}: [device] must be a table")
    _known(dev, DEVICE_KEYS, "device.", path)
    flops = dev.get("peak_flops")
    if not isinstance(flops, dict) or "float32" not in flops:
        raise UsageError(
            f"hardware profile {path}: key device.peak_flops must be a table with float32"
        )
    return DeviceSpec(
        name=_text(dev, "name", "device.", path),
        peak_flops={k: _positive(flops, k, "device.peak_flops.", path) for k in flops},
        memory_bandwidth=_positive(dev, "memory_bandwidth", "device.", path),
        memory_bytes=_positive(dev, "memory_bytes", "device.", path),
        source=_text(dev, "source", "device.", path),
        dispatch_s=_nonneg(dev, "dispatch_s", path),
        op_overhead_s=_nonneg(dev, "op_overhead_s", path),
        shared_cores=_flag(dev, "shared_cores", path),
        in_step=_in_step(dev, path),
        ops=_op_rates(dev, path),
    )


def parse(raw: dict[str, Any], path: str = "<profile>") -> HardwareProfile:
    """Validate a profile's TOML contents."""
    unknown = sorted(set(raw) - set(TOP_LEVEL))
    if unknown:
        raise UsageError(
            f"hardware profile {path}: key {unknown[0]} is not one of {', '.join(TOP_LEVEL)}"
        )
    dev = raw.get("device")
    device = None if dev is None else _device(dev, path)  # None: a network described alone
    links_raw = raw.get("links")
    if not isinstance(links_raw, dict) or not links_raw:
        raise UsageError(f"hardware profile {path}: table [links.intra] or [links.inter] missing")
    links = {}
    for name, lk in links_raw.items():
        if name not in ("intra", "inter") or not isinstance(lk, dict):
            raise UsageError(
                f"hardware profile {path}: links.{name}: use [links.intra] or [links.inter]"
            )
        where = f"links.{name}."
        _known(lk, LINK_KEYS, where, path)
        achievable = _positive(lk, "achievable", where, path)
        if achievable > 1:
            raise UsageError(f"hardware profile {path}: key {where}achievable must be <= 1")
        nics = lk.get("nics_per_node", 1)
        if isinstance(nics, bool) or not isinstance(nics, int) or nics < 1:
            raise UsageError(f"hardware profile {path}: key {where}nics_per_node must be an "
                             "integer >= 1")  # fmt: skip
        links[name] = LinkSpec(
            latency_s=_positive(lk, "latency_s", where, path),
            bandwidth=_positive(lk, "bandwidth", where, path),
            achievable=achievable,
            source=_text(lk, "source", where, path),
            nics_per_node=nics,
        )
    achieved = _achieved(raw.get("achieved"), links, path)
    per_node = raw.get("devices_per_node", 1)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise UsageError(f"hardware profile {path}: key devices_per_node must be an integer >= 1")
    return HardwareProfile(
        name=_text(raw, "name", "", path),
        description=printable(_description(raw, path), 400),
        devices_per_node=per_node,
        device=device,
        links=links,
        achieved=achieved,
    )


def _fraction(value: Any, name: str, path: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and 0 < value <= 1)
    ):
        raise UsageError(f"hardware profile {path}: key {name} must be a number in (0, 1]")
    return float(value)


def _achieved(raw: Any, links: dict, path: str) -> Achieved | None:
    """``[achieved]``: ``library``, ``[achieved.device]`` (conv/gemm fractions by dtype,
    memory, source) and ``[achieved.<library>.<intra|inter>]`` (latency_s, fraction,
    source)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UsageError(f"hardware profile {path}: achieved must be a table")
    dev = raw.get("device", {})
    if not isinstance(dev, dict):
        raise UsageError(f"hardware profile {path}: achieved.device must be a table")
    fractions = {}
    for cls in OP_CLASSES:
        table = dev.get(cls, {})
        if not isinstance(table, dict):
            raise UsageError(
                f"hardware profile {path}: key achieved.device.{cls} must be a table of "
                "dtype = fraction"
            )
        fractions[cls] = {k: _fraction(v, f"achieved.device.{cls}.{k}", path)
                          for k, v in table.items()}  # fmt: skip
    unknown = sorted(set(dev) - {*OP_CLASSES, "memory", "source"})
    if unknown:
        raise UsageError(
            f"hardware profile {path}: key achieved.device.{unknown[0]} is not one of "
            f"{', '.join(OP_CLASSES)}, memory, source"
        )
    memory = _fraction(dev.get("memory", 1.0), "achieved.device.memory", path)
    dev_source = _text(dev, "source", "achieved.device.", path) if dev else ""
    got: dict[str, dict[str, AchievedLink]] = {}
    for lib in LIBRARIES:
        levels = raw.get(lib, {})
        if not isinstance(levels, dict):
            raise UsageError(f"hardware profile {path}: achieved.{lib} must be a table")
        for level, table in levels.items():
            where = f"achieved.{lib}.{level}."
            if level not in links or not isinstance(table, dict):
                raise UsageError(
                    f"hardware profile {path}: {where[:-1]}: this profile's links are "
                    f"{', '.join(links)}"
                )
            _known(table, ("latency_s", "fraction", "source"), where, path)
            got.setdefault(lib, {})[level] = AchievedLink(
                latency_s=_positive(table, "latency_s", where, path),
                fraction=_fraction(table.get("fraction"), f"{where}fraction", path),
                source=_text(table, "source", where, path),
            )
    unknown = sorted(set(raw) - {*LIBRARIES, "device", "library"})
    if unknown:
        raise UsageError(
            f"hardware profile {path}: key achieved.{unknown[0]} is not one of device, "
            f"library, {', '.join(LIBRARIES)}"
        )
    library = raw.get("library", "nccl")
    if library not in LIBRARIES:
        raise UsageError(
            f"hardware profile {path}: key achieved.library must be one of {', '.join(LIBRARIES)}"
        )
    return Achieved(fractions, memory, dev_source, got, library)


def names() -> list[str]:
    """The profiles shipped with refdl."""
    folder = resources.files("refdl.hw") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (``p100-nvlink``) or a TOML file by path."""
    if not str(name_or_path).strip():
        raise UsageError(f"--hw is empty; give a profile ({', '.join(names())}) or a .toml path")
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        text = read_text(path, "hardware profile", limit=1 << 20)
    else:
        if str(name_or_path) not in names():
            raise UsageError(
                f"unknown hardware profile {name_or_path!r}; choose one of: {', '.join(names())} "
                "or give a .toml path"
            )
        path = Path(str(resources.files("refdl.hw") / "profiles" / f"{name_or_path}.toml"))
        text = read_text(path, "hardware profile", limit=1 << 20)
    return parse(loads_toml(text, f"hardware profile {path}"), str(path))


def _description(raw: dict, path: str) -> str:
    value = raw.get("description", "")
    if not isinstance(value, str):
        raise UsageError(f"hardware profile {path}: key description must be a string")
    return value


def _value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def _dump_device(d: DeviceSpec) -> list[str]:
    lines = [
        "",
        "[device]",
        f"name = {_value(d.name)}",
        f"peak_flops = {_value(d.peak_flops)}",
        f"memory_bandwidth = {d.memory_bandwidth!r}",
        f"memory_bytes = {d.memory_bytes!r}",
        f"source = {_value(d.source)}",
    ]
    for key in ("dispatch_s", "op_overhead_s"):
        if getattr(d, key):
            lines.append(f"{key} = {getattr(d, key)!r}")
    if d.shared_cores:
        lines.append("shared_cores = true")
    if d.in_step is not None:
        lines += ["", "[device.in_step]"]
        lines += [f"{f.name} = {_value(getattr(d.in_step, f.name))}"
                  for f in dataclasses.fields(d.in_step)]  # fmt: skip
    for kind, rate in d.ops.items():
        lines += ["", f"[device.ops.{kind}]"]
        lines += [f"t0_s = {rate.t0_s!r}", f"rate = {rate.rate!r}",
                  f"source = {_value(rate.source)}"]  # fmt: skip
    return lines


def dumps(profile: HardwareProfile) -> str:
    """The profile as TOML (``parse(tomllib.loads(dumps(p))) == p``)."""
    lines = [
        f"name = {_value(profile.name)}",
        f"description = {_value(profile.description)}",
        f"devices_per_node = {profile.devices_per_node}",
    ]
    if profile.device is not None:
        lines += _dump_device(profile.device)
    for name, lk in profile.links.items():
        lines += ["", f"[links.{name}]"]
        lines += [f"{f.name} = {_value(getattr(lk, f.name))}" for f in dataclasses.fields(lk)
                  if f.name != "nics_per_node" or lk.nics_per_node != 1]  # fmt: skip
    a = profile.achieved
    if a is not None:
        lines += ["", "[achieved]", f"library = {_value(a.library)}"]
        if a.device_source:
            lines += ["", "[achieved.device]"]
            lines += [f"{cls} = {_value(t)}" for cls, t in a.fractions.items() if t]
            lines += [f"memory = {a.memory!r}", f"source = {_value(a.device_source)}"]
        for lib, levels in a.links.items():
            for level, got in levels.items():
                lines += ["", f"[achieved.{lib}.{level}]"]
                lines += [f"{f.name} = {_value(getattr(got, f.name))}"
                          for f in dataclasses.fields(got)]  # fmt: skip
    return "\n".join(lines) + "\n"
