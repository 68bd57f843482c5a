"""Choosing a parallel configuration (``refdl plan``): every way a model can be laid out on
N devices, priced by the cost formulas of ``refdl.perf.costs``, those that do not fit
a device dropped, the fastest first.

A ``Config`` is a mesh over the axes (``data``, ``fsdp``, ``model``, ``context``,
``expert``, ``pipe``), a ZeRO stage over ``data`` (1: optimizer state, 2: and gradients;
the ``fsdp`` axis is stage 3), microbatches, a pipeline schedule and its chunks,
recomputation, the compute precision, and for a transformer sequence parallelism and
the context attention. What is enumerated, and what is not (dominated choices):

- meshes: every factorisation of N whose degrees the model allows (heads over
  ``model``, or for refdl's own models every width the tensor rules split, as train
  checks; the sequence over ``context``, experts over ``expert``, layers over
  ``pipe``, the global batch over ``data x fsdp x expert``);
- sequence parallelism whenever ``model`` > 1 (the same collective time, less memory);
- DualPipeV: priced as ZB-V, so a ZB-V row with ``m >= 2p`` names it as an equal choice;
- the ZeRO stage: the lowest that fits (every stage moves the same bytes here);
- without pipeline stages, the fewest microbatches that fit (more only add latency, and
  on an fsdp axis gathers);
  with them, 1F1B (GPipe's bubble with more memory is never chosen), interleaved with 2
  to 8 chunks, ZB-H1 and ZB-V where their closed-form bubble holds, over the
  microbatch counts that divide the batch (powers of two and the largest);
- recomputation none, selective and full (transformers; the other models' cost knows
  no recomputation); fp32, and bf16 where the device's bf16 peak is higher.

A model that is not a transformer is priced by the strategy formulas its mesh names
(``single``, ``data``, ``model``, ``pipeline``, ``hybrid``; ``fsdp`` for ZeRO over
every device). ``priced`` counts the configurations priced.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from refdl.config.mesh import AXES, MeshSpec
from refdl.config.plan import Traits
from refdl.errors import UsageError
from refdl.parallel.schedule import analytic_bubble
from refdl.perf import PredictOptions, intervals, muon
from refdl.perf.architectures import expected_view
from refdl.perf.costs import formula_of, link_of
from refdl.perf.model_cost import ModelCost, model_degree_problem
from refdl.perf.muon import SCHEMES
from refdl.perf.overlap import with_frameworks_overlap

REMATS = ("none", "selective", "full")
# Ties: two configurations whose predicted steps differ by less than this factor cannot
# be told apart. It is e^0.169, the 80th percentile of |log(predicted ratio / measured
# ratio)| over the 105 pairs of BLOOM's four measured layout searches (bench published's
# held-out part, BigScience tr11), as the step prices them (compute by shape, BLOOM's
# gradients reduced in fp16/bf16, its DeepSpeed's, and the data axis in two levels with
# each device's share of its node's NICs, since 2026-11-27, and the optimizer's update
# since 2026-11-28; e^0.173, e^0.165, e^0.168, e^0.169 before); the other sources'
# searches, not used for it, check it (refdl.bench.searches, docs/performance-model.md;
# a test recomputes it).
TIE_BAND = 1.183
MAX_CHUNKS = 8
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Config:
    """One way of laying a run out (see the module's docstring)."""

    mesh: MeshSpec
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    remat: str = "none"
    precision: str = "fp32"
    sequence_parallel: bool = False
    cp: str = "ring"
    muon: str = ""  # optimizer muon: how whole matrices are reached (Planner.muon_scheme)
    uneven: bool = False  # pipe does not divide the layers (refdl.perf.transformer.stage_layers)
    compress: str = ""  # data's compressed exchange (--compress; lossy: Planner's LOSSY)
    sparse: bool = False  # its top-k pairs summed by SparCML's allreduce (--allreduce sparse)

    def strategy(self, transformer: bool, owners: Mapping[str, Traits]) -> str:
        """The strategy that runs it (and whose cost formula prices it), asked of the
        registered strategies' traits (``owners``): of those stepping in lockstep over mesh
        axes that cover the layout's, the one sharding its state by ZeRO where ``zero`` is
        set (a transformer's ZeRO is the general one's data_zero), else the narrowest; a
        transformer on any axis takes the broadest, whose formula prices all six."""
        used = {a for a in AXES if getattr(self.mesh, a) > 1}
        sharded = bool(self.zero) and not transformer
        fits = [
            (len(t.axes), name)
            for name, t in owners.items()
            if not t.replicas and used <= set(t.axes) and t.shards_params == sharded
        ]
        if not fits:
            raise UsageError(f"no registered strategy runs {self.describe()}")
        broadest = transformer and bool(used)
        return min(fits, key=lambda f: (-f[0] if broadest else f[0], f[1]))[1]

    def describe(self) -> str:
        """The layout in a line: mesh, ZeRO, microbatches, schedule, remat, precision."""
        parts = [self.mesh.text() if self.mesh.size > 1 else "one device"]
        if self.zero:
            parts.append(f"ZeRO-{self.zero}")
        if self.mesh.pipe > 1:
            sched = self.schedule + (f"x{self.chunks}" if self.chunks > 1 else "")
            if self.schedule == "zbv" and _bubble_ok("dualpipev", self.mesh.pipe,
                                                     self.microbatches, 2):  # fmt: skip
                sched += " (or dualpipev, the same price)"
            parts.append(f"{sched} mb {self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"mb {self.microbatches}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.uneven:
            parts.append("uneven stages")
        if self.mesh.context > 1:
            parts.append(f"cp {self.cp}")
        if self.remat != "none":
            parts.append(f"remat {self.remat}")
        if self.muon:
            parts.append(f"muon {self.muon}")
        if self.compress:
            by = "SparCML's sparse allreduce" if self.sparse else "all-gathered"
            parts.append(f"gradients {self.compress} ({by}; changes the training)")
        parts.append(self.precision)
        return ", ".join(parts)

    def runnable(self, transformer: bool) -> bool:
        """Whether ``refdl train`` runs it: its hybrid has no ZeRO over data (``fsdp`` is
        the ZeRO axis) and splits a sequence over ``context`` or for sequence
        parallelism, not both."""
        if transformer and self.zero:
            return False
        return not (self.sequence_parallel and self.mesh.context > 1)

    def train_flags(self, transformer: bool, owners: Mapping[str, Traits]) -> list[str]:
        """``refdl train`` flags that run it (see ``runnable``) with the strategy of
        ``strategy(transformer, owners)``, whose traits say how it takes its layout: ZeRO's
        stage, pipeline stages, or a mesh over several axes."""
        name = self.strategy(transformer, owners)
        traits = owners[name]
        flags = ["--strategy", name, "--devices", str(self.mesh.size)]
        if traits.shards_params:
            flags += ["--zero", str(self.zero)]
        elif traits.pipeline:
            flags += ["--stages", str(self.mesh.pipe)]
        elif len(traits.axes) > 1:
            flags += ["--mesh", self.mesh.text()]
        if self.mesh.pipe > 1 or self.microbatches > 1:
            flags += ["--microbatches", str(self.microbatches)]
        if self.mesh.pipe > 1:
            flags += ["--schedule", self.schedule]
            if self.chunks > 1 and self.schedule == "interleaved":
                flags += ["--chunks", str(self.chunks)]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        if self.mesh.context > 1:
            flags += ["--cp", self.cp]
        if self.muon:
            flags += ["--optimizer", "muon"]
            if "muon" in traits.options and self.muon in SCHEMES:
                flags += ["--muon", self.muon]
        if self.compress:
            flags += ["--compress", self.compress, *(["--allreduce", "sparse"] if self.sparse
                                                      else [])]  # fmt: skip
        return [*flags, "--remat", self.remat, "--precision", self.precision]


@dataclasses.dataclass(frozen=True)
class Priced:
    """A configuration with its predicted step, memory, and the terms the step adds up."""

    config: Config
    step_time_s: float
    low_s: float | None
    high_s: float | None
    memory_bytes: int
    terms: dict[str, float]  # compute, bubble, and each axis's exposed communication

    @property
    def dominant(self) -> str:
        """The term that takes most of the step."""
        return max(self.terms, key=self.terms.__getitem__)


@dataclasses.dataclass
class Search:
    """A search's result: the configurations that fit, fastest first, and its counts."""

    found: list[Priced]
    priced: int
    meshes: int
    too_big: int
    tied: int = 0  # configurations within TIE_BAND of the fastest (all of them counted)
    tie_set: list[Priced] = dataclasses.field(default_factory=list)  # those configurations


# Within a tie set the model cannot rank configurations by time (TIE_BAND), so ``refdl
# plan`` orders them by what is simpler to run (issue 52): memory headroom (at most
# HEADROOM of the limit), then fewer mesh axes, a plainer schedule, less recomputation;
# the predicted step last. ``plainness`` is the key, ``why_plainer`` says which decided.
HEADROOM = 0.9
SCHEDULE_RANK = {"gpipe": 0, "1f1b": 0, "interleaved": 1, "looped-bfs": 1, "zb-h1": 2,
                 "zbv": 2, "dualpipev": 2}  # fmt: skip
REMAT_RANK = {"none": 0, "selective": 1, "full": 2}


def layout_plainness(mesh: MeshSpec, schedule: str, remat: str) -> tuple[int, int, int]:
    """A layout's mesh axes in use, its schedule's rank (where it has a pipeline) and its
    recomputation's: smaller is plainer (``plainness``, and bench published's searches)."""
    axes = sum(getattr(mesh, a) > 1 for a in AXES)
    return axes, SCHEDULE_RANK.get(schedule, 2) if mesh.pipe > 1 else 0, REMAT_RANK.get(remat, 2)


def plainness(p: Priced, limit: float) -> tuple[bool, bool, int, int, int, float]:
    """The secondary order of a tie set, smallest first (see ``HEADROOM``): a compressed
    exchange, which changes the training, comes after every exact configuration."""
    c = p.config
    return (p.memory_bytes > HEADROOM * limit, bool(c.compress),
            *layout_plainness(c.mesh, c.schedule, c.remat), p.step_time_s)  # fmt: skip


def why_plainer(a: Priced, b: Priced, limit: float) -> str:
    """Which criterion of ``plainness`` puts ``a`` before ``b`` (both in the tie set)."""
    ka, kb = plainness(a, limit), plainness(b, limit)
    if ka[0] != kb[0]:
        return (f"leaves memory headroom ({a.memory_bytes / limit:.0%} of the limit, the next "
                f"{b.memory_bytes / limit:.0%})")  # fmt: skip
    if ka[1] != kb[1]:
        return f"trains exactly (the next compresses its gradients: {b.config.compress})"
    if ka[2] != kb[2]:
        return f"uses fewer mesh axes ({ka[2]}, the next {kb[2]})"
    if ka[3] != kb[3]:
        return f"has a plainer schedule ({a.config.schedule}, the next {b.config.schedule})"
    if ka[4] != kb[4]:
        return f"recomputes less ({a.config.remat}, the next {b.config.remat})"
    return "is predicted faster"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def meshes(n: int, axes: tuple[str, ...]) -> Iterator[MeshSpec]:
    """Every mesh over ``axes`` whose degrees multiply to ``n``."""

    def rec(rest: int, i: int, got: dict[str, int]) -> Iterator[MeshSpec]:
        if i == len(axes) - 1:
            yield MeshSpec(**got, **{axes[i]: rest})
            return
        for d in divisors(rest):
            yield from rec(rest // d, i + 1, {**got, axes[i]: d})

    yield from rec(n, 0, {})


def mb_choices(per_replica: int) -> list[int]:
    """Microbatch counts tried: the powers of two that divide a replica's batch, and the
    batch itself (one sequence a microbatch)."""
    out = [m for m in (2**k for k in range(0, 21)) if m <= per_replica and per_replica % m == 0]
    return sorted({*out, per_replica})


@functools.lru_cache(maxsize=1 << 16)
def _bubble_ok(schedule: str, p: int, m: int, v: int) -> bool:
    return analytic_bubble(schedule, p, m, v) is not None


def schedules(p: int, m: int, layers: int) -> list[tuple[str, int]]:
    """The pipeline schedules tried for ``p`` stages and ``m`` microbatches."""
    if p == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    if layers % p:  # uneven stages: one stage a device
        return out + [("zb-h1", 1)] * _bubble_ok("zb-h1", p, m, 1)
    if m % p == 0:
        out += [("interleaved", v) for v in range(2, MAX_CHUNKS + 1)
                if layers % (p * v) == 0]  # fmt: skip
    out += [(s, 1) for s in ("zb-h1", "zbv") if _bubble_ok(s, p, m, 2 if s == "zbv" else 1)]
    if ("zbv", 1) in out and layers % (2 * p):
        out.remove(("zbv", 1))
    # DualPipeV: ZB-V's V of stages, priced as ZB-V (the same closed-form bubble where it
    # holds, m >= 2p, inside ZB-V's own range): searched as ZB-V's rows, which name it
    # (Config.describe) rather than repeat each one at the same price
    return out


# data's compressed exchanges ``refdl plan --lossy`` prices beside the exact layouts, as
# refdl train runs them (--compress, --allreduce sparse): SparCML's top-1 % sparse
# allreduce, with 4-bit values too, and QSGD's, TernGrad's and signSGD's all-gathered
# payloads. Each changes the training: what it saves must be weighed against accuracy.
LOSSY = (("topk:0.01", True), ("topk:0.01,q4", True), ("qsgd:16", False),
         ("terngrad", False), ("sign", False))  # fmt: skip


class Planner:
    """Prices the configurations of ``model`` (a ``ModelCost``) on ``profile`` at a global
    ``batch`` over ``devices`` (see the module's docstring)."""

    def __init__(
        self,
        model: ModelCost,
        profile: Any,
        devices: int,
        batch: int,
        *,
        memory_limit: float | None = None,
        precisions: tuple[str, ...] | None = None,
        optimizer_words: int = 2,
        library: str | None = None,
        runnable_only: bool = False,
        strategies: Mapping[str, Traits],
        muon: bool = False,
        lossy: bool = False,
        compute: str = "shape",
        grad_reduce: str = "fp32",
    ) -> None:
        self.m, self.profile, self.n, self.batch = model, profile, devices, batch
        self.owners = strategies  # the registered strategies' traits, by name
        self.shape = model.transformer
        dev = profile.need_device()
        self.limit = memory_limit if memory_limit is not None else dev.memory_bytes
        # fp32, and bf16 where the device computes it faster (on a CPU it only rounds)
        fp32 = dev.peak_flops.get(DTYPES["fp32"], 0.0)
        faster = dev.peak_flops.get(DTYPES["bf16"], 0.0) > fp32
        self.precisions = precisions or (("fp32", "bf16") if faster else ("fp32",))
        self.words, self.library, self.runnable_only = optimizer_words, library, runnable_only
        self.muon = muon  # optimizer muon: each configuration's Newton-Schulz priced
        self.lossy = lossy  # data's compressed exchanges (LOSSY) priced beside the exact ones
        self.compute = compute  # transformers: products by shape, or every FLOP alike
        self.grad_reduce = grad_reduce  # transformers: gradients reduced in fp32 or not
        self._views: dict[str, Any] = {}
        self.priced = self.too_big = self.mesh_count = 0

    def view(self, precision: str) -> Any:
        """The profile's expected figures for ``precision`` (cached), with the
        architecture's factor for a convolutional model, as ``refdl predict`` prices it."""
        if precision not in self._views:
            self._views[precision] = expected_view(self.profile, precision, self.m, self.library)
        return self._views[precision]

    # -- the space ----------------------------------------------------------------------------

    def axes(self) -> tuple[str, ...]:
        """The mesh axes the model's cost formulas price."""
        if self.shape is None:
            return ("data", "model", "pipe")
        return ("data", "fsdp", *(("expert",) if self.shape.experts else ()), "model",
                "context", "pipe")  # fmt: skip

    def sequence_parallel(self, mesh: MeshSpec) -> bool:
        """Sequence parallelism where it is possible (a transformer split over ``model``):
        the same collective time, less memory. refdl train splits the sequence over
        ``context`` or for sequence parallelism, not both (``runnable_only``)."""
        both = self.runnable_only and mesh.context > 1
        return self.shape is not None and mesh.model > 1 and not both

    def valid(self, mesh: MeshSpec) -> bool:
        """Whether the model allows ``mesh``'s degrees and the batch splits over it."""
        replicas = mesh.replicas
        if self.batch % replicas:
            return False
        s = self.shape
        if s is None:  # train's own check of the widths split over model
            return mesh.pipe <= self.m.layers and not model_degree_problem(self.m, mesh.model)
        if s.heads % mesh.model or s.seq % mesh.context or s.layers < mesh.pipe:
            return False  # uneven stages where pipe does not divide the layers (1f1b, zb-h1)
        return not (mesh.expert > 1 and (not s.experts or s.experts % mesh.expert))

    def candidates(self, mesh: MeshSpec, precisions: tuple[str, ...]) -> Iterator[Config]:
        """The configurations tried on ``mesh`` (before the ZeRO and microbatch choices
        that depend on memory)."""
        replicas = mesh.replicas
        per = self.batch // replicas
        remats = REMATS if self.shape is not None else ("none",)
        cps = ("ring", "all-to-all") if mesh.context > 1 else ("ring",)
        layers = self.shape.layers if self.shape is not None else self.m.layers
        for precision in precisions:
            for remat in remats:
                for cp in cps:
                    if cp == "all-to-all" and self.shape.heads % (mesh.model * mesh.context):
                        continue
                    sp = self.sequence_parallel(mesh)
                    base = Config(mesh, precision=precision, remat=remat, cp=cp,
                                  sequence_parallel=sp,
                                  uneven=bool(layers % mesh.pipe))  # fmt: skip
                    if mesh.pipe == 1:
                        yield base
                        if self.lossy and self.shape is None and mesh.data == mesh.size > 1:
                            for text, sparse in LOSSY:
                                yield dataclasses.replace(base, compress=text, sparse=sparse)
                        continue
                    for m in mb_choices(per):
                        if m < mesh.pipe:
                            continue
                        for sched, v in schedules(mesh.pipe, m, layers):
                            yield dataclasses.replace(base, microbatches=m, schedule=sched,
                                                      chunks=v)  # fmt: skip

    # -- prices ---------------------------------------------------------------------------

    def price(self, c: Config) -> Priced:
        """Step time, interval, memory and terms of ``c`` (``UsageError`` where a formula
        refuses it)."""
        self.priced += 1
        strategy, opts, r = self.formula_cost(c)
        hw = self.view(c.precision)
        terms = {"compute": r.compute_s, "bubble": r.bubble_s}
        if r.comm_by_axis:
            terms.update({f"comm {a}": e for a, _, e, _ in r.comm_by_axis})
        else:
            terms["comm"] = r.comm_s
        if self.muon:
            before = r.step_time_s
            c, r = self.muon_scheme(c, r, hw, opts, "muon" in self.owners[strategy].options)
            terms["muon"] = r.step_time_s - before
        dtype = self.profile.dtype_for(c.precision)
        kind, borrowed = intervals.step_kind(self.profile, dtype, self.m.op_class)
        iv = intervals.time_interval(kind, r.step_time_s, borrowed)
        return Priced(c, r.step_time_s, *(iv or (None, None)), int(r.memory_bytes), terms)

    def formula_cost(self, c: Config) -> tuple[str, PredictOptions, Any]:
        """The strategy that runs ``c``, the options it is priced with, and its cost
        formula's breakdown (Muon's terms not yet added)."""
        opts = PredictOptions(
            mesh=c.mesh.text(), microbatches=c.microbatches, schedule=c.schedule,
            accumulate=c.microbatches if c.mesh.pipe == 1 else 1,  # data's: train's
            chunks=c.chunks, zero=c.zero or 3, data_zero=c.zero if self.shape else 0,
            optimizer_words=self.words, cp=c.cp, sequence_parallel=c.sequence_parallel,
            remat=c.remat, precision=c.precision, compress=c.compress or None,
            allreduce="sparse" if c.sparse else "ring", compute=self.compute,
            grad_reduce=self.grad_reduce,
        )  # fmt: skip
        opts = with_frameworks_overlap(self.profile, opts)  # refdl predict's expectation
        strategy = c.strategy(self.shape is not None, self.owners)
        formula = formula_of(self.owners[strategy])
        return strategy, opts, formula(self.m, self.view(c.precision), self.batch, c.mesh.size,
                                       opts)  # fmt: skip

    def muon_scheme(self, c: Config, r: Any, hw: Any, opts: PredictOptions,
                    choosable: bool) -> tuple[Config, Any]:  # fmt: skip
        """``c`` named with how Muon reaches whole matrices, and ``r`` with Muon's terms
        (``refdl.perf.muon.on_mesh``): each device runs Newton-Schulz on ``1/(model x
        pipe)`` of the matrices (``sharded-ns`` where ``model`` > 1: XLA's products,
        their collectives not counted; else ``replicated``, every replica again); where
        ZeRO shards the state over ``fsdp x data`` ranks, the faster of ``gather`` and
        ``owner`` if the strategy offers the choice (``choosable``), else XLA's sharded
        products priced as ``gather``."""
        mesh = c.mesh
        split, shards, expert = muon.mesh_split(mesh, c.zero)
        if shards == 1:
            name = "sharded-ns" if mesh.model > 1 else "replicated"
            priced = muon.on_mesh(r, self.m, hw, split, 1, "gather", None, expert)
            return dataclasses.replace(c, muon=name), priced
        link = link_of(hw, shards, opts)
        priced = {k: muon.on_mesh(r, self.m, hw, split, shards, k, link, expert)
                  for k in (SCHEMES if choosable else ("gather",))}  # fmt: skip
        best = min(priced, key=lambda k: priced[k].step_time_s)
        name = best if choosable else "sharded-ns"
        return dataclasses.replace(c, muon=name), priced[best]

    def fitted(self, c: Config) -> Priced | None:
        """``c`` at the lowest ZeRO stage and (without stages) the fewest microbatches that
        fit the memory limit; None where nothing fits."""
        per = self.batch // (c.mesh.data * c.mesh.fsdp * c.mesh.expert)
        zeros = (0, 1, 2) if c.mesh.data > 1 and (self.shape is not None or c.mesh.size
                                                    == c.mesh.data) else (0,)  # fmt: skip
        if self.runnable_only and (self.shape is not None or c.mesh.size != c.mesh.data):
            zeros = (0,)
        mbs = mb_choices(per) if c.mesh.pipe == 1 else [c.microbatches]
        for zero in zeros:
            for m in mbs:
                cand = dataclasses.replace(c, zero=zero, microbatches=m)
                try:
                    p = self.price(cand)
                except UsageError:
                    continue
                if p.memory_bytes <= self.limit:
                    return p
                self.too_big += 1
        return None

    def bound(self, mesh: MeshSpec, precision: str) -> float:
        """A lower bound of every step on ``mesh`` in ``precision``: the compute without
        recomputation and the data and fsdp axes' collectives at one microbatch (no
        schedule or recomputation changes them; more microbatches only add fsdp's
        gathers), inf where the mesh cannot run at all."""
        sp = self.sequence_parallel(mesh)
        least = float("inf")  # the least over the context attentions (their compute differs
        for cp in ("ring", "all-to-all"):  # by shape: a ring pays a kernel a block)
            cfg = Config(mesh, precision=precision, sequence_parallel=sp, cp=cp)
            try:
                p = self.price(cfg)
            except UsageError:
                continue
            keep = ("compute", "comm data", "comm fsdp")
            least = min(least, sum(v for k, v in p.terms.items() if k in keep))
            if mesh.context == 1:
                break  # no context axis: the attention's kind changes nothing
        return least

    def search(
        self, top: int | None = None, tick: Callable[[int, int], None] | None = None
    ) -> Search:
        """Every valid configuration priced; those that fit, fastest first. With ``top``,
        only the first ``top``: meshes are visited in the order of their lower bound
        (``bound``) and those whose bound cannot beat the ``top``-th found are skipped.
        ``tick(done, total)``: called as the (mesh, precision) pairs are visited."""
        found: list[Priced] = []
        order = []
        for mesh in meshes(self.n, self.axes()):
            if self.valid(mesh):
                self.mesh_count += 1
                order += [(self.bound(mesh, pr), i, mesh) for i, pr in enumerate(self.precisions)]
        order.sort(key=lambda x: x[0])
        worst: list[float] = []  # the top fastest step times so far (a max-heap, negated)
        best = float("inf")
        for k, (lower, i, mesh) in enumerate(order):
            if tick is not None:
                tick(k, len(order))
            if top and len(worst) >= top and lower >= max(-worst[0], best * TIE_BAND):
                break  # no later mesh can enter the top, nor tie with the fastest
            for c in self.candidates(mesh, (self.precisions[i],)):
                p = self.fitted(c)
                if p is None:
                    continue
                found.append(p)
                best = min(best, p.step_time_s)
                if top:
                    heapq.heappush(worst, -p.step_time_s)
                    if len(worst) > top:
                        heapq.heappop(worst)
        if tick is not None:
            tick(len(order), len(order))
        found.sort(key=lambda p: (p.step_time_s, p.memory_bytes))
        tie_set = [p for p in found if p.step_time_s <= best * TIE_BAND]
        return Search(found[:top] if top else found, self.priced, self.mesh_count, self.too_big,
                      len(tie_set), tie_set)  # fmt: skip


def why_first(a: Priced, b: Priced) -> str:
    """Why ``a`` beats ``b``: the terms that differ most, with their signs."""
    keys = sorted(set(a.terms) | set(b.terms))
    diffs = sorted(((a.terms.get(k, 0.0) - b.terms.get(k, 0.0), k) for k in keys),
                   key=lambda d: abs(d[0]), reverse=True)  # fmt: skip
    said = [f"{k} {_ms(d, sign=True)}" for d, k in diffs[:3] if abs(d) > 1e-9]
    gap = b.step_time_s - a.step_time_s
    if b.step_time_s <= a.step_time_s * TIE_BAND:
        apart = b.step_time_s / a.step_time_s - 1
        return (f"indistinguishable from the next: {'< 0.1%' if apart < 1e-3 else f'{apart:.1%}'} "
                f"apart, within the model's paired error of {TIE_BAND - 1:.0%} "
                f"({'; '.join(said) or 'the same terms'})")  # fmt: skip
    if gap <= 0:
        return f"as fast as the next ({'; '.join(said) or 'the same terms'}): a tie"
    return f"{_ms(gap)} faster than the next ({'; '.join(said) or 'the same terms'})"


def _ms(seconds: float, sign: bool = False) -> str:
    """A time difference in ms, or in us below 0.1 ms (never "0.0 ms")."""
    plus = "+" if sign else ""
    if abs(seconds) >= 1e-4:
        return f"{seconds * 1e3:{plus}.1f} ms"
    return f"{seconds * 1e6:{plus}.2g} us"
