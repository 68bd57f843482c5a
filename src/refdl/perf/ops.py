"""Operation-level compute model: the operations a compiled XLA program executes, by kind.

``parse_hlo`` reads the text of a compiled module (``compiled.as_text()``) and
lists the operations of its entry computation (recursing into ``call`` and
``while`` bodies, the latter times their known trip count) with a kind and a
size: FLOPs for ``dot`` and ``convolution`` (counted from the shapes, also when
XLA wrapped them in a fusion), bytes read and written for every other kind.
Free plumbing (parameters, constants, tuples, bitcasts) is left out.

Each kind's time follows Hockney's model ``t = t0 + n / r_inf`` (R. W. Hockney,
"The science of computer benchmarking", SIAM 1996; Hockney & Jesshope,
"Parallel Computers 2", 1988): ``t0`` the start-up time of one operation,
``r_inf`` its asymptotic rate, both fitted by ``refdl.hw calibrate`` to
microbenchmarks at generic sizes. A kind a profile does not give falls back to
``other`` when it has one, else to the roofline plus the fixed per-op overhead.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

# Kinds whose size is FLOPs; every other kind is sized in bytes read + written.
FLOP_KINDS = ("dot", "convolution")
KINDS = (
    "dot",
    "convolution",
    "reduce-window",
    "select-and-scatter",
    "scatter",
    "reduce",
    "elementwise",
    "copy",
    "custom-call",
    "collective",
    "other",
)
# Host-side kinds, sized by argument leaves (dispatch) and bytes (transfer to the device).
HOST_KINDS = ("dispatch", "transfer")

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}  # fmt: skip
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "partition-id", "replica-id", "opt-barrier"}  # fmt: skip
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
               "all-to-all", "send", "recv", "collective-broadcast")  # fmt: skip
PLAIN = {"dot": "dot", "convolution": "convolution", "reduce-window": "reduce-window",
         "select-and-scatter": "select-and-scatter", "scatter": "scatter", "reduce": "reduce",
         "copy": "copy", "transpose": "copy", "custom-call": "custom-call"}  # fmt: skip
# In a fusion, the first of these found (in this order) names the fusion's kind.
FUSED_ORDER = ("convolution", "dot", "select-and-scatter", "scatter", "reduce-window", "reduce")

_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")


@dataclasses.dataclass(frozen=True)
class Op:
    """One executed operation: its HLO name, kind, FLOPs and bytes read + written."""

    name: str
    kind: str
    flops: float
    bytes: float

    @property
    def size(self) -> float:
        """Hockney's ``n`` for this op: FLOPs for dot / convolution, else bytes."""
        return self.flops if self.kind in FLOP_KINDS else self.bytes


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str


def shape_dims(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """``[(dtype, dims), ...]`` of an HLO type (one array, or every array of a tuple)."""
    return [
        (dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(type_text)
    ]


def type_bytes(type_text: str) -> float:
    """Bytes of an HLO type (a tuple's arrays summed)."""
    return float(sum(DTYPE_BYTES.get(dt, 4) * math.prod(d) for dt, d in shape_dims(type_text)))


def _split_operands(rest: str) -> tuple[list[str], str]:
    """Operand names inside the opcode's parentheses, and the attributes after them."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                end = i
                break
    return re.findall(r"%([\w.\-]+)", rest[:end]), rest[end + 1 :]


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """Every computation's instructions by name, and the entry computation's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if m:
            operands, attrs = _split_operands(m.group(4))
            comps[current].append(_Instr(m.group(1), m.group(2), m.group(3), operands, attrs))
    return comps, entry


def dot_flops(out_type: str, lhs_type: str, attrs: str) -> float:
    """``2 x prod(output dims) x prod(lhs contracting dims)`` (one multiply-add = 2 FLOPs)."""
    (_, lhs), (_, out) = shape_dims(lhs_type)[0], shape_dims(out_type)[0]
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
    dims = [int(d) for d in m.group(1).split(",") if d] if m else []
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in dims)


def conv_flops(out_type: str, rhs_type: str, attrs: str) -> float:
    """``2 x prod(output dims) x prod(kernel dims) / output features``: each output element
    is one kernel window's multiply-adds (spatial taps x input features per group).
    Products with padding zeros are counted (XLA's cost analysis leaves them out)."""
    (_, rhs), (_, out) = shape_dims(rhs_type)[0], shape_dims(out_type)[0]
    m = re.search(r"dim_labels=\w+_(\w+)->", attrs)
    o = m.group(1).index("o") if m and "o" in m.group(1) else len(rhs) - 1
    return 2.0 * math.prod(out) * math.prod(rhs) / max(rhs[o], 1)


def _trip_count(attrs: str) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
    return int(m.group(1)) if m else 1


def _called(attrs: str, key: str) -> str | None:
    m = re.search(key + r"=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _inner_flops(comps: dict[str, list[_Instr]], name: str, opcode: str) -> float:
    """FLOPs of the dots / convolutions inside a fused computation."""
    body = comps.get(name, [])
    types = {i.name: i.type for i in body}
    total = 0.0
    for i in body:
        if i.opcode == opcode and len(i.operands) >= 2:
            arg = types.get(i.operands[0 if opcode == "dot" else 1], "")
            if arg:
                fn = dot_flops if opcode == "dot" else conv_flops
                total += fn(i.type, arg, i.attrs)
    return total


def _ops_of(comps: dict[str, list[_Instr]], name: str, repeat: int, out: list[Op]) -> None:
    body = comps.get(name, [])
    types = {i.name: i.type for i in body}
    for i in body:
        if i.opcode in FREE:
            continue
        if i.opcode == "while":
            body_name = _called(i.attrs, "body")
            if body_name:
                _ops_of(comps, body_name, repeat * _trip_count(i.attrs), out)
            continue
        if i.opcode == "call":
            target = _called(i.attrs, "to_apply")
            if target:
                _ops_of(comps, target, repeat, out)
            continue
        nbytes = type_bytes(i.type) + sum(type_bytes(types.get(o, "")) for o in i.operands)
        flops, kind = 0.0, "other"
        if i.opcode == "fusion":
            inner = comps.get(_called(i.attrs, "calls") or "", [])
            opcodes = {x.opcode for x in inner}
            kind = next((k for k in FUSED_ORDER if k in opcodes), "elementwise")
            if kind in FLOP_KINDS:
                flops = _inner_flops(comps, _called(i.attrs, "calls") or "", kind)
            elif opcodes <= FREE | {"copy", "transpose"}:
                kind = "copy"
        elif i.opcode in PLAIN:
            kind = PLAIN[i.opcode]
            if kind in FLOP_KINDS and len(i.operands) >= 2:
                arg = types.get(i.operands[0 if kind == "dot" else 1], "")
                fn = dot_flops if kind == "dot" else conv_flops
                flops = fn(i.type, arg, i.attrs) if arg else 0.0
        elif i.opcode.startswith(COLLECTIVES):
            kind = "collective"
        elif i.opcode in ("add", "multiply", "subtract", "divide", "maximum", "minimum",
                          "exponential", "tanh", "select", "compare", "broadcast", "convert",
                          "negate", "log", "sqrt", "rsqrt", "abs", "iota", "slice",
                          "dynamic-slice", "dynamic-update-slice", "concatenate", "pad",
                          "reshape", "reverse", "clamp", "power", "and", "or", "not"):  # fmt: skip
            kind = "elementwise"
        out.extend([Op(i.name, kind, flops, nbytes)] * repeat)


def parse_hlo(text: str) -> list[Op]:
    """The operations a compiled HLO module's entry computation executes, in order."""
    comps, entry = _computations(text)
    out: list[Op] = []
    if entry is not None:
        _ops_of(comps, entry, 1, out)
    return out


def by_kind(ops: Iterable[Op]) -> dict[str, tuple[int, float]]:
    """``{kind: (count, total n)}`` of a list of operations."""
    agg: dict[str, tuple[int, float]] = {}
    for op in ops:
        c, n = agg.get(op.kind, (0, 0.0))
        agg[op.kind] = (c + 1, n + op.size)
    return agg


@dataclasses.dataclass(frozen=True)
class OpRate:
    """Hockney's two figures for one kind: start-up time (s) and asymptotic rate (n / s)."""

    t0_s: float
    rate: float
    source: str = ""

    def time(self, n: float, count: float = 1.0) -> float:
        """``count x t0 + n / r_inf`` for ``count`` operations of total size ``n``."""
        return count * self.t0_s + n / self.rate


def fit_hockney(sizes: Iterable[float], times: Iterable[float]) -> tuple[float, float]:
    """``(t0, r_inf)`` of ``t = t0 + n / r_inf`` (Hockney 1991), least squares on the
    *relative* error (each point weighted by 1/t, so small and large sizes count alike);
    t0 is clipped at 0.

    >>> t0, r = fit_hockney([0, 1e6, 4e6], [1e-5, 1.1e-4, 4.1e-4])
    >>> round(t0, 9), round(r / 1e10, 6)
    (1e-05, 1.0)
    """
    n = np.asarray(list(sizes), float)
    t = np.asarray(list(times), float)
    a = np.stack([1.0 / t, n / t], axis=1)  # (t0 + n/r) / t = 1
    (t0, inv_r), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if t0 < 0 or inv_r <= 0:  # a pure rate (through the origin) or a pure latency
        inv_r = max(float(np.sum(n * t / t**2) / np.sum(n * n / t**2)), 1e-30)
        t0 = 0.0
    return float(t0), float(1.0 / inv_r)


@dataclasses.dataclass(frozen=True)
class OpWork:
    """One device's work for a step, per kind: ``{kind: (count, n)}``, plus host calls."""

    kinds: Mapping[str, tuple[float, float]]

    def scaled(self, share: float = 1.0, repeat: float = 1.0) -> OpWork:
        """``repeat`` x the operations, each ``share`` of its size (a device's share)."""
        return OpWork({k: (c * repeat, n * share) for k, (c, n) in self.kinds.items()})


@dataclasses.dataclass(frozen=True)
class InStep:
    """How operations inside a training step differ from the same operations alone: a
    factor on the isolated time of each group (products ``dot`` and ``convolution``, and
    ``memory`` for every memory-bound kind), plus ``handoff_s`` per operation (XLA's
    thread pool passing the step from one operation to the next, asleep while the host
    builds the next batch: a wait, not work). Measured by ``refdl.hw calibrate`` with
    JAX's profiler on generic training steps (``refdl.calibrate.fit_in_step``)."""

    dot: float = 1.0
    convolution: float = 1.0
    memory: float = 1.0
    handoff_s: float = 0.0
    source: str = ""

    def factor(self, kind: str) -> float:
        """The factor on an operation of ``kind``'s isolated time."""
        return getattr(self, kind) if kind in FLOP_KINDS else self.memory


def op_time(
    work: OpWork, rates: Mapping[str, OpRate], hw: Any, in_step: InStep | None = None
) -> float:
    """Sum over kinds of ``count x t0 + n / r_inf``; a kind without a rate uses ``other``,
    or else the roofline of its size plus the device's per-op overhead. With ``in_step``,
    each kind's time is scaled by its group's factor and every operation pays the
    hand-off."""
    dev = getattr(hw, "device", None)
    op_s = getattr(dev, "op_overhead_s", 0.0)
    total = 0.0
    for kind, (count, n) in work.kinds.items():
        rate = rates.get(kind) or (None if kind in FLOP_KINDS else rates.get("other"))
        if rate is not None:
            t = rate.time(n, count)
        elif kind in FLOP_KINDS:
            t = n / hw.peak_flops + count * op_s
        else:
            t = n / hw.memory_bandwidth + count * op_s
        if in_step is not None:
            t = t * in_step.factor(kind) + count * in_step.handoff_s
        total += t
    return total
