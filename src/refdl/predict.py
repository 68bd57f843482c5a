"""``python -m refdl.predict``: predictions from hardware profiles and the performance model.

    .venv/bin/python -m refdl.predict --hw p100-nvlink --strategy data --model resnet50 \\
        --batch-size 64 --workers 1,2,4,8,16 --json
    .venv/bin/python -m refdl.predict --hw p100-nvlink-roce25 --strategy data \\
        --model vgg16 --batch-size 32 --scaling weak --workers 1,8,64,512 --plot vgg.png
    .venv/bin/python -m refdl.predict collective --op allreduce --algo ring \\
        --hw p100-nvlink --workers 4 --bytes 67108864 --json
    .venv/bin/python -m refdl.predict profiles
    .venv/bin/python -m refdl.predict models

For each worker count P the step prediction gives ``step_time_s`` = compute +
communication + bubble (no overlap unless ``--overlap``), ``throughput``
(samples/s), ``speedup`` = throughput_P / throughput_1 and ``efficiency`` =
speedup / P (Jäger et al.'s definitions), and ``memory_bytes`` per device.
``--batch-size`` is the global batch (``--scaling strong``, default, as in
refdl.train) or the batch per worker (``--scaling weak``, as Horovod, Goyal et
al. and PowerAI report).
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace
from typing import Any

from refdl import hw
from refdl.cli import Parser, given_dests
from refdl.config.choices import SPARSE_ALGORITHM as SPARSE
from refdl.config.mesh import MeshLayout, MeshSpec
from refdl.config.paths import writable_file
from refdl.config.values import Float, Int, Ints
from refdl.errors import UsageError
from refdl.hw import stacks
from refdl.perf import OPTIMIZER_WORDS, PredictOptions, add_transformer_flags, intervals
from refdl.perf.collectives import (
    OPS,
    allreduce_hierarchical,
    allreduce_lower_bound,
    allreduce_sparse,
    bandwidths,
    collective_time,
)

# The models, the step model and the plots (JAX, Flax, matplotlib: about 1.5 s) are
# imported where they are used, after the arguments are checked: a mistake answers at once.

PROG = "refdl.predict"


STEP_KEYS = ("compute_s", "comm_s", "bubble_s")


def _collective_interval(profile: Any, library: str | None, workers: int, t: float) -> dict:
    """``time_low_s`` / ``time_high_s``: the stated 80 % interval of a collective's time,
    and ``stack_note``: what a dated stack's figures rest on (``refdl.hw.stacks.note``)."""
    level = collective_level(profile, workers)[0]
    name = library or profile.default_library()
    own = profile.stack_figures(name, level)
    iv = intervals.time_interval("collective", t, profile.borrowed_link(name, level), own)
    return {"time_low_s": iv[0] if iv else None, "time_high_s": iv[1] if iv else None,
            "stack_note": stacks.note(name, profile.link_kind(level))}  # fmt: skip


def collective_level(profile: Any, workers: int, nodes: int | None = None) -> tuple[str, int, bool]:
    """``(link level, devices per node, several nodes?)`` of a collective over ``workers``:
    across nodes on the network where the profile has one, else inside the node."""
    per_node = profile.devices_per_node if nodes is None else max(1, workers // nodes)
    multi = workers > per_node
    level = "inter" if multi and "inter" in profile.links else (
        "intra" if "intra" in profile.links else next(iter(profile.links)))  # fmt: skip
    return level, per_node, multi


def collective_pair(
    profile: Any,
    op: str,
    algo: str,
    n: float,
    workers: int,
    library: str | None = None,
    nodes: int | None = None,
) -> tuple[float, float]:
    """(expected, bound) seconds of one collective. Expected: the library's achieved
    latency and fraction of line rate; an allreduce ring across nodes in two levels (a
    dated stack with flat rings: one ring through every device, at its slowest hop's
    pace). Bound: line rate; for an
    allreduce, ``allreduce_lower_bound`` (in-network reduction)."""
    level, per_node, multi = collective_level(profile, workers, nodes)
    view = profile.view("expected", library=library)
    peak = profile.view("bound")
    flat = stacks.get(library or profile.default_library()).flat
    if (
        op == "allreduce"
        and algo == "ring"
        and multi
        and not flat
        and "intra" in view.links
        and ("inter" in view.links)
    ):
        inter = view.links["inter"]
        t = allreduce_hierarchical(n, workers, per_node, view.links["intra"].alpha_beta(),
                                   inter.alpha_beta(), inter.nics_per_node)  # fmt: skip
    elif op == "allreduce" and algo == "ring" and multi and flat and "intra" in view.links:
        # one ring through every device: each of its 2(p-1) steps moves n/p over every
        # hop at once, so the slowest hop (the network's, or the node's own) sets the pace
        t = max(collective_time(op, algo, n, workers, view.links[lv].alpha_beta())
                for lv in ("intra", level))  # fmt: skip
    else:
        t = collective_time(op, algo, n, workers, view.links[level].alpha_beta())
    if op == "allreduce":
        intra = peak.links.get("intra", peak.links[level]).alpha_beta()
        inter = peak.links.get("inter")
        bound = allreduce_lower_bound(n, workers, per_node, intra,
                                      inter.alpha_beta() if inter and multi else None,
                                      inter.nics_per_node if inter else 1)  # fmt: skip
    else:
        bound = collective_time(op, algo, n, workers, peak.links[level].alpha_beta())
    return t, bound


def sparse_pair(
    profile: Any,
    n: float,
    workers: int,
    density: float,
    value_bits: int,
    library: str | None,
    algo: str = "sparse",
) -> tuple[float, float]:
    """(expected, bound) seconds of SparCML's sparse allreduce over one link level (``algo``
    sparse: recursive doubling; sparse-split: split-allgather)."""
    level = collective_level(profile, workers)[0]
    view, peak = profile.view("expected", library=library), profile.view("bound")
    algorithm = SPARSE[algo]
    return tuple(  # type: ignore[return-value]
        allreduce_sparse(n, workers, v.links[level].alpha_beta(), density, value_bits, algorithm)
        for v in (view, peak)
    )


def predict_collective(
    hw_name: str,
    op: str,
    algo: str,
    n: float,
    workers: list[int],
    library: str | None = None,
    density: float | None = None,
    value_bits: int = 32,
) -> list[dict[str, Any]]:
    """One row per worker count: ``time_s`` expected (the library's achieved latency and
    fraction of line rate, where the profile gives them) and ``bound_time_s`` (the
    profile's link figures), with nccl-tests' algbw and busbw of the expectation. The
    sparse allreduce (``--algo sparse --density D``) adds the dense ring's expected time
    and the speed-up over it."""
    profile = hw.load(hw_name)
    if problem := Float(min=0.0, max=1e18).problem(n):  # (an exabyte: past any message)
        raise UsageError(f"--bytes must be {problem}")
    sparse = op == "allreduce" and algo in SPARSE
    if sparse != (density is not None):
        raise UsageError("--density goes with --op allreduce --algo sparse (or sparse-split), "
                         "and it needs one")  # fmt: skip
    if value_bits != 32 and not sparse:  # (a dense collective sends whole values)
        raise UsageError("--value-bits goes with --op allreduce --algo sparse (or "
                         "sparse-split); drop it")  # fmt: skip
    rows = []
    for w in workers:
        extra: dict[str, Any] = {}
        if sparse:
            t, bound = sparse_pair(profile, n, w, density, value_bits, library, algo)
            dense = collective_pair(profile, op, "ring", n, w, library)[0]
            extra = {"density": density, "value_bits": value_bits, "dense_ring_time_s": dense,
                     "speedup_over_dense": dense / t if t > 0 else None}  # fmt: skip
        else:
            t, bound = collective_pair(profile, op, algo, n, w, library)
        algbw, busbw = bandwidths(op, n, w, t)
        rows.append(
            {
                "op": op,
                "algo": algo,
                "hw": profile.name,
                "library": library or profile.default_library(),
                "workers": w,
                "bytes": n,
                "time_s": t,
                **_collective_interval(profile, library, w, t),
                "bound_time_s": bound,
                "algbw": algbw,
                "busbw": busbw,
                **extra,
            }
        )
    from refdl.perf.prediction import scope_note

    if note := scope_note(profile, workers):
        for r in rows:
            r["note"] = note
    return rows


def _step_parser() -> argparse.ArgumentParser:
    p = Parser(
        name=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hw", required=True, help="profile name or .toml path")
    p.add_argument("--strategy", help="default: hybrid where --mesh is given, else data")
    p.add_argument("--model", help="a shape-only model or a refdl model")
    p.add_argument("--model-shape", metavar="KEY=VALUE,...",
                   help="a transformer by its shape: layers=L,d_model=D,heads=H[,kv_heads=G]"
                        "[,ffn=F][,vocab=V][,experts=E,top_k=K,shared_experts=S]"
                        "[,glu=1]")  # fmt: skip
    p.add_argument(
        "--model-shape-file",
        metavar="config.json",
        help="a transformer by a Hugging Face config.json",
    )
    p.add_argument("--seq-len", type=int, help="transformer shapes: tokens per sequence")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--workers",
        help="a list like 1,2,4,8 (default 1,2,4,8, or the size of a "
        "--mesh that names every degree)",
    )
    p.add_argument("--scaling", default="strong", help="strong (global batch) or weak")
    p.add_argument("--allreduce", default="ring")
    p.add_argument("--microbatches", type=int,
                   help="pipeline stages: default 4, else 1; data: train's accumulated slices "
                        "of each worker's batch (one slice's activations held)")  # fmt: skip
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--zero", type=int, default=3, help="fsdp: ZeRO stage 1, 2 or 3")
    p.add_argument(
        "--mesh",
        help="hybrid: data=..,fsdp=..,model=..,context=..,expert=..,"
        "pipe=.. (default model=2, data=the rest)",
    )
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--ps-mode", default="sync")
    p.add_argument("--ps-groups", type=int, default=1, help="ps hierarchical: learner groups")
    p.add_argument("--sfb", default="off", help="data: sufficient factors (off, auto, all)")
    p.add_argument("--staleness", type=int, help="ps ssp: the bound (a persistent straggler's "
                   "steady state does not depend on it)")  # fmt: skip
    p.add_argument("--softsync-n", type=int, help="ps softsync: update after every W/N gradients")
    p.add_argument("--straggler", metavar="RANK:SECONDS",
                   help="ps, decentralized: one worker delayed before each step, as refdl "
                        "train's (refdl.perf.straggler)")  # fmt: skip
    p.add_argument("--topology", default="ring")
    p.add_argument("--gossip", action="store_true",
                   help="decentralized: one random matching of the graph a step")  # fmt: skip
    p.add_argument(
        "--compress",
        help="data: the compressed gradient exchange, topk:RATIO[,q8|q4] (q8/q4 "
        "with --allreduce sparse or sparse-split), qsgd:LEVELS, terngrad or sign; "
        "decentralized: CHOCO-SGD's top-k messages",
    )
    p.add_argument(
        "--optimizer",
        help="sgd, momentum, adam or muon (state size; default: the model's own, as train "
        "and plan take it: its recipe's for refdl's models, adam for the others)",
    )
    p.add_argument(
        "--muon",
        default="gather",
        help="fsdp with --optimizer muon: gather (every rank orthogonalizes every matrix) "
        "or owner (one rank per matrix)",
    )
    p.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="share of compute comm can hide (default: bucketed overlap where the "
        "profile has achieved figures, else none)",
    )
    p.add_argument("--precision", default="fp32", help="fp32, tf32, bf16 or fp16")
    p.add_argument("--cp", default="ring", help="context attention: ring or all-to-all")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="transformers: Megatron's sequence parallelism in the model axis",
    )
    p.add_argument("--remat", "--recompute", dest="remat", default="none",
                   help="none, selective or full recomputation")  # fmt: skip
    p.add_argument("--stage-boundaries", metavar="I,J,...",
                   help="transformers on pipe > 1: the layers where the second stage on "
                        "begin (default: equal stages, or a layer fewer at the ends where "
                        "pipe does not divide the layers)")  # fmt: skip
    p.add_argument("--attention", default="fused",
                   help="fused (no scores kept: flash attention) or unfused (5 a s^2 b bytes "
                        "a layer kept for the backward)")  # fmt: skip
    add_transformer_flags(p)
    p.add_argument("--library", help=stacks.help_text())
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE.png", help="write a scaling plot")
    return p


def _boundaries(text: str | None) -> tuple[int, ...] | None:
    """``--stage-boundaries I,J,...`` as layer indices (one line where it is not)."""
    if text is None:
        return None
    try:
        return Ints(like="7,15").parse(text)
    except ValueError as e:
        raise UsageError(f"--stage-boundaries must be {e}") from None


def _step_main(argv: list[str]) -> int:
    args = _step_parser().parse_args(argv)
    words = OPTIMIZER_WORDS
    try:  # what needs no model is answered before the step model loads
        hw.load(args.hw)
        if args.seq_len is not None and (problem := Int(min=1, max=1 << 24).problem(args.seq_len)):
            raise UsageError(f"--seq-len must be {problem}")
        if args.optimizer is not None and args.optimizer not in words:
            raise UsageError(f"unknown --optimizer {args.optimizer!r}; choose {', '.join(words)}")
        if args.plot:
            writable_file(args.plot, "--plot", (".png", ".pdf", ".svg"))
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from refdl import plots
    from refdl.perf.planning import default_optimizer
    from refdl.perf.prediction import predict_steps
    from refdl.perf.shapes import describe, model_named, with_seq
    from refdl.strategies import traits_of

    try:
        model, shape = model_named(args.model, args.model_shape, args.model_shape_file,
                                   args.seq_len)  # fmt: skip
        if args.seq_len and shape is None:
            model = with_seq(model, args.seq_len)
        if args.strategy is None:  # a mesh of several axes is hybrid's
            args.strategy = "hybrid" if args.mesh else "data"
        if args.workers is None and args.mesh:  # the mesh says the devices, or -1 asks
            _check_mesh_devices(args.mesh)
        workers = _ints(args.workers if args.workers is not None else
                        _mesh_size(args.mesh) or "1,2,4,8")  # fmt: skip
        _check_strategy(args.strategy)
        traits = traits_of(args.strategy)
        if args.compress and "compress" not in traits.options:
            raise UsageError(f"--compress prices data's compressed exchange and "
                             f"decentralized's top-k messages; not --strategy "
                             f"{args.strategy}")  # fmt: skip
        if args.optimizer is None:  # the model's own, as plan and train take it
            args.optimizer = default_optimizer(args.model or "")
        given = given_dests(_step_parser, argv)  # at their default values too, as train
        _check_options(args, traits, given)
        _check_mesh_axes(args, traits)
        _check_pairings(args, traits, given)
        _check_transformer_options(args, model, traits.cost, workers)
        opts = PredictOptions(
            allreduce=args.allreduce,
            microbatches=_default_microbatches(traits, args.mesh)
            if args.microbatches is None
            else args.microbatches,
            accumulate=args.microbatches or 1,  # data's: train's accumulation
            schedule=args.schedule,
            chunks=args.chunks,
            zero=args.zero,
            mesh=args.mesh,
            servers=args.servers,
            ps_mode=args.ps_mode,
            ps_groups=args.ps_groups,
            sfb=args.sfb,
            staleness=args.staleness,
            softsync_n=args.softsync_n,
            straggler=args.straggler,
            topology=args.topology,
            gossip=args.gossip,
            compress=args.compress,
            optimizer_words=words[args.optimizer],
            muon=args.muon if args.optimizer == "muon" else None,
            overlap=0.0 if args.overlap is None else args.overlap,
            cp=args.cp,
            sequence_parallel=args.sequence_parallel,
            remat=args.remat,
            attention=args.attention,
            compute=args.compute,
            grad_reduce=args.grad_reduce,
            stage_boundaries=_boundaries(args.stage_boundaries),
        )
        rows = predict_steps(
            args.hw, args.strategy, traits, model, args.batch_size, workers, args.scaling,
            opts, precision=args.precision, library=args.library,
        )  # fmt: skip
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if shape is not None:  # once every check passed: bad input stays one line
        print(f"{PROG}: {describe(shape)}", file=sys.stderr)
    if args.plot:
        try:
            plots.scaling(rows, args.plot)
        except OSError as e:
            print(f"{PROG}: error: cannot write {args.plot} ({e.strerror or e})", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"{model} / {args.strategy} on {rows[0]['hw']} ({args.scaling} scaling, "
        f"{rows[0]['params'] / 1e6:.2f} M parameters)"
    )
    print(
        f"{'P':>5s} {'batch':>6s} {'step ms [80 % interval]':>26s} {'bound':>9s} {'compute':>9s} "
        f"{'comm':>9s} "
        f"{'bubble':>8s} {'samples/s':>10s} {'speedup':>8s} {'eff':>6s} {'mem GB':>7s}"
    )
    for r in rows:
        print(
            f"{r['workers']:5d} {r['global_batch']:6d} "
            f"{_with_interval(r['step_time_s'], r['step_time_low_s'], r['step_time_high_s']):>26s} "
            f"{r['bound_step_time_s'] * 1e3:9.3f} "
            f"{r['compute_s'] * 1e3:9.3f} {r['comm_s'] * 1e3:9.3f} {r['bubble_s'] * 1e3:8.3f} "
            f"{r['throughput']:10.1f} {r['speedup']:8.2f} {r['efficiency']:6.2f} "
            f"{r['memory_bytes'] / 1e9:7.2f}"
        )
    for r in rows:
        if r["fits_memory"] is False:
            print(
                f"{r['workers']:5d} needs {r['memory_bytes'] / 1e9:.2f} GB per device, more than "
                f"the device's {hw.load(args.hw).device.memory_bytes / 1e9:.0f} GB"
            )
        if "comm_by_axis" in r:
            print(f"{r['workers']:5d} comm by axis (exposed ms, share): " + ", ".join(
                f"{a} {v['exposed_s'] * 1e3:.3f} ({v['share']:.0%})"
                + (f" of {v['time_s'] * 1e3:.3f} on the link" if v["time_s"] > v["exposed_s"]
                   else "")
                for a, v in r["comm_by_axis"].items()))  # fmt: skip
    for r in rows:
        if r["wait_s"] > 0:
            print(f"{r['workers']:5d} waits {r['wait_s'] * 1e3:.3f} ms a step for the straggler "
                  f"(--straggler {args.straggler}; refdl.perf.straggler)")  # fmt: skip
    if "note" in rows[0]:
        print(f"note: {rows[0]['note']}")
    if rows[0].get("stack_note"):
        print(rows[0]["stack_note"])
    return 0


def _check_options(args: argparse.Namespace, traits: Any, given: set[str]) -> None:
    """A strategy's option given with another strategy (at its default value too) names
    those that take it, as ``refdl train`` refuses it, instead of being silently ignored."""
    from refdl.config.plan import STRATEGY_OPTIONS, check_options
    from refdl.strategies import declared_traits

    mine = [k for k in STRATEGY_OPTIONS if k != "workers" and k in given]  # a list here
    check_options(mine, args.strategy, traits, declared_traits())


def _check_strategy(name: str) -> None:
    """An unknown ``--strategy`` names the strategies (and a near one), not the cost
    formulas behind them."""
    import difflib

    from refdl.perf.costs import FORMULAS
    from refdl.strategies import declared_traits

    names = sorted(declared_traits())
    if name in names or name in FORMULAS.names():  # a formula registered alone, too
        return
    near = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {near[0]}? " if near else ""
    raise UsageError(f"unknown --strategy {name!r}; {hint}choose one of {', '.join(names)}")


def _check_mesh_axes(args: argparse.Namespace, traits: Any) -> None:
    """A ``--mesh`` axis the strategy does not split over is refused, as ``refdl train``
    refuses it (``refdl.config.plan.check_axes``), instead of being priced as if absent."""
    from refdl.config.plan import check_axes
    from refdl.strategies import declared_traits

    if args.mesh and traits.axes:
        degrees = dict(MeshLayout.parse(args.mesh).degrees)
        check_axes(args.strategy, traits, degrees, args.mesh, declared_traits())


def _check_pairings(args: argparse.Namespace, traits: Any, given: set[str]) -> None:
    """Options train takes only together with another, refused apart as train refuses
    them (each would otherwise be priced as if absent)."""
    if args.muon != "gather" and args.optimizer != "muon":  # gather: train's default too
        raise UsageError(f"--muon {args.muon} is a scheme of --optimizer muon; add it")
    if ("ps_groups" in given) != (args.ps_mode == "hierarchical") and traits.has_servers:
        raise UsageError("--ps-mode hierarchical and --ps-groups G go together (G learner "
                         "groups, each behind an aggregator rank)")  # fmt: skip
    if traits.cost == "gossip":  # decentralized's own rules (train runs them on its spec)
        from refdl.config.codec import Compression
        from refdl.strategies.decentralized import check_gossip

        given_allreduce = args.allreduce if "allreduce" in given else "xla"  # train's default
        check_gossip(SimpleNamespace(allreduce=given_allreduce, gossip=args.gossip,
                                     compress=args.compress and Compression.parse(args.compress),
                                     consensus_step=None), None)  # fmt: skip


# Options that price a transformer's layers: a model priced by its compiled step (resnet50,
# lenet5, ...) has none of these terms, and the option would change nothing.
TRANSFORMER_OPTIONS = ("remat", "attention", "compute", "grad_reduce", "sequence_parallel",
                       "cp", "stage_boundaries")  # fmt: skip


def _check_transformer_options(
    args: argparse.Namespace, model: str, formula: str, workers: list[int]
) -> None:
    """A transformer's option off its default where nothing prices it is refused (at its
    default it is what a compiled step prices: no recomputation, fused attention)."""
    from refdl.perf.costs import compute_unpriced, unpriced
    from refdl.perf.model_cost import model_cost

    defaults = _step_parser()
    given = [k for k in TRANSFORMER_OPTIONS if getattr(args, k) != defaults.get_default(k)]
    if given and model_cost(model).transformer is None:
        raise UsageError(f"--{given[0].replace('_', '-')} prices a transformer's layers, and "
                         f"{model} is priced by its compiled step, which has no such term; "
                         "drop it (or give a transformer: a zoo one or --model-shape)")  # fmt: skip
    if "compute" in given and (why := compute_unpriced(model_cost(model))):
        raise UsageError(f"--compute {args.compute} changes nothing: {why}; drop it (a zoo "
                         "GPT such as gpt3-1.3b or --model-shape is priced by shape)")  # fmt: skip
    if "stage_boundaries" in given and formula == "mesh" and _pipe_of(args.mesh) == 1:
        raise UsageError(f"--stage-boundaries cuts pipeline stages, and --mesh "
                         f"{args.mesh or 'data=N/2,model=2 (the default)'} has none; add "
                         "pipe=N or drop it")  # fmt: skip
    for k in given:
        why, axis = unpriced(k, formula, min(workers))
        if why:
            accumulate = "" if axis == "pipe" else " --microbatches 1"  # a pipe keeps its own
            mesh = f"--strategy hybrid --mesh {axis}=N{accumulate}"
            instead = (f", or price a comparable layout as a mesh ({mesh}), whose formula "
                       "takes it" if axis else "")  # fmt: skip
            raise UsageError(f"--{k.replace('_', '-')} changes nothing for --strategy "
                             f"{args.strategy}, which {why}; drop it{instead}")  # fmt: skip


def _with_interval(t: float, lo: float | None, hi: float | None, digits: int = 3) -> str:
    """``time [low, high]`` in milliseconds (the time alone where no interval is fitted)."""
    if lo is None or hi is None:
        return f"{t * 1e3:.{digits}f}"
    return f"{t * 1e3:.{digits}f} [{lo * 1e3:.{digits}f}, {hi * 1e3:.{digits}f}]"


def _default_microbatches(traits: Any, mesh: str | None) -> int:
    """``refdl train``'s default (``Traits.microbatches``): 4 for a pipeline of several
    stages, 1 otherwise (a hybrid mesh without ``pipe`` accumulates nothing)."""
    if "pipe" not in traits.axes:
        return 1
    if traits.axes[0] == "pipe":
        return 4
    return 1 if _pipe_of(mesh) == 1 else 4


def _pipe_of(mesh: str | None) -> int:
    """The ``pipe`` degree a ``--mesh`` names (1 without it or without one; -1: the rest)."""
    return dict(MeshLayout.parse(mesh).degrees).get("pipe", 1) if mesh else 1


def _check_mesh_devices(mesh: str) -> None:
    """A ``--mesh`` given without ``--workers``: its degrees name the devices (at most
    ``1 << 20``), and a ``-1`` (the rest of the devices) needs ``--workers`` to say them."""
    named = MeshSpec.devices_of(mesh)
    if named is None:
        raise UsageError(f"--mesh {mesh} gives an axis -1, the rest of the devices; say "
                         "how many with --workers N, or give every degree")  # fmt: skip
    if named > 1 << 20:
        raise UsageError(f"--mesh {mesh} spans {named} devices; at most {1 << 20}")


def _mesh_size(mesh: str | None) -> str | None:
    """The devices a ``--mesh`` with every degree given spans (None with a ``-1``)."""
    named = MeshSpec.devices_of(mesh) if mesh else None
    return None if named is None else str(named)


def _ints(text: str) -> list[int]:
    try:
        out = [int(w) for w in str(text).split(",")]  # "1,,2" and "1,2," are mistakes too
    except ValueError:
        raise UsageError(f"--workers {text!r}: give integers like 4 or 1,2,4") from None
    if not out:
        raise UsageError("--workers: give at least one worker count")
    return out


SUBCOMMANDS = ("step", "collective", "profiles", "models")


def main(argv: list[str] | None = None) -> int:
    """``refdl predict [step] ...`` (the default), ``collective``, ``profiles`` or ``models``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "models":
        from refdl.models import MODELS
        from refdl.perf.zoo import SHAPE_MODELS, TRANSFORMERS

        for name in SHAPE_MODELS.names():
            print(f"{name:16s} {SHAPE_MODELS.get(name).doc} (shape-only)")
        for name in TRANSFORMERS.names():
            if name not in SHAPE_MODELS.names():
                print(f"{name:16s} {TRANSFORMERS.get(name).doc} (transformer shape)")
        for name in MODELS.names():
            print(f"{name:16s} {MODELS.get(name).doc} (refdl model, default data set)")
        return 0
    if argv and argv[0] == "step":
        return _step_main(argv[1:])
    if not argv or argv[0] not in ("collective", "profiles", "-h", "--help"):
        return _step_main(argv)
    p = Parser(
        name=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.sub_parsers(dest="cmd", required=True)
    sub.add_parser(
        "step",
        help="(the default: the sub-command may be left out) step time, throughput, speed-up "
        "and memory of a strategy on a profile; see step --help",
    )
    c = sub.add_parser("collective", help="time, algbw and busbw of one collective")
    c.add_argument("--op", default="allreduce")
    c.add_argument("--algo", help="default: the op's first (ring; tree for reduce, ...)")
    c.add_argument("--hw", required=True, help="profile name or .toml path")
    c.add_argument("--workers", required=True, help="P, or a list like 1,2,4,8")
    c.add_argument("--bytes", type=float, required=True, help="message bytes (>= 0)")
    c.add_argument("--library", help=stacks.help_text())
    c.add_argument(
        "--density", type=float, help="--algo sparse|sparse-split: the fraction each rank keeps"
    )
    c.add_argument(
        "--value-bits", type=int, default=32, help="--algo sparse|sparse-split: 32, 8 or 4"
    )
    c.add_argument("--json", action="store_true")
    sub.add_parser("profiles", help="list the shipped hardware profiles")
    sub.add_parser("models", help="list the models: shape-only paper models and refdl's")
    args = p.parse_args(argv)
    try:
        if args.cmd == "profiles":
            for name in hw.names():
                print(f"{name:22s} {hw.load(name).description}")
            return 0
        algo = args.algo or next(iter(OPS.get(args.op, {"ring": None})))  # the op's own
        rows = predict_collective(args.hw, args.op, algo, args.bytes, _ints(args.workers),
                                  args.library, args.density, args.value_bits)  # fmt: skip
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows, indent=1))
    else:
        print(f"{'workers':>8s} {'time ms [80 % interval]':>30s} {'bound (ms)':>12s} "
              f"{'algbw (GB/s)':>14s} {'busbw (GB/s)':>14s}")  # fmt: skip
        for r in rows:
            iv = _with_interval(r["time_s"], r["time_low_s"], r["time_high_s"], 4)
            print(
                f"{r['workers']:8d} {iv:>30s} {r['bound_time_s'] * 1e3:12.4f} "
                f"{r['algbw'] / 1e9:14.2f} "
                f"{r['busbw'] / 1e9:14.2f}"
            )
        print("time: expected with the library's fitted latency and fraction of line rate; "
              "bound: one latency plus the "
              "data at full line rate, as in-network reduction (SHARP) moves it - no run is "
              "faster; algbw = bytes / time, busbw = algbw "
              "x the collective's bus factor (as nccl-tests report them)")  # fmt: skip
        for line in dict.fromkeys(r["stack_note"] for r in rows if r["stack_note"]):
            print(line)
        for r in rows if "speedup_over_dense" in rows[0] else ():
            print(f"{r['workers']} workers: the dense ring takes "
                  f"{r['dense_ring_time_s'] * 1e3:.4f} ms; sparse at density {r['density']} "
                  f"({r['value_bits']}-bit values): {r['speedup_over_dense']:.2f}x")  # fmt: skip
        if "note" in rows[0]:
            print(f"note: {rows[0]['note']}")
    return 0


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, "refdl.predict"))
