"""Step-cost formulas of each strategy, from a model's cost and a hardware profile.

The formulas live here side by side so they can be read and compared, looked up
by strategy name in ``COSTS`` (a strategy written elsewhere registers its own
with ``@COSTS.register(name)``); the strategy modules themselves know nothing
of the performance model. Conventions: ``batch`` is the global batch of one step,
``workers`` the devices (ranks) it runs on; compute is, for the work one device
does (``refdl.perf.compute_time``), the sum of Hockney's ``t0 + n / r_inf`` over
the compiled step's operations where the profile gives operation rates and the
model was compiled (``refdl.perf.ops``), else the roofline of XLA's FLOPs and
bytes, plus the host's dispatch and batch transfer;
communication is alpha-beta (``refdl.perf.collectives``) on the link the
profile gives for that many workers; compute and communication do not overlap
unless ``PredictOptions.overlap`` says so (Horovod-style overlap hides at most
that share of the compute) or, for data parallelism, ``bucket_mb`` asks for the
frameworks' bucketed overlap (``refdl.perf.overlap``). Memory per device is parameters + gradients +
optimizer words, plus the activations kept for the backward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from refdl.comm.compress import SPARSE, make_codec
from refdl.comm.topology import adjacency
from refdl.config.choices import SPLIT_BACKWARD, V_SHAPED, chunks_of
from refdl.config.mesh import MeshSpec
from refdl.config.plan import check_schedule
from refdl.core.layers import sfb_mode
from refdl.errors import UsageError
from refdl.parallel.schedule import bubble as bubble_fraction
from refdl.perf import CostBreakdown, PredictOptions, compute_time, exposed, gemm, straggler
from refdl.perf.collectives import (
    ALLREDUCE,
    Link,
    allgather_ring,
    allreduce_ring,
    allreduce_sparse,
    neighbour_exchange,
    ps_push_pull,
)
from refdl.perf.model_cost import ModelCost, model_degree_problem
from refdl.perf.overlap import bucketed_step
from refdl.perf.transformer import (
    ACT_BYTES,
    Nodes,
    activation_bytes,
    axis_comm,
    axis_links,
    check_mesh,
    fsdp_gathered_bytes,
    remat_factor,
    stage_layers,
    stage_params,
    state_bytes,
)
from refdl.registry import Registry

CostFormula = Callable[[ModelCost, Any, int, int, PredictOptions], CostBreakdown]
# Step-cost formulas by their own names; a strategy names its formula in its Traits
# (``Traits.cost``), so a strategy written elsewhere adds its formula here and names it.
FORMULAS: Registry[CostFormula] = Registry("cost model")


def formula_of(traits: Any) -> CostFormula:
    """The step-cost formula a strategy's traits name (``Traits.cost``)."""
    if not traits.cost:
        raise UsageError("this strategy names no step-cost formula (Traits.cost); register one "
                         "in refdl.perf.costs.FORMULAS and name it")  # fmt: skip
    return FORMULAS.get(traits.cost)


ALLREDUCE_ALIASES = {"xla": "ring", "halving-doubling": "rabenseifner"}


def link_of(hw: Any, workers: int, opts: PredictOptions) -> Any:
    """The alpha-beta link a formula prices ``workers`` ranks on (``_link``)."""
    return _link(hw, workers, opts) if workers > 1 else None


def _link(hw, workers: int, opts: PredictOptions):
    """The alpha-beta link for ``workers`` ranks: the profile's choice, or ``opts.link``."""
    if opts.link is not None:
        if opts.link not in hw.links:
            raise UsageError(f"profile {hw.name} has no {opts.link!r} link")
        return hw.links[opts.link].alpha_beta()
    return hw.link(workers).alpha_beta()


def nodes_of(hw: Any, opts: PredictOptions) -> Nodes | None:
    """The profile's nodes for a group spanning several (``transformer.Nodes``), None
    where a link is forced (``opts.link``) or the profile has no two levels."""
    links = getattr(hw, "links", {})
    if opts.link is not None or "intra" not in links or "inter" not in links:
        return None
    return Nodes(hw.devices_per_node, links["intra"].alpha_beta(), links["inter"].alpha_beta(),
                 links["inter"].nics_per_node)  # fmt: skip


def host_work(m: ModelCost, batch: float, buffers: int = 1) -> dict:
    """Host work of one step call: the state's and the batch's argument leaves (each of
    ``buffers`` device buffers, one per device it is split over) and the batch put on the
    devices (``compute_time``'s ``leaves`` and ``transfer``)."""
    leaves = (m.state_leaves + m.input_leaves) * buffers
    return {
        "leaves": leaves,
        "transfer": (m.input_leaves * buffers, batch * m.input_bytes_per_sample),
    }


def stage_walk(
    m: ModelCost, batch: float, p: int, mb: int, schedule: str, chunks: int,
    split: float = 1, buffers: int = 1,
) -> dict:  # fmt: skip
    """``compute_time``'s host and operation terms for a step the pipeline executor walks
    (``refdl.strategies.pipeline``), ``batch`` samples over ``p`` stages, each device's
    operations ``split`` ways smaller (tensor splits inside a stage), ``buffers`` devices a
    stage (the arrays each call passes and puts). The executor makes one call per
    forward and per backward of a microbatch on a stage chunk (three with the split
    backward), plus one optimizer update per stage; each call passes a stage's share of the
    state and a microbatch (or its gradient), each forward and backward puts one array on
    its stage's devices; per microbatch a stage runs about 1/p of the step's operations,
    its devices one after another (the host waits between them)."""
    v = chunks_of(schedule, chunks)
    calls = (3 if schedule in SPLIT_BACKWARD else 2) * mb * p * v + p
    return {
        "ops": mb * m.ops / p,
        "calls": calls,
        "work": m.op_work(batch / mb).scaled(share=mb / (p * split), repeat=mb / p),
        "leaves": calls * (m.state_leaves / p + m.input_leaves) * buffers,
        "transfer": (2 * mb * p * v * buffers,
                     batch * (m.input_bytes_per_sample + 2 * m.boundary_bytes_per_sample)),
        "concurrent": False,
        "turns": p,
    }  # fmt: skip


def _tp_comm(m: ModelCost, batch: float, tp: int, link) -> float:
    """The collectives of a ``tp``-way tensor-parallel step on ``batch`` samples: the
    model's own (``ModelCost.tp_collectives``: ring all-reduces and all-gathers of
    activations) where known, else per layer two all-reduces (forward, backward) of its
    output (Megatron-LM's count; Shoeybi et al. 2019)."""
    if m.tp_collectives:
        ring = {"allreduce": allreduce_ring, "allgather": allgather_ring}
        return sum(ring[op](batch * n, tp, link) for op, n in m.tp_collectives)
    return 2 * m.layers * allreduce_ring(batch * m.boundary_bytes_per_sample, tp, link)


def _state_bytes(m: ModelCost, opts: PredictOptions, shard: float = 1.0) -> float:
    """Parameters, gradients and optimizer words per device, for a 1/shard share."""
    return (2 + opts.optimizer_words) * m.param_bytes / shard


# The transformer options a formula takes no account of: why, and the mesh axis that gives
# a comparable layout to the mesh formula (``transformer_step``), which prices them. data,
# fsdp, pipeline, ps and decentralized price a transformer from its totals.
_WHOLE = "takes a transformer's activations whole, scores or not"
_FP32 = "reduces fp32 gradients, as refdl's strategy does"
_NONE = "reduces no gradients (no data or fsdp axis)"
UNPRICED = {
    ("attention", "data_parallel"): (_WHOLE, "data"),
    ("attention", "zero_sharding"): (_WHOLE, "fsdp"),
    ("attention", "pipeline"): (_WHOLE, "pipe"),
    ("attention", "parameter_server"): (_WHOLE, None),
    ("attention", "gossip"): (_WHOLE, None),
    ("attention", "context"): ("keeps no attention scores on more than one rank", None),
    ("grad_reduce", "data_parallel"): (_FP32, "data"),
    ("grad_reduce", "zero_sharding"): (_FP32, "fsdp"),
    ("grad_reduce", "parameter_server"): (_FP32, None),
    ("grad_reduce", "gossip"): (_FP32, None),
    ("grad_reduce", "pipeline"): (_NONE, None),
    ("grad_reduce", "one_device"): (_NONE, None),
    ("grad_reduce", "tensor"): (_NONE, None),
    ("stage_boundaries", "pipeline"): ("prices P equal stages of a transformer's totals", "pipe"),
}


def unpriced(option: str, formula: str, ranks: int) -> tuple[str | None, str | None]:
    """Why ``formula`` on ``ranks`` workers would take no account of the transformer
    ``option`` (None where it prices it), and the mesh axis of a comparable layout that
    would. ``context`` on one rank has no context axis: it keeps the scores."""
    if formula == "context" and ranks == 1:
        return None, None
    return UNPRICED.get((option, formula), (None, None))


def _accumulated(m: ModelCost, batch: int, workers: int, mb: int) -> float:
    """Bytes of a worker's activations with ``mb`` accumulated slices of its share of
    ``batch`` (train's ``--microbatches``): one slice's, and beside them the fp32 sum of
    the slices' gradients (scan's carry) where there are several."""
    b = batch / workers
    if b < mb:
        raise UsageError(f"--batch-size {batch} on {workers} workers leaves {b:g} samples "
                         f"each, fewer than --microbatches {mb}; give at least "
                         f"{workers * mb}")  # fmt: skip
    if mb > 1 and b % mb:  # train's check_batch refuses unequal slices
        raise UsageError(f"each replica's {b:g} samples do not split into --microbatches "
                         f"{mb} equal slices; give a batch that does")  # fmt: skip
    return b / mb * m.activation_bytes_per_sample + (4.0 * m.params if mb > 1 else 0.0)


@FORMULAS.register("one_device")
def single(m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions) -> CostBreakdown:
    """The whole step on one device: compute (operations or roofline), no communication."""
    if workers != 1:
        raise UsageError("--strategy single runs on 1 worker; use --workers 1")
    t = compute_time(
        m.flops(batch), m.bytes(batch), hw, ops=m.ops, work=m.op_work(batch), **host_work(m, batch)
    )
    shaped = whole_model_shape(m, hw, batch, MeshSpec(), opts)
    update = update_s(m, hw, m.params, opts)
    t += shaped + update
    if m.transformer is not None:  # in the compute precision, as on a mesh (a 1x1 one)
        one = MeshSpec()
        mem = state_bytes(m.transformer, one, opts.optimizer_words, 0, opts.precision)
        mem += activation_bytes(m.transformer, one, batch, 1, 1, False, opts.remat,
                                opts.precision, fused=opts.attention == "fused")  # fmt: skip
    else:
        mem = _state_bytes(m, opts) + batch * m.activation_bytes_per_sample
    return CostBreakdown(compute_s=t, memory_bytes=int(mem), flops=m.flops(batch), shape_s=shaped,
                         update_s=update)  # fmt: skip


@FORMULAS.register("data_parallel")
def data(m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions) -> CostBreakdown:
    """Each worker computes B/P samples, then one allreduce of all fp32 gradients. With
    ``accumulate`` m (train's ``--microbatches``) it holds one slice's activations, B/(P m)
    samples, and the slices' gradient sum (``_accumulated``), and a transformer's shapes
    are priced per slice; a compiled step's own per-slice overhead is not (as ``fsdp``'s
    microbatches: see docs/performance-model.md)."""
    b, mb = batch / workers, opts.accumulate
    held = _accumulated(m, batch, workers, mb)
    t = compute_time(m.flops(b), m.bytes(b), hw, ops=m.ops, sharing=workers,
                     work=m.op_work(b), **host_work(m, batch, workers))  # fmt: skip
    shaped = whole_model_shape(m, hw, b, MeshSpec(data=workers), opts, microbatches=mb)
    t += shaped
    update = update_s(m, hw, m.params, opts)  # after the gradients' exchange: no overlap
    if opts.compress is not None or opts.allreduce in SPARSE:
        comm, coding, wire = compressed_exchange(m, hw, workers, opts)
        mem = _state_bytes(m, opts) + held + 4.0 * m.params
        return CostBreakdown(compute_s=t + coding + update,
                             comm_s=exposed(comm, t, opts.overlap), memory_bytes=int(mem),
                             flops=m.flops(b), comm_bytes=wire, shape_s=shaped,
                             update_s=update)  # fmt: skip
    algo = ALLREDUCE_ALIASES.get(opts.allreduce, opts.allreduce)
    if algo not in ALLREDUCE:
        raise UsageError(f"unknown --allreduce {opts.allreduce!r}; choose {', '.join(ALLREDUCE)}")

    _link(hw, workers, opts)  # a forced link the profile lacks is a usage error

    def allreduce(n: float) -> float:
        if hasattr(hw, "allreduce_time"):
            return hw.allreduce_time(n, workers, algo, opts.link)
        return ALLREDUCE[algo](n, workers, _link(hw, workers, opts))

    comm = allreduce(m.param_bytes)
    if opts.sfb != "off" and workers > 1:
        comm = sufficient_factors(m, b, workers, opts, allreduce, _link(hw, workers, opts))
        comm_s = exposed(comm, t, opts.overlap)
    elif opts.bucket_mb > 0 and workers > 1:
        step = bucketed_step(t, m.layer_param_bytes, allreduce, cap=opts.bucket_mb * 2**20)
        comm_s = step.exposed_s
    else:
        comm_s = exposed(comm, t, opts.overlap)
    wire = 2 * (workers - 1) * m.param_bytes if workers > 1 else 0  # ring: all ranks
    mem = _state_bytes(m, opts) + held
    return CostBreakdown(
        compute_s=t + update,
        comm_s=comm_s,
        memory_bytes=int(mem),
        flops=m.flops(b),
        comm_bytes=wire,
        shape_s=shaped,
        update_s=update,
    )


def compressed_exchange(m: ModelCost, hw: Any, p: int,
                        opts: PredictOptions) -> tuple[float, float, float]:  # fmt: skip
    """``--compress`` on data (``refdl.comm.compress``), priced: each rank encodes its fp32
    gradient (three passes over it: read it with its residual, select or quantize, keep
    the new residual), the payloads are all-gathered, or with ``--allreduce sparse``
    (``sparse-split``) the top-k pairs are summed by SparCML's allreduce
    (``allreduce_sparse``), and each rank decodes what it receives (every payload into a
    dense sum; the sparse allreduce's sum is written once). The passes are memory-bound.
    Returns the exchange's seconds, the coding's, and the bytes all ranks send."""
    if opts.compress is None:
        raise UsageError(f"--allreduce {opts.allreduce} sums top-k pairs: add --compress "
                         "topk:RATIO (e.g. topk:0.01 or topk:0.01,q4)")  # fmt: skip
    codec, n = make_codec(opts.compress), int(m.params)
    link = _link(hw, p, opts) if p > 1 else None
    if opts.allreduce in SPARSE:
        if codec.kind != "topk":
            raise UsageError(f"--allreduce {opts.allreduce} sums top-k pairs, not "
                             f"--compress {opts.compress}")  # fmt: skip
        comm = allreduce_sparse(4.0 * n, p, link, codec.ratio, codec.bits,
                                SPARSE[opts.allreduce]) if p > 1 else 0.0  # fmt: skip
        decode = 4.0 * n
    else:
        if codec.bits != 32:
            raise UsageError(f"--compress {opts.compress}: q8/q4 values are the sparse "
                             "allreduce's; add --allreduce sparse")  # fmt: skip
        payload = codec.payload_bytes(n)
        comm = allgather_ring(p * payload, p, link) if p > 1 else 0.0
        decode = p * payload + 4.0 * n * (1 if codec.kind == "topk" else p)
    stream = getattr(hw, "stream_bandwidth", None) or hw.memory_bandwidth
    coding = (3 * 4.0 * n + decode) / stream
    algo = opts.allreduce if opts.allreduce in SPARSE else "xla"
    return comm, coding, float(codec.analytic_bytes(n, p, algo))


def sufficient_factors(
    m: ModelCost, b: float, p: int, opts: PredictOptions, allreduce: Any, link: Link
) -> float:
    """``--sfb``: a fully connected layer whose gathered factors (``p (p-1) 4 r (in+out)``
    bytes for its ``r`` rows on a device) undercut its gradient's ring all-reduce (``auto``;
    every such layer with ``all``) is an all-gather of them; the rest one all-reduce."""
    if not m.dense_layers:
        raise UsageError(f"--sfb prices fully connected layers; {m.name} is a shape-only "
                         "model: use a refdl model (refdl predict models)")  # fmt: skip
    rest, gathers = m.param_bytes, 0.0
    for rows, n_in, n_out, params in m.dense_layers:
        factors = p * (p - 1) * 4 * rows * b * (n_in + n_out)
        if sfb_mode(opts.sfb, factors, 2 * (p - 1) * 4 * params) == "factors":
            rest -= 4 * params
            gathers += allgather_ring(factors / (p - 1), p, link)
    return allreduce(max(rest, 0.0)) + gathers


@FORMULAS.register("zero_sharding")
def fsdp(m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions) -> CostBreakdown:
    """ZeRO stage ``opts.zero`` over P workers (Rajbhandari et al. 2020): data-parallel
    compute of B/P samples; ring reduce-scatters and all-gathers of the fp32 parameters
    ``Psi``: 2 (stage 1), m + 1 (stage 2, m microbatches), 3m (stage 3) - ``(P-1)/P Psi``
    per rank each, the paper's 2Psi, 2Psi, 3Psi for m = 1 (``refdl.strategies.fsdp``).
    Stages 2 and 3 recompute each layer's forward in its backward (4/3 of the FLOPs).
    Memory per rank (the paper's figure 1): parameters Psi (stage 3: Psi/P), gradients Psi
    (stages 2, 3: Psi/P), optimizer words K Psi/P, activations of B/P samples; stage 3 also
    holds one layer's gathered parameters (Psi / layers, the mean layer)."""
    p, z, mb = workers, opts.zero, opts.microbatches if opts.zero > 1 else 1
    b = batch / p
    remat = 4 / 3 if z > 1 else 1.0
    t = compute_time(m.flops(b) * remat, m.bytes(b) * remat, hw, ops=m.ops * remat,
                     sharing=p, work=m.op_work(b).scaled(share=remat, repeat=remat),
                     **host_work(m, batch, p))  # fmt: skip
    again = dataclasses.replace(opts, remat="full") if z > 1 else opts  # forward recomputed
    shaped = whole_model_shape(m, hw, b, MeshSpec(fsdp=p), again, microbatches=mb)
    t += shaped
    rounds = {1: 2, 2: mb + 1, 3: 3 * mb}[z]
    psi = m.param_bytes
    comm = rounds * allgather_ring(psi, p, _link(hw, p, opts))
    params = psi / p if z == 3 else psi
    grads = psi if z == 1 else psi / p
    mem = params + grads + opts.optimizer_words * psi / p + b * m.activation_bytes_per_sample
    if z == 3:
        mem += psi / max(m.layers, 1)
    update = update_s(m, hw, m.params / p, opts)  # each rank its shard's
    return CostBreakdown(
        compute_s=t + update,
        comm_s=exposed(comm, t, opts.overlap),
        memory_bytes=int(mem),
        flops=m.flops(b) * remat,
        comm_bytes=rounds * (p - 1) * psi if p > 1 else 0,
        shape_s=shaped,
        update_s=update,
    )


@FORMULAS.register("tensor")
def tensor(m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions) -> CostBreakdown:
    """Every layer split P ways: 1/P of the compute and state, and the collectives the
    split leaves (``_tp_comm``; a transformer's in closed form, ``transformer_step``)."""
    _check_model_degree(m, workers)
    if m.transformer is not None:
        return transformer_step(m, hw, batch, MeshSpec(model=workers), opts)
    t = compute_time(
        m.flops(batch) / workers, m.bytes(batch) / workers, hw, ops=m.ops, sharing=workers,
        work=m.op_work(batch).scaled(share=1 / workers), **host_work(m, batch, workers),
    )  # fmt: skip
    comm = _tp_comm(m, batch, workers, _link(hw, workers, opts))
    mem = _state_bytes(m, opts, workers) + batch * m.activation_bytes_per_sample
    return CostBreakdown(
        compute_s=t, comm_s=exposed(comm, t, opts.overlap), memory_bytes=int(mem),
        flops=m.flops(batch) / workers,
    )  # fmt: skip


@FORMULAS.register("pipeline")
def pipeline(m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions) -> CostBreakdown:
    """P balanced stages, M microbatches: each stage computes 1/P of the step; the bubble
    is the schedule table's idle share ``f`` (``bubble_s = compute * f / (1 - f)``; the
    closed form where one holds, ``refdl.parallel.schedule.bubble``); two point-to-point
    messages (activation, gradient) of B/M boundary samples per slot. The zero-bubble
    schedules make three calls per microbatch and chunk (F, B, W) instead of two."""
    p, mb = workers, opts.microbatches
    _check_schedule(m, p, opts)  # as refdl train refuses them
    v = chunks_of(opts.schedule, opts.chunks)
    if batch % mb:
        raise UsageError(f"--batch-size {batch} does not split into {mb} microbatches")
    t = compute_time(m.flops(batch) / p, m.bytes(batch) / p, hw, sharing=p,
                     **stage_walk(m, batch, p, mb, opts.schedule, opts.chunks))  # fmt: skip
    layers = m.transformer.layers / p if m.transformer is not None else None
    shaped = whole_model_shape(m, hw, batch, MeshSpec(pipe=p), opts, mb, layers)
    t += shaped
    f = bubble_fraction(opts.schedule, p, mb, opts.chunks) if p > 1 else 0.0
    if getattr(getattr(hw, "device", None), "shared_cores", False):
        f = 0.0  # stages share the cores: an idle stage's time goes to the busy ones
    link = _link(hw, 2, opts)
    slots = mb * v + p - 1
    msg = (batch / mb) * m.boundary_bytes_per_sample
    comm = 2 * slots * (link.alpha + msg * link.beta) if p > 1 else 0.0
    # Microbatches whose activations a stage holds at once (the table's peak stash, in
    # stage units): all of them breadth-first, 1F1B's p otherwise (a ZB-V chunk is half).
    stash = (mb if opts.schedule in ("gpipe", "looped-bfs") else min(p, mb)) * (batch / mb)
    mem = _state_bytes(m, opts, p) + stash * m.activation_bytes_per_sample / p
    crossings = p * v - 1 - (1 if opts.schedule in V_SHAPED else 0)  # the V turns on a device
    update = update_s(m, hw, m.params / p, opts)  # a stage its own, after the schedule
    return CostBreakdown(
        compute_s=t + update,
        comm_s=exposed(comm, t, opts.overlap),
        bubble_s=t * f / (1 - f),
        memory_bytes=int(mem),
        flops=m.flops(batch) / p,
        comm_bytes=2 * mb * crossings * msg,
        shape_s=shaped,
        update_s=update,
    )


def _check_model_degree(m: ModelCost, k: int) -> None:
    """Refuse a ``model`` degree that ``train`` refuses for ``m`` (a width it leaves
    uneven): its price would be of a layout that cannot run."""
    if problem := model_degree_problem(m, k):
        raise UsageError(problem)


def _check_schedule(m: ModelCost, pipe: int, opts: PredictOptions, even: bool = True) -> None:
    """``refdl.config.plan.check_schedule`` on ``m``'s layers (a user's shape named
    short): a schedule train refuses is not priced."""
    layers = m.transformer.layers if m.transformer is not None else m.layers
    name = "the shape" if m.name.startswith("shape:") else m.name
    check_schedule(opts.schedule, opts.chunks, opts.microbatches, pipe, layers, name, even)


def hybrid_mesh(workers: int, opts: PredictOptions) -> MeshSpec:
    """The mesh ``hybrid`` is priced on: ``opts.mesh``, else model 2 where the workers are
    even and the rest on data."""
    if opts.mesh is not None:
        return opts.mesh.on(workers, "--workers")
    return MeshSpec(data=workers // 2, model=2) if workers % 2 == 0 else MeshSpec(data=workers)


@FORMULAS.register("mesh")
def hybrid(m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions) -> CostBreakdown:
    """data x model x pipe: tensor cost on B/d, pipeline bubble over pipe, and the data
    allreduce of each replica's 1/(model x pipe) share of the gradients; a transformer on
    all six axes by ``transformer_step``."""
    mesh = hybrid_mesh(workers, opts)
    _check_model_degree(m, mesh.model)
    if mesh.pipe > 1:
        _check_schedule(m, mesh.pipe, opts, even=m.transformer is None)
    elif opts.schedule != "1f1b" or opts.chunks != 1:
        what = (f"--schedule {opts.schedule}" if opts.schedule != "1f1b"
                else f"--chunks {opts.chunks}")  # fmt: skip
        raise UsageError(f"{what} orders the work of 2 or more pipeline stages, and the mesh "
                         f"{mesh.text()} has none; add pipe=N to --mesh or drop it")  # fmt: skip
    if m.transformer is not None:
        return transformer_step(m, hw, batch, mesh, opts)
    if mesh.context > 1 or mesh.expert > 1 or mesh.fsdp > 1:
        raise UsageError(
            f"--model {m.name} is not a transformer: the cost model splits it over data, "
            "model and pipe only; set fsdp, context and expert to 1"
        )
    d, tp, pp = mesh.data, mesh.model, mesh.pipe
    b = batch / d
    if pp > 1:  # the host executor walks the stages' programs, a microbatch at a time
        walk = stage_walk(m, b, pp, opts.microbatches, opts.schedule, opts.chunks, tp, d * tp)
    else:
        walk = {"ops": m.ops, "work": m.op_work(b).scaled(share=1 / tp),
                **host_work(m, batch, workers)}  # fmt: skip
    t = compute_time(m.flops(b) / (tp * pp), m.bytes(b) / (tp * pp), hw, sharing=workers,
                     **walk)  # fmt: skip
    link_tp = _link(hw, tp, opts)
    tp_comm = _tp_comm(m, b, tp, link_tp) / pp  # each stage runs its share of the layers
    dp_comm = allreduce_ring(m.param_bytes / (tp * pp), d, _link(hw, workers, opts))
    bubble = 0.0
    if pp > 1:
        f = bubble_fraction(opts.schedule, pp, opts.microbatches, opts.chunks)
        bubble = t * f / (1 - f)
    mem = _state_bytes(m, opts, tp * pp) + b * m.activation_bytes_per_sample / pp
    return CostBreakdown(
        compute_s=t,
        comm_s=exposed(tp_comm + dp_comm, t, opts.overlap),
        bubble_s=bubble,
        memory_bytes=int(mem),
        flops=m.flops(b) / (tp * pp),
    )


@FORMULAS.register("context")
def context(m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions) -> CostBreakdown:
    """The sequence split P ways (``transformer_step`` with ``context=P``)."""
    if m.transformer is None:
        raise UsageError(f"--strategy context needs a transformer; --model {m.name} is not one")
    return transformer_step(m, hw, batch, MeshSpec(context=workers), opts)


def whole_model_shape(m: ModelCost, hw: Any, sequences: float, mesh: MeshSpec,
                      opts: PredictOptions, microbatches: int = 1,
                      layers: float | None = None) -> float:  # fmt: skip
    """``shape_overhead`` of a transformer priced by a formula other than the mesh's
    (one device, data, ZeRO, pipeline stages): ``microbatches`` of ``sequences`` over
    them through ``layers`` (all by default); 0 for any other model."""
    if m.transformer is None:
        return 0.0
    busiest = m.transformer.layers if layers is None else layers
    return microbatches * shape_overhead(m, hw, sequences / microbatches, busiest, mesh, opts)


def compute_unpriced(m: ModelCost) -> str | None:
    """Why ``--compute`` would change nothing for ``m`` (None where it prices it): a
    transformer costed by XLA's compiled step (gpt2, refdl's transformer and moe) runs at a
    fraction fitted on whole steps, which already holds its products' shapes."""
    if m.transformer is not None and m.op_class != "transformer":
        return (f"{m.name} is priced by its compiled step, whose fitted fraction already "
                "holds its products' shapes")  # fmt: skip
    return None


def update_s(m: ModelCost, hw: Any, params: float, opts: PredictOptions) -> float:
    """The optimizer's elementwise update of ``params`` parameters on one device, once a
    step, for a transformer known by its shape (a compiled step's update is inside its
    fitted fraction): the fp32 gradient read, the fp32 master read and written, each
    optimizer word read and written, in 16-bit the compute copy written, at the device's
    memory bandwidth (Adam: 28 bytes a parameter, 30 in bf16); else 0."""
    dev = getattr(hw, "device", None)
    if m.op_class != "transformer" or m.transformer is None or dev is None:
        return 0.0
    stream = getattr(hw, "stream_bandwidth", None) or dev.memory_bandwidth
    width = ACT_BYTES.get(opts.precision, 4)
    per = 4 + 8 + 8 * opts.optimizer_words + (width if width != 4 else 0)
    return per * params / stream


def shape_overhead(m: ModelCost, hw: Any, sequences: float, layers: float, mesh: MeshSpec,
                   opts: PredictOptions) -> float:  # fmt: skip
    """One microbatch of ``sequences`` on the busiest device of ``layers``: what its matrix
    products take beyond their FLOPs (``refdl.perf.gemm.step_overhead_s``), where
    ``--compute shape``, the device is a GPU ``gemm`` has figures for, and the model is
    priced by the ``transformer`` fraction (fitted with this overhead; a model costed by
    XLA, as gpt2, runs at a fraction fitted on whole steps without it); else 0."""
    dev, peak = getattr(hw, "device", None), getattr(hw, "datasheet_flops", None)
    if (opts.compute != "shape" or m.op_class != "transformer" or dev is None or not peak
            or not gemm.applies(dev.name)):  # fmt: skip
        return 0.0
    shape = m.transformer
    stream = getattr(hw, "stream_bandwidth", None) or dev.memory_bandwidth
    return gemm.step_overhead_s(
        shape, sequences * shape.seq / mesh.context, layers,
        ACT_BYTES.get(opts.precision, 4), peak, stream, tp=mesh.model, ep=mesh.expert,
        cp=mesh.context, remat=opts.remat, ring=opts.cp == "ring",
    )  # fmt: skip


def transformer_step(
    m: ModelCost, hw, batch: int, mesh: MeshSpec, opts: PredictOptions
) -> CostBreakdown:
    """A transformer's step on the six axes (``refdl.perf.transformer``): the model's
    compute (times the recomputation's share) split over every axis, each axis's
    collectives on the link its group spans, the pipeline's bubble, and the busiest
    device's state and activations. The batch splits over ``data x fsdp x expert`` and
    ``microbatches``; ``sequence_parallel`` and the context attention as ``opts`` say."""
    shape, workers = m.transformer, mesh.size
    check_mesh(shape, mesh, opts.cp)
    replicas, mb = mesh.replicas, opts.microbatches
    if batch % (replicas * mb):
        raise UsageError(
            f"--batch-size {batch} does not split into data x fsdp x expert = {replicas} "
            f"replicas of {mb} microbatches; give a multiple of {replicas * mb}"
        )
    if opts.sequence_parallel and mesh.model == 1:
        raise UsageError("--sequence-parallel splits within the model axis: set model > 1")
    b, split = batch / replicas, mesh.model * mesh.pipe * mesh.context
    factor = remat_factor(shape, opts.remat)
    if mesh.pipe > 1:  # the host executor walks the stages' programs, a microbatch at a time
        walk = stage_walk(m, b, mesh.pipe, mb, opts.schedule, opts.chunks,
                          split / (factor * mesh.pipe), workers // mesh.pipe)  # fmt: skip
    else:
        walk = {"ops": m.ops, "work": m.op_work(b).scaled(share=factor / split),
                **host_work(m, batch, workers)}  # fmt: skip
    t = compute_time(m.flops(b) * factor / split, m.bytes(b) * factor / split, hw,
                     sharing=workers, **walk)  # fmt: skip
    # uneven stages: the busiest device sets the pace (its layers over the mean; the
    # output layer's work stays spread, as with equal stages). Without boundaries whole
    # layers are dealt as evenly as they go, ceil(layers / pipe) on the busiest (a
    # device's chunks, interleaved or V, share its layers).
    v = chunks_of(opts.schedule, opts.chunks) if mesh.pipe > 1 else 1
    busiest = shape.layers / mesh.pipe
    if mesh.pipe > 1 and opts.stage_boundaries:
        if v > 1:
            raise UsageError("--stage-boundaries cuts one stage a device (1f1b, gpipe, "
                             f"zb-h1), not {opts.schedule}'s chunks")  # fmt: skip
        busiest = max(stage_layers(shape.layers, mesh.pipe, opts.stage_boundaries))
    elif mesh.pipe > 1:
        busiest = -(-shape.layers // mesh.pipe)
    t *= busiest / (shape.layers / mesh.pipe)
    shaped = shape_overhead(m, hw, b / mb, busiest, mesh, opts) * mb
    t += shaped
    comm = axis_comm(
        shape, mesh, batch, axis_links(mesh, hw, lambda n: _link(hw, n, opts)),
        microbatches=mb, chunks=v, cp=opts.cp, sp=opts.sequence_parallel, remat=opts.remat,
        precision=opts.precision, flop_rate=hw.peak_flops, grad_reduce=opts.grad_reduce,
        nodes=nodes_of(hw, opts),
    )  # fmt: skip
    # up to overlap x compute hides the axes' exposed time, shared in proportion
    total = sum(c.exposed_s for c in comm.values())
    kept = exposed(total, t, opts.overlap) / total if total else 0.0
    by_axis = tuple((a, c.time_s, c.exposed_s * kept, c.bytes) for a, c in comm.items())
    bubble = 0.0
    if mesh.pipe > 1:
        f = bubble_fraction(opts.schedule, mesh.pipe, mb, opts.chunks)
        bubble = t * f / (1 - f)
    stash = 1 if mesh.pipe == 1 else (mb if opts.schedule in ("gpipe", "looped-bfs")
                                      else min(mesh.pipe, mb))  # fmt: skip
    heavy = busiest / (shape.layers / mesh.pipe)  # the busiest stage's state, too
    # its update once the step's gradients are in: a shard of its parameters over fsdp,
    # and over data where ZeRO splits the optimizer state there
    mine = heavy * stage_params(shape, mesh) / mesh.fsdp
    update = update_s(m, hw, mine / (mesh.data if opts.data_zero else 1), opts)
    mem = heavy * state_bytes(shape, mesh, opts.optimizer_words, opts.data_zero, opts.precision)
    mem += heavy * fsdp_gathered_bytes(shape, mesh, opts.precision, opts.grad_reduce)
    mem += activation_bytes(shape, mesh, batch, mb, stash, opts.sequence_parallel, opts.remat,
                            opts.precision, fused=opts.attention == "fused",
                            busiest=busiest)  # fmt: skip
    return CostBreakdown(
        compute_s=t + update,
        comm_s=sum(e for _, _, e, _ in by_axis),
        bubble_s=bubble,
        memory_bytes=int(mem),
        flops=m.flops(b) * factor / split,
        comm_bytes=sum(n for *_, n in by_axis),
        comm_by_axis=by_axis,
        shape_s=shaped,
        update_s=update,
    )


@FORMULAS.register("parameter_server")
def ps(m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions) -> CostBreakdown:
    """W workers compute B/W each; push gradients and pull parameters through K servers.
    Sync: compute, then push/pull (each server's link carries W/K of the traffic). Async
    and SSP without stragglers: a worker's own push/pull is on its path, and the servers'
    links bound the rate (Ben-Nun & Hoefler 2019, section 7.1). Hierarchical (G learner
    groups): each aggregator's link carries its W/G learners, then the server's the G
    aggregators, one after the other."""
    k = opts.servers
    g = opts.ps_groups if opts.ps_mode == "hierarchical" else 0
    if g and (k != 1 or workers % g):
        raise UsageError(f"--ps-mode hierarchical: one server and --workers {workers} in "
                         f"--ps-groups {g} equal groups")  # fmt: skip
    if opts.staleness is not None and opts.ps_mode != "ssp":
        raise UsageError("--staleness is the bound of --ps-mode ssp; add --ps-mode ssp")
    if opts.softsync_n is not None and opts.ps_mode != "softsync":
        raise UsageError("--softsync-n N is --ps-mode softsync's; add --ps-mode softsync")
    lag = _straggler(opts, straggler.groups("parameter_server", opts.ps_mode, opts.softsync_n,
                                            workers))  # fmt: skip
    b = batch / workers
    t = compute_time(m.flops(b), m.bytes(b), hw, ops=m.ops, sharing=workers + k + g,
                     work=m.op_work(b), **host_work(m, b))  # fmt: skip
    link = _link(hw, workers + k + g, opts)
    sync = ps_push_pull(m.param_bytes, workers, link, k)
    if g:
        sync = ps_push_pull(m.param_bytes, workers // g, link) + ps_push_pull(
            m.param_bytes, g, link
        )
    if opts.ps_mode in ("sync", "hierarchical"):
        comm = sync
    else:
        own = 2 * (link.alpha + m.param_bytes * link.beta)
        comm = max(own, sync - t)
    held = _accumulated(m, batch, workers, opts.accumulate)
    mem = _state_bytes(m, PredictOptions(optimizer_words=0)) + held
    return CostBreakdown(
        compute_s=t,
        comm_s=exposed(comm, t, opts.overlap),
        memory_bytes=int(mem),
        flops=m.flops(b),
        comm_bytes=2 * (workers + g) * m.param_bytes if workers > 0 else 0,
        straggler=lag,
    )


def _straggler(opts: PredictOptions, groups: int) -> tuple[float, int]:
    """``--straggler RANK:SECONDS`` as (seconds, groups) for ``CostBreakdown``; (0, 1)
    without one. Which worker it is does not change the steady state (its rank is
    checked once, by ``refdl.perf.prediction``)."""
    return (0.0, 1) if opts.straggler is None else (opts.straggler.seconds, groups)


@FORMULAS.register("gossip")
def decentralized(
    m: ModelCost, hw, batch: int, workers: int, opts: PredictOptions
) -> CostBreakdown:
    """Each worker computes B/P, then sends its replica to each graph neighbour through
    its one link (serialised: ``d (alpha + n beta)``, d the mean degree; ``--gossip``: to
    its partner in the step's matching, at most one); with ``--compress topk:..``
    CHOCO-SGD's message of top-k pairs instead (its selection's own time is not priced).
    A ``--straggler`` holds every step (the step all-reduces the loss)."""
    b = batch / workers
    t = compute_time(m.flops(b), m.bytes(b), hw, ops=m.ops, sharing=workers,
                     work=m.op_work(b), **host_work(m, b))  # fmt: skip
    degree = float(adjacency(opts.topology, workers).sum(1).mean()) if workers > 1 else 0.0
    if opts.gossip:
        if opts.compress:
            raise UsageError("--allreduce sparse keeps each neighbour's public copy over "
                             "a fixed graph; --gossip changes the graph every step: drop "
                             "one")  # fmt: skip
        degree = min(degree, 1.0)
    link = _link(hw, workers, opts)
    message, copies = m.param_bytes, 0
    if opts.compress:  # CHOCO keeps a public copy and its neighbours' mix: 2 more replicas
        codec = make_codec(opts.compress)
        if not codec.topk:
            raise UsageError(f"--compress {opts.compress}: decentralized sends top-k pairs; "
                             "use topk:RATIO[,q8|q4]")  # fmt: skip
        values = max(1, int(m.param_bytes // 4))
        sparse = codec.sparse(values, max(workers, 1))
        message, copies = sparse.message_bytes(sparse.k), 2
    comm = degree * neighbour_exchange(message, 1, link) if workers > 1 else 0.0
    mem = _state_bytes(m, opts) + (1 + copies) * m.param_bytes
    return CostBreakdown(
        compute_s=t,
        comm_s=exposed(comm, t, opts.overlap),
        memory_bytes=int(mem + _accumulated(m, batch, workers, opts.accumulate)),
        flops=m.flops(b),
        comm_bytes=degree * workers * message,
        straggler=_straggler(opts, 1),
    )
