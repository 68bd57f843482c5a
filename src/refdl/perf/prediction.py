"""Step predictions (``refdl predict``'s library half): a strategy's step time, its terms,
its 80 % interval, throughput, speedup and efficiency (Jäger et al.'s definitions) and
memory per device, for each worker count, from a hardware profile.

For each worker count P the prediction gives ``step_time_s`` = compute +
communication + bubble (no overlap unless ``PredictOptions.overlap``), ``throughput``
(samples/s), ``speedup`` = throughput_P / throughput_1 and ``efficiency`` = speedup /
P, and ``memory_bytes`` per device. ``batch_size`` is the global batch (``scaling``
strong, as in refdl.train) or the batch per worker (weak, as Horovod, Goyal et al. and
PowerAI report). The strategy's traits come in as a parameter: the performance model
never imports the strategies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from refdl import hw
from refdl.config.plan import Traits
from refdl.config.values import Choice, Int
from refdl.errors import UsageError
from refdl.hw import stacks
from refdl.perf import PredictOptions, intervals, muon
from refdl.perf.architectures import architecture_factor, expected_view
from refdl.perf.costs import FORMULAS, formula_of, hybrid_mesh, link_of
from refdl.perf.model_cost import model_cost
from refdl.perf.overlap import with_frameworks_overlap
from refdl.perf.straggler import straggled


def precision_note(profile: Any, precision: str) -> str | None:
    """What a profile without the precision's peak prices it at, and fp32 priced at a
    card's TF32 peak (said, not silent)."""
    d = profile.device
    if d is not None and precision == "fp32" and profile.dtype_for(precision) == "tf32":
        fp32 = d.peak_flops.get("float32")
        slower = f", {d.peak_flops['tf32'] / fp32:.0f}x slower" if fp32 else ""
        return ("fp32 is priced at the card's TF32 peak, as JAX, TensorFlow and cuDNN's "
                "convolutions run it by default; products kept in fp32 (PyTorch's matmuls "
                "unless set_float32_matmul_precision('high')) run at the fp32 peak"
                f"{slower}")  # fmt: skip
    if d is None or profile.dtype_for(precision) in d.peak_flops:
        return None
    return (f"{profile.name} lists no {precision} peak (only {', '.join(d.peak_flops)}): "
            "priced at float32's, its interval widened")  # fmt: skip


# The shortest a kernel took on a GPU here: the H200's fitted bf16 cuBLAS latency
# (scripts/bench_gemm_shapes.py, its hopper part, 2026-11-28; fp32's was 11.3 us)
KERNEL_FLOOR_S = 2.83e-6


def overhead_note(profile: Any, m: Any, step_s: float) -> str | None:
    """Said where a compiled model's step is priced below its kernels' launches: a
    profile without per-operation figures prices its operations by FLOPs and bytes alone
    (a GPU profile's; refdl's models are small), so the step is a bound, not an estimate."""
    d = profile.device
    floor = m.ops * KERNEL_FLOOR_S
    if d is None or d.ops or d.op_overhead_s > 0 or d.dispatch_s > 0 or step_s >= floor:
        return None
    return (f"{profile.name} gives no per-kernel overhead, so the {m.ops:,} operations of "
            f"{m.name}'s step are priced by their FLOPs and bytes alone; at the "
            f"{KERNEL_FLOOR_S * 1e6:.1f} us a kernel took on an H200 (2026-11-28) they take "
            f"at least {floor * 1e3:.3g} ms")  # fmt: skip


def scope_note(profile: Any, workers: list[int]) -> str | None:
    """What a prediction assumes when it asks more devices of a one-node profile than
    the node holds: its own link, as one larger node (an NVSwitch machine such as a
    DGX-2), not a network; None when the profile covers the worker counts."""
    per_node, top = profile.devices_per_node, max(workers)
    if "inter" in profile.links or "intra" not in profile.links or top <= per_node:
        return None
    wider = [n for n in hw.names() if n.startswith(profile.name + "-")]
    return (
        f"{profile.name} describes one node of {per_node} devices and no network: "
        f"{top} workers are modelled as one larger node on its own link; for several "
        "nodes use a profile with a network" + (f" ({', '.join(wider)})" if wider else "")
    )


def stack_note(profile: Any, library: str | None) -> str | None:
    """What a dated collective stack's figures rest on for each of the profile's links
    (``refdl.hw.stacks.note``); None for a library's current stack."""
    name = library or profile.default_library()
    notes = (stacks.note(name, profile.link_kind(level), False) for level in profile.links)
    return "; ".join(dict.fromkeys(n for n in notes if n)) or None


def predict_steps(
    hw_name: str,
    strategy: str,
    traits: Traits,
    model: str,
    batch_size: int,
    workers: list[int],
    scaling: str = "strong",
    opts: Any = None,
    precision: str = "fp32",
    library: str | None = None,
) -> list[dict[str, Any]]:
    """The prediction rows of ``strategy`` (its ``traits`` name its cost formula) for each
    worker count (see the module docstring).

    ``step_time_s`` is the expectation: the profile's achieved figures (``[achieved]``,
    for the model's op class, ``precision`` and ``library``) and, for data parallelism on
    such a profile, the frameworks' bucketed overlap unless ``opts`` sets ``overlap`` or
    ``bucket_mb``. ``bound_step_time_s`` is the bound: peaks and full overlap.
    ``step_time_no_overlap_s`` / ``step_time_full_overlap_s`` are the expectation's two
    overlap extremes."""
    profile = hw.load(hw_name)
    profile.need_device()  # a network described alone predicts no step
    formula = formula_of(traits)
    for flag, value, kind in (("--scaling", scaling, Choice(("strong", "weak"))),
                              ("--batch-size", batch_size, Int(min=1, max=10**9))):  # fmt: skip
        if problem := kind.problem(value):
            raise UsageError(f"{flag} must be {problem}")
    if not workers or any(Int(min=1, max=1 << 20).problem(w) for w in workers):
        raise UsageError(f"--workers must be integers in [1, {1 << 20}] (got {workers})")
    opts = dataclasses.replace(opts or PredictOptions(), precision=precision).validate()
    if traits.has_servers and opts.servers > max(workers):
        raise UsageError(
            f"--servers {opts.servers} exceeds --workers {max(workers)}: a server per worker "
            "at most"
        )
    m = model_cost(model)
    arch = architecture_factor(m)
    expected_hw = expected_view(profile, precision, m, library)
    bound_hw = profile.view("bound", precision, m.op_class)
    opts = with_frameworks_overlap(profile, opts)
    plain = dataclasses.replace(opts, bucket_mb=0.0)
    variants = {
        "bound": (bound_hw, dataclasses.replace(plain, overlap=1.0)),
        "no_overlap": (expected_hw, dataclasses.replace(plain, overlap=0.0)),
        "full_overlap": (expected_hw, dataclasses.replace(plain, overlap=1.0)),
    }
    if opts.straggler is not None:  # a worker's rank, as train numbers them (servers and
        # aggregators first), at the largest count: a list prices one straggler at each
        first = opts.servers + (opts.ps_groups if opts.ps_mode == "hierarchical" else 0)
        first = first if traits.has_servers else 0
        last = first + max(workers) - 1
        if not first <= opts.straggler.rank <= last:
            raise UsageError(f"--straggler {opts.straggler}: rank {opts.straggler.rank} is not "
                             f"a worker (workers are ranks {first}..{last})")  # fmt: skip
    rows: list[dict[str, Any]] = []

    def cost(h: Any, o: PredictOptions, w: int) -> Any:
        """Worker count ``w``'s step: one device's formula where a strategy on one worker
        is one device; Muon's terms added (``refdl.perf.muon``)."""
        batch = batch_size * w if scaling == "weak" else batch_size
        if (w == 1 and (traits.replicas or bool(traits.axes)) and not traits.pipeline
                and o.straggler is None):  # fmt: skip
            name, f = "one_device", FORMULAS.get("one_device")
        else:
            name, f = traits.cost or "", formula
        _check_replicas(name, batch, w, o)
        c = f(m, h, batch, w, o)
        if o.muon is None:
            return c
        if name == "mesh":  # the axes say who holds what, as plan's
            split, shards, expert = muon.mesh_split(hybrid_mesh(w, o), o.data_zero)
            link = link_of(h, shards, o) if shards > 1 else None
            return muon.on_mesh(c, m, h, split, shards, o.muon, link, expert)
        return muon.priced(name, c, m, h, w, o.muon, link_of(h, w, o))

    # the speed-up is over one worker, priced here when no row asks for one (where one
    # worker cannot run the strategy's layout, over the first row, as before)
    try:  # a straggler's cost shows in the speed-up: one worker is not delayed
        undelayed = dataclasses.replace(opts, straggler=None)
        one = batch_size / cost(expected_hw, undelayed, 1).step_time_s
    except UsageError:
        one = None
    for w in workers:
        batch = batch_size * w if scaling == "weak" else batch_size
        c = cost(expected_hw, opts, w)
        other = {k: cost(h, o, w).step_time_s for k, (h, o) in variants.items()}
        throughput = batch / c.step_time_s
        one = one or throughput / w
        speedup = throughput / one
        rows.append(
            {
                "hw": profile.name,
                "strategy": strategy,
                "model": model,
                "precision": precision,
                "library": library or profile.default_library(),
                "stack_note": stack_note(profile, library),
                "architecture_factor": arch if profile.achieved is not None else None,
                "workers": w,
                "global_batch": batch,
                "step_time_s": c.step_time_s,
                **_step_interval(profile, precision, c, m.op_class),
                "bound_step_time_s": other["bound"],
                "step_time_no_overlap_s": other["no_overlap"],
                "step_time_full_overlap_s": other["full_overlap"],
                "compute_s": c.compute_s,
                "compute_shape_s": c.shape_s,  # of compute_s: the products' shapes
                "compute_update_s": c.update_s,  # of compute_s: the optimizer's update
                "comm_s": c.comm_s,
                "bubble_s": c.bubble_s,
                "wait_s": c.wait_s,  # the wait for a --straggler (refdl.perf.straggler)
                "throughput": throughput,
                "speedup": speedup,
                "efficiency": speedup / w,
                "memory_bytes": c.memory_bytes,
                "fits_memory": c.memory_bytes <= profile.device.memory_bytes
                if profile.device.memory_bytes
                else None,
                "flops_per_device": c.flops,
                # the model's own FLOPs (no recomputation) per device and second: MFU's
                # numerator (divide by the device's peak)
                "model_flops_per_device_per_s": m.flops(batch) / w / c.step_time_s,
                "params": m.params,
                **_by_axis(c),
            }
        )
    fastest = min(r["step_time_s"] for r in rows)
    notes = [n for n in (scope_note(profile, workers), precision_note(profile, precision),
                         overhead_note(profile, m, fastest)) if n]  # fmt: skip
    if notes:
        for r in rows:
            r["note"] = "; ".join(notes)
    return rows


# The formulas that split the global batch over every worker (the mesh: over its replicas)
BATCH_SPLIT = ("data_parallel", "zero_sharding", "parameter_server", "gossip")


def _check_replicas(formula: str, batch: int, workers: int, opts: PredictOptions) -> None:
    """Refuse a global batch the replicas it is split over do not divide, as train
    refuses it (a smaller one: a replica without a sample cannot step)."""
    if formula in BATCH_SPLIT:
        replicas = workers
    elif formula == "mesh":
        replicas = hybrid_mesh(workers, opts).replicas
    else:
        return
    if batch < replicas:
        raise UsageError(f"--batch-size {batch} is smaller than the {replicas} replicas it "
                         f"splits over at {workers} workers; give at least {replicas}")  # fmt: skip
    if batch % replicas:
        raise UsageError(f"--batch-size {batch} does not split over the {replicas} replicas "
                         f"of {workers} workers (train refuses it); give a multiple of "
                         f"{replicas}")  # fmt: skip


def _by_axis(c: Any) -> dict[str, Any]:
    """``comm_by_axis``: each axis's seconds on its link, seconds exposed, bytes sent by a
    device, and its share of the step's exposed communication (where the formula splits
    it by axis)."""
    if not c.comm_by_axis:
        return {}
    total = sum(e for _, _, e, _ in c.comm_by_axis)
    return {"comm_by_axis": {
        axis: {"time_s": t, "exposed_s": e, "bytes": n, "share": e / total if total else 0.0}
        for axis, t, e, n in c.comm_by_axis}}  # fmt: skip


def _step_interval(profile: Any, precision: str, c: Any, op_class: str) -> dict[str, float | None]:
    """``step_time_low_s`` / ``step_time_high_s``: the stated 80 % interval of a step
    time (``refdl.perf.intervals``: a transformer's own where its fraction was fitted;
    wider where the device's figure is borrowed), a straggler's given delay added to
    each end as to the step (``refdl.perf.straggler``)."""
    dtype = profile.dtype_for(precision) if profile.device is not None else "float32"
    kind, borrowed = intervals.step_kind(profile, dtype, op_class)
    iv = intervals.time_interval(kind, c.step_time_s - c.wait_s, borrowed)
    if not iv:
        return {"step_time_low_s": None, "step_time_high_s": None}
    return {"step_time_low_s": straggled(iv[0], *c.straggler),
            "step_time_high_s": straggled(iv[1], *c.straggler)}  # fmt: skip
