"""Performance model: what a step should cost (compute, communication, bubble, memory)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from refdl.config.choices import CONTEXT_ATTENTION, PIPELINE_SCHEDULES, PS_MODES, REMAT
from refdl.config.codec import Compression
from refdl.config.mesh import MeshLayout
from refdl.config.straggler import Straggler
from refdl.config.values import (
    Choice,
    Flag,
    Float,
    Int,
    Ints,
    Optional,
    Parsed,
    Text,
    parse_typed,
)
from refdl.errors import UsageError
from refdl.perf.ops import op_time
from refdl.perf.straggler import straggled

# the allreduce algorithms the cost model knows (refdl.perf.collectives), and refdl's names
ALLREDUCE_MODELS = ("ring", "tree", "recursive-doubling", "rabenseifner", "xla",
                    "halving-doubling", "sparse", "sparse-split")  # fmt: skip


class Hardware(Protocol):
    """The figures of a device the cost model needs (a hardware profile provides them)."""

    peak_flops: float  # FLOP/s for the dtype in use
    memory_bandwidth: float  # bytes/s


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    """Predicted time of one training step, split the way the survey splits it."""

    compute_s: float
    comm_s: float = 0.0
    bubble_s: float = 0.0
    memory_bytes: int = 0
    flops: float = 0.0
    comm_bytes: float = 0.0
    # per mesh axis: (axis, seconds on its link, seconds of it exposed, bytes a device
    # sends), where the formula splits its communication by axis (transformer shapes)
    comm_by_axis: tuple[tuple[str, float, float, float], ...] = ()
    # of compute_s, what the matrix products' shapes add beyond their FLOPs' time
    # (transformers on a GPU, ``--compute shape``: refdl.perf.gemm)
    shape_s: float = 0.0
    # of compute_s, the optimizer's elementwise update once a step (transformers known by
    # their shape: ``refdl.perf.costs.update_s``)
    update_s: float = 0.0
    # one worker's delay before each step, and how many groups advance independently
    # around it (refdl.perf.straggler); (0, 1): no straggler
    straggler: tuple[float, int] = (0.0, 1)

    @property
    def step_time_s(self) -> float:
        """Compute, communication and bubble, assumed not to overlap (an upper bound),
        and the wait for a straggler."""
        return self.compute_s + self.comm_s + self.bubble_s + self.wait_s

    @property
    def wait_s(self) -> float:
        """What a straggler adds to the step of ``W`` gradients (``refdl.perf.straggler``)."""
        base = self.compute_s + self.comm_s + self.bubble_s
        return straggled(base, *self.straggler) - base


def roofline_time(flops: float, bytes_accessed: float, hw: Hardware) -> float:
    """Roofline compute time ``max(flops / peak, bytes / bandwidth)`` (Williams et al. 2009)."""
    return max(flops / hw.peak_flops, bytes_accessed / hw.memory_bandwidth)


def _opt(default: Any, value: Any) -> Any:
    return dataclasses.field(default=default, metadata={"value": value})


# fp32 words of optimizer state a parameter carries (momentum's velocity; Adam's two moments)
GRAD_REDUCE = ("fp32", "compute")  # a transformer's gradients reduced in fp32 or not
OPTIMIZER_WORDS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "muon": 1}


@dataclasses.dataclass(frozen=True)
class PredictOptions:
    """What a prediction assumes beyond model, hardware, batch and workers; each field
    declares its value type (``refdl.config.values``) and ``validate`` checks them."""

    # data: ring, tree, recursive-doubling, rabenseifner (xla, halving-doubling: aliases)
    allreduce: str = _opt("ring", Choice(ALLREDUCE_MODELS))
    microbatches: int = _opt(4, Int(min=1, max=1 << 16))  # pipeline, fsdp (stages 2, 3)
    accumulate: int = _opt(1, Int(min=1, max=1 << 16))  # data: train's --microbatches slices
    zero: int = _opt(3, Int(min=1, max=3))  # fsdp: ZeRO stage
    schedule: str = _opt("1f1b", Choice(PIPELINE_SCHEDULES))  # pipeline
    chunks: int = _opt(1, Int(min=1, max=256))  # interleaved, looped-bfs pipeline
    # hybrid: data=..,model=..,pipe=.. (default: model=2, data=rest)
    mesh: MeshLayout | None = _opt(None, Optional(Parsed(MeshLayout, "data=-1,model=2")))  # noqa: RUF009
    servers: int = _opt(1, Int(min=1, max=1 << 16))  # ps
    ps_mode: str = _opt("sync", Choice(PS_MODES))  # ps
    ps_groups: int = _opt(1, Int(min=1, max=1 << 10))  # ps hierarchical: learner groups
    staleness: int | None = _opt(None, Optional(Int(min=0, max=1 << 20)))  # ps ssp: the bound
    softsync_n: int | None = _opt(None, Optional(Int(min=1, max=1 << 20)))  # ps softsync
    # ps, decentralized: one worker delayed this long before each step (refdl.perf.straggler)
    straggler: Straggler | None = _opt(None, Optional(Parsed(Straggler, "1:0.05")))  # noqa: RUF009
    sfb: str = _opt("off", Choice(("off", "auto", "all")))  # data: sufficient factors
    topology: str = _opt("ring", Text())  # decentralized
    gossip: bool = _opt(False, Flag())  # decentralized: one random matching of it a step
    # data: the compressed gradient exchange, topk:RATIO[,q8|q4] (q8/q4 with --allreduce
    # sparse), qsgd:LEVELS, terngrad or sign; decentralized: CHOCO-SGD's top-k messages
    compress: Compression | None = _opt(None, Optional(Parsed(Compression, "topk:0.01")))  # noqa: RUF009
    # fp32 optimizer words per parameter (momentum 1, adam 2, sgd 0)
    optimizer_words: int = _opt(1, Int(min=0, max=8))
    # Muon (refdl.perf.muon): None without it; fsdp's scheme, gather or owner
    muon: str | None = _opt(None, Optional(Choice(("gather", "owner"))))
    # share of the step's compute that communication may hide behind
    overlap: float = _opt(0.0, Float(min=0.0, max=1.0))
    # data: overlap the gradient allreduce with the backward pass in buckets of this many
    # MiB, in reverse layer order (refdl.perf.overlap; PyTorch DDP's 25); 0: use overlap
    bucket_mb: float = _opt(0.0, Float(min=0.0))
    # force the profile's "intra" or "inter" link (default: by size)
    link: str | None = _opt(None, Optional(Choice(("intra", "inter"))))
    # transformer shapes (refdl.perf.transformer): context attention, Megatron's sequence
    # parallelism, activation recomputation, and the compute precision (activation bytes)
    cp: str = _opt("ring", Choice(CONTEXT_ATTENTION))
    sequence_parallel: bool = _opt(False, Flag())
    remat: str = _opt("none", Choice(REMAT))
    # attention scores kept for the backward: none with a fused kernel (flash attention,
    # every current stack's default), 5 a s^2 b bytes a layer unfused
    attention: str = _opt("fused", Choice(("fused", "unfused")))
    # transformers on an NVIDIA GPU: each matrix product priced by its shape on the
    # device (a kernel's latency, small products' memory-bound excess; refdl.perf.gemm),
    # or every FLOP alike (flops)
    compute: str = _opt("shape", Choice(("shape", "flops")))
    # transformers: the gradients' reduction over data/fsdp in fp32, or in the compute
    # precision (Megatron-Core's grad_reduce_in_fp32=False)
    grad_reduce: str = _opt("fp32", Choice(GRAD_REDUCE))
    # transformers on pipe > 1: the layers where the second stage on begin (default: equal
    # stages, or a layer fewer at the ends where pipe does not divide the layers)
    stage_boundaries: tuple[int, ...] | None = _opt(None, Optional(Ints(like="7,15")))
    # transformers on a mesh: ZeRO stage over the data axis (1: optimizer state split over
    # it, 2: and the gradients; the fsdp axis is stage 3), moving the same bytes
    data_zero: int = _opt(0, Int(min=0, max=2))
    precision: str = _opt("fp32", Text())  # checked by the profile (refdl.hw.profile)

    def __post_init__(self) -> None:
        parse_typed(self)  # the mesh and codec given as text, parsed once

    def validate(self) -> PredictOptions:
        """Every field against its declared value type; a UsageError names the flag."""
        for f in dataclasses.fields(self):
            problem = f.metadata["value"].problem(getattr(self, f.name))
            if problem:
                raise UsageError(f"--{f.name.replace('_', '-')} must be {problem}")
        return self


def compute_time(
    flops: float,
    bytes_accessed: float,
    hw: Any,
    ops: float = 0,
    calls: float = 1,
    sharing: int = 1,
    work: Any = None,
    leaves: float = 0.0,
    transfer: tuple[float, float] = (0.0, 0.0),
    concurrent: bool = True,
    turns: int | None = None,
) -> float:
    """Time of one device's share of a step, times ``sharing`` when that many devices
    share one host's cores (simulated devices), plus the host's work.

    Of a device's time, the operations occupy the cores and add up over the
    ``sharing`` devices; the hand-offs between operations (``[device.in_step]``) are
    waits, which overlap the other devices' operations when the devices run at once
    (``concurrent``: one SPMD call, or one process each) and add up when a host
    executor runs them one after another (the pipeline's: over its ``turns`` stages, each
    an SPMD call over the devices of a stage; all ``sharing`` devices by default).

    Device: where the profile has operation rates (``[device.ops.*]``) and ``work``
    (``refdl.perf.ops.OpWork``) is given, the sum over operation kinds of Hockney's
    ``count x t0 + n / r_inf`` (``refdl.perf.ops.op_time``), as the profile's
    ``[device.in_step]`` says operations run inside a step; else the roofline of the
    FLOPs and bytes plus ``ops`` x the per-operation overhead. Host: ``calls`` dispatches
    (``dispatch``: ``calls x t0 + leaves / r``, leaves the argument leaves over all calls;
    else ``calls x dispatch_s``) plus ``transfer = (arrays, bytes)`` put on the device
    (``arrays x t0 + bytes / r``). Overheads a profile does not give are 0."""
    dev = getattr(hw, "device", None)
    rates = getattr(dev, "ops", {}) or {}
    share = sharing if getattr(dev, "shared_cores", False) else 1
    waits = 0.0
    if work is not None and work.kinds and rates:
        in_step = getattr(dev, "in_step", None)
        device = op_time(work, rates, hw, in_step)
        if in_step is not None:
            waits = in_step.handoff_s * sum(count for count, _ in work.kinds.values())
    else:
        device = roofline_time(flops, bytes_accessed, hw) + ops * getattr(dev, "op_overhead_s", 0.0)
    if "dispatch" in rates:
        host = rates["dispatch"].time(leaves, calls)
    else:
        host = calls * getattr(dev, "dispatch_s", 0.0)
    if "transfer" in rates and transfer[0]:
        host += rates["transfer"].time(transfer[1], transfer[0])
    in_turn = 1 if concurrent else min(share, turns or share)
    return (device - waits) * share + waits * in_turn + host


def add_transformer_flags(parser: Any) -> None:
    """``--compute`` and ``--grad-reduce``, as ``refdl predict`` and ``refdl plan`` both
    take them (``PredictOptions.compute`` / ``grad_reduce``)."""
    parser.add_argument("--compute", default="shape",
                        help="transformers on a GPU: shape (each matrix product priced by "
                             "its M, N, K: a kernel's latency, small products memory-bound; "
                             "default) or flops (every FLOP alike)")  # fmt: skip
    parser.add_argument("--grad-reduce", default="fp32",
                        help="transformers: reduce gradients over data/fsdp in fp32 "
                             "(default) or in the compute precision (compute: Megatron-"
                             "Core's grad_reduce_in_fp32=False)")  # fmt: skip


def exposed(comm_s: float, compute_s: float, overlap: float) -> float:
    """Communication left on the critical path when up to ``overlap x compute`` hides it."""
    return max(0.0, comm_s - overlap * compute_s)


def xla_cost(compiled: Any) -> tuple[float, float]:
    """``(flops, bytes accessed)`` from XLA's cost analysis of a compiled computation."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX returned one dict per computation
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))
