"""Hardware profiles: one TOML file per machine in ``refdl/hw/profiles/``, loaded by name
or path and validated key by key (a bad file names the key that is wrong).

A profile holds the device (peak FLOP/s per dtype, memory bandwidth and
capacity) and its links (``intra``: inside a node, ``inter``: between nodes),
each with latency, line rate, the fraction of it a collective achieves, and
the source of every figure. ``Link.alpha_beta()`` gives the perf model's
alpha (latency) and beta (seconds per byte at the achievable rate).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from refdl.errors import UsageError
from refdl.perf.collectives import Link
from refdl.perf.ops import HOST_KINDS, KINDS, InStep, OpRate


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """A link: latency (s), line rate (bytes/s per direction), achievable fraction, source."""

    latency_s: float
    bandwidth: float
    achievable: float
    source: str

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


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """A machine: its device, its links, and how many devices share a node."""

    name: str
    description: str
    devices_per_node: int
    device: DeviceSpec
    links: dict[str, LinkSpec]

    @property
    def peak_flops(self) -> float:
        """float32 peak FLOP/s (the dtype refdl trains in)."""
        return self.device.peak_flops["float32"]

    @property
    def memory_bandwidth(self) -> float:
        return self.device.memory_bandwidth

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
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"hardware profile {path}: key {where}{key} must be a non-empty string")
    return value


def parse(raw: dict[str, Any], path: str = "<profile>") -> HardwareProfile:
    """Validate a profile's TOML contents."""
    dev = raw.get("device")
    if not isinstance(dev, dict):
        raise UsageError(f"hardware profile {path}: table [device] is missing")
    flops = dev.get("peak_flops")
    if not isinstance(flops, dict) or "float32" not in flops:
        raise UsageError(
            f"hardware profile {path}: key device.peak_flops must be a table with float32"
        )
    device = DeviceSpec(
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
        achievable = _positive(lk, "achievable", where, path)
        if achievable > 1:
            raise UsageError(f"hardware profile {path}: key {where}achievable must be <= 1")
        links[name] = LinkSpec(
            latency_s=_positive(lk, "latency_s", where, path),
            bandwidth=_positive(lk, "bandwidth", where, path),
            achievable=achievable,
            source=_text(lk, "source", where, path),
        )
    per_node = raw.get("devices_per_node", 1)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise UsageError(f"hardware profile {path}: key devices_per_node must be an integer >= 1")
    return HardwareProfile(
        name=_text(raw, "name", "", path),
        description=str(raw.get("description", "")),
        devices_per_node=per_node,
        device=device,
        links=links,
    )


def names() -> list[str]:
    """The profiles shipped with refdl."""
    folder = resources.files("refdl.hw") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (``p100-nvlink``) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise UsageError(f"hardware profile {path}: no such file")
        text = _read(path)
    else:
        if str(name_or_path) not in names():
            raise UsageError(
                f"unknown hardware profile {name_or_path!r}; choose one of: {', '.join(names())} "
                "or give a .toml path"
            )
        path = Path(str(resources.files("refdl.hw") / "profiles" / f"{name_or_path}.toml"))
        text = _read(path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"hardware profile {path}: not valid TOML ({e})") from None
    return parse(raw, str(path))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"hardware profile {path}: not UTF-8 text") from None
    except OSError as e:
        raise UsageError(f"hardware profile {path}: cannot read ({e.strerror or e})") from None


def dumps(profile: HardwareProfile) -> str:
    """The profile as TOML (``parse(tomllib.loads(dumps(p))) == p``)."""

    def value(v: Any) -> str:
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    d = profile.device
    lines = [
        f"name = {value(profile.name)}",
        f"description = {value(profile.description)}",
        f"devices_per_node = {profile.devices_per_node}",
        "",
        "[device]",
        f"name = {value(d.name)}",
        f"peak_flops = {value(d.peak_flops)}",
        f"memory_bandwidth = {d.memory_bandwidth!r}",
        f"memory_bytes = {d.memory_bytes!r}",
        f"source = {value(d.source)}",
    ]
    for key in ("dispatch_s", "op_overhead_s"):
        if getattr(d, key):
            lines.append(f"{key} = {getattr(d, key)!r}")
    if d.shared_cores:
        lines.append("shared_cores = true")
    if d.in_step is not None:
        lines += ["", "[device.in_step]"]
        lines += [f"{f.name} = {value(getattr(d.in_step, f.name))}"
                  for f in dataclasses.fields(d.in_step)]  # fmt: skip
    for kind, rate in d.ops.items():
        lines += ["", f"[device.ops.{kind}]"]
        lines += [
            f"t0_s = {rate.t0_s!r}",
            f"rate = {rate.rate!r}",
            f"source = {value(rate.source)}",
        ]
    for name, lk in profile.links.items():
        lines += ["", f"[links.{name}]"]
        lines += [f"{f.name} = {value(getattr(lk, f.name))}" for f in dataclasses.fields(lk)]
    return "\n".join(lines) + "\n"
