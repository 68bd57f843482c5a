"""Allreduce (sum, float32) under ``mpirun``: raw MPI vs mpi4jax, and what closes the gap.

Run as::

    mpirun -n 4 python -m refdl.bench.mpi_allreduce --out allreduce.json \\
        [--sizes 4096,65536,...] [--repeats 15] [--variant naive,unordered,...|all]

Variants (``raw`` is always timed: it is the reference of every ratio):

- ``raw``: mpi4py ``comm.Allreduce`` on NumPy buffers, output preallocated once;
- ``raw_loop``: ``raw`` K times back to back (ping-pong buffers, no barrier in between),
  the reference for the batched variants below;
- ``naive``: ``mpi4jax.allreduce`` in a ``jax.jit`` function, called once per repeat,
  ``block_until_ready`` on the result;
- ``naive_np``: ``naive`` plus ``np.asarray`` of the result (the jax.Array -> NumPy step);
- ``donate``: ``naive`` with ``donate_argnums=0`` (the result is the next input);
- ``unordered``: the same mpi4jax FFI kernel, bound by a primitive *without* mpi4jax's
  ordered effect, so jax dispatches the call through its C++ fast path;
- batched, time / K: ``loop`` / ``unordered_loop`` chain K allreduces in one jitted
  ``lax.fori_loop`` (carry donated); ``unrolled`` chains them in a Python loop in the jit.

Every repeat: barrier, time the call, per rank; a repeat's time is the slowest rank's.
Variants are interleaved (rotating order) within each size, so slow phases of a shared
machine fall on all of them alike; CPU used by other processes meanwhile is recorded per
size (``foreign_cpu_s``), and such sizes are flagged as noisy. Rank 0 writes the median /
min seconds per allreduce, ratios to ``raw`` (and ``raw_loop``), and per-allreduce minor
page faults and context switches, which tell *why* a variant is slow.

Why mpi4jax was slower (2-core VM, 2 and 4 ranks; measured with this module):

1. Dispatch. mpi4jax primitives carry an *ordered effect*; jax then runs each call of the
   jitted function through its Python dispatch path (runtime tokens, no C++ fast path),
   inline on the calling thread: ~0.3-0.5 ms CPU per call, ~2 ms when 4 ranks share 2
   cores. It is the whole gap up to ~1 MiB. ``unordered`` removes it; batching K
   allreduces in one jitted call pays it once per call.
2. Page faults. Each call returns a fresh output buffer; glibc maps big blocks from the
   kernel and unmaps them on free (always above 32 MiB, erratically below: its mmap
   threshold adapts), so the output is faulted in again on every call (8192 faults per
   call at 32 MiB; OpenMPI's own 16 MiB scratch buffer adds 4096 to raw and mpi4jax alike).
   Fix, in the environment of every rank before it starts:
   ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1073741824:``
   ``glibc.malloc.trim_threshold=4294967296`` (freed blocks stay mapped and are reused;
   transparent huge pages where the kernel's THP mode is ``madvise``).
3. Not the cause: XLA's CPU thread settings, binding, synchronous dispatch, the jax.Array
   -> NumPy step (zero-copy on CPU), donation (the kernel cannot write in place).
   ``lax.fori_loop`` adds one buffer copy per iteration; an unrolled chain does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

KIB = 1024
MIB = 1024 * KIB
DEFAULT_SIZES: tuple[int, ...] = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 32 * MIB)
ALL_VARIANTS: tuple[str, ...] = (
    "raw",
    "raw_loop",
    "naive",
    "naive_np",
    "donate",
    "unordered",
    "loop",
    "unordered_loop",
    "unrolled",
)
DEFAULT_VARIANTS: tuple[str, ...] = ("raw", "raw_loop", "naive", "unordered", "loop", "unrolled")
LOOP_BYTES = 64 * MIB  # a loop variant runs K = LOOP_BYTES // size allreduces (2 <= K <= 16)
ENV_KEYS: tuple[str, ...] = (
    "XLA_FLAGS",
    "GLIBC_TUNABLES",
    "MALLOC_ARENA_MAX",
    "JAX_CPU_ENABLE_ASYNC_DISPATCH",
    "OMP_NUM_THREADS",
    "JAX_PLATFORMS",
)


def loop_count(nbytes: int) -> int:
    """Allreduces per call in the loop variants: enough to amortise dispatch, bounded time."""
    return max(2, min(16, LOOP_BYTES // max(nbytes, 1)))


@dataclass
class Timing:
    """Per-rank samples of one variant at one size (seconds per allreduce)."""

    per_op: int
    seconds: list[float] = field(default_factory=list)
    minflt: int = 0  # minor page faults during the timed calls
    nivcsw: int = 0  # involuntary context switches during the timed calls
    nvcsw: int = 0  # voluntary context switches (sleeps) during the timed calls


# ----------------------------------------------------------------------------------------
# The unordered primitive: mpi4jax's own FFI kernel, without the ordered effect.
# ----------------------------------------------------------------------------------------

_UNORDERED_P: Any = None


def _unordered_primitive() -> Any:
    """A primitive lowering to mpi4jax's ``mpi_allreduce_ffi`` target with no jax effect.

    mpi4jax threads an ordered-effect token through every MPI call so calls keep program
    order across jitted functions; that token is also what sends each call through jax's
    slow Python dispatch path. Here the kernel gets a fresh token made inside the
    computation instead (``has_side_effect`` keeps XLA from dropping or merging it).
    Safe when each jitted function has one MPI call or a data-dependent chain of them and
    calls are consumed in order (``block_until_ready``, or a data dependency); it is a
    measuring tool, not a general replacement for mpi4jax.
    """
    global _UNORDERED_P
    if _UNORDERED_P is not None:
        return _UNORDERED_P
    import jax
    import mpi4jax  # noqa: F401  (registers the FFI targets)
    from jax.core import ShapedArray
    from jax.extend.core import Primitive
    from jax.extend.mlir.dialects import stablehlo as hlo
    from jax.interpreters import mlir
    from mpi4jax._src.jax_compat import abstract_token
    from mpi4jax._src.utils import get_default_comm, to_dtype_handle, to_mpi_handle
    from mpi4py import MPI

    prim = Primitive("refdl_unordered_allreduce_sum")

    def impl(x: Any) -> Any:
        raise NotImplementedError("refdl_unordered_allreduce_sum runs inside jax.jit only")

    def abstract(x: Any) -> Any:
        return ShapedArray(x.shape, x.dtype)

    def lowering(ctx: Any, x: Any) -> list[Any]:
        (aval,) = ctx.avals_in
        token = hlo.create_token()
        ctx_tok = ctx.replace(
            avals_in=(aval, abstract_token), avals_out=(*ctx.avals_out, abstract_token)
        )
        rule = jax.ffi.ffi_lowering("mpi_allreduce_ffi", has_side_effect=True)
        out = rule(
            ctx_tok,
            x,
            token,
            nitems=np.int64(np.prod(aval.shape, dtype=np.int64)),
            op=np.int64(to_mpi_handle(MPI.SUM)),
            comm=np.int64(to_mpi_handle(get_default_comm())),
            dtype=np.int64(to_dtype_handle(aval.dtype)),
        )
        return [out[0]]

    prim.def_impl(impl)
    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lowering, platform="cpu")
    _UNORDERED_P = prim
    return prim


def unordered_allreduce(x: Any) -> Any:
    """Sum-allreduce of ``x`` over mpi4jax's default communicator, without ordering token."""
    return _unordered_primitive().bind(x)


# ----------------------------------------------------------------------------------------
# Variants: each returns (call, per_op, check) where call() runs one timed repeat.
# ----------------------------------------------------------------------------------------


Call = Callable[[], None]


def _variant(name: str, n: int, comm: Any) -> tuple[Call, int, Call]:
    """Build variant ``name`` for ``n`` float32 items: (timed call, ops per call, check)."""
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from jax import lax
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    k = loop_count(4 * n)
    mine = np.full(n, rank + 1, np.float32)  # the check input: the sum is size(size+1)/2
    total = size * (size + 1) / 2

    def expect(got: Any, value: float) -> None:
        got = np.asarray(got)
        if not np.allclose(got[[0, -1]], value, rtol=1e-5):
            raise AssertionError(f"{name}: allreduce gave {got[[0, -1]]}, expected {value}")

    def ordered(x: Any) -> Any:
        return mpi4jax.allreduce(x, op=MPI.SUM)

    if name in ("raw", "raw_loop"):
        send, recv = np.zeros(n, np.float32), np.empty(n, np.float32)
        if name == "raw":

            def call() -> None:
                comm.Allreduce(send, recv, op=MPI.SUM)

        else:

            def call() -> None:
                a, b = send, recv
                for _ in range(k):
                    comm.Allreduce(a, b, op=MPI.SUM)
                    a, b = b, a

        def check() -> None:
            out = np.empty_like(mine)
            comm.Allreduce(mine, out, op=MPI.SUM)
            expect(out, total)

        return call, (k if name == "raw_loop" else 1), check

    if name in ("naive", "naive_np", "unordered"):
        f = jax.jit(unordered_allreduce if name == "unordered" else ordered)
        x = jnp.zeros(n, jnp.float32)
        if name == "naive_np":

            def call() -> None:
                np.asarray(f(x))

        else:

            def call() -> None:
                f(x).block_until_ready()

        return call, 1, lambda: expect(f(jnp.asarray(mine)), total)

    if name == "donate":
        f = jax.jit(ordered, donate_argnums=0)
        box = [jnp.zeros(n, jnp.float32)]

        def call() -> None:
            box[0] = f(box[0])
            box[0].block_until_ready()

        return call, 1, lambda: expect(f(jnp.asarray(mine)), total)

    if name in ("loop", "unordered_loop"):
        step = unordered_allreduce if name == "unordered_loop" else ordered

        def chain(x: Any) -> Any:
            return lax.fori_loop(0, k, lambda _, y: step(y), x)

        f = jax.jit(chain, donate_argnums=0)
        box = [jnp.zeros(n, jnp.float32)]

        def call() -> None:
            box[0] = f(box[0])
            box[0].block_until_ready()

        return call, k, lambda: expect(f(jnp.asarray(mine)), total * size ** (k - 1))

    if name == "unrolled":

        def unrolled(x: Any) -> Any:
            for _ in range(k):
                x = ordered(x)
            return x

        f = jax.jit(unrolled, donate_argnums=0)
        box = [jnp.zeros(n, jnp.float32)]

        def call() -> None:
            box[0] = f(box[0])
            box[0].block_until_ready()

        return call, k, lambda: expect(f(jnp.asarray(mine)), total * size ** (k - 1))

    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(ALL_VARIANTS)}")


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def machine_cpu_seconds() -> tuple[float, float] | None:
    """(busy, stolen) CPU seconds of the whole machine so far (``/proc/stat``), or None.

    Busy minus what the ranks used themselves is CPU taken by other processes while we
    timed: on a shared machine that, and time stolen by the hypervisor, show up as
    multi-millisecond stalls of a spinning rank. Both are recorded per size so that noisy
    runs can be told apart from real differences.
    """
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / tick, steal / tick


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def time_size(
    nbytes: int, variants: Sequence[str], repeats: int, warmup: int, comm: Any
) -> dict[str, Timing]:
    """Time all ``variants`` at ``nbytes``, interleaved, each repeat after a barrier."""
    n = nbytes // 4
    built = {v: _variant(v, n, comm) for v in variants}
    for _, _, check in built.values():
        check()  # also compiles
    out = {v: Timing(per_op=built[v][1]) for v in variants}
    order = list(variants)
    for rep in range(warmup + repeats):
        shift = rep % len(order)
        for v in order[shift:] + order[:shift]:
            call, per_op, _ = built[v]
            comm.Barrier()
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            if rep >= warmup:
                t = out[v]
                t.seconds.append((t1 - t0) / per_op)
                t.minflt += u1.ru_minflt - u0.ru_minflt
                t.nivcsw += u1.ru_nivcsw - u0.ru_nivcsw
                t.nvcsw += u1.ru_nvcsw - u0.ru_nvcsw
    return out


def summarize(nbytes: int, per_rank: list[dict[str, Timing]]) -> dict[str, Any]:
    """Across ranks: a repeat takes as long as its slowest rank; then median and min."""
    result: dict[str, Any] = {"bytes": nbytes, "items": nbytes // 4, "variants": {}}
    for v, first in per_rank[0].items():
        slowest = np.max([r[v].seconds for r in per_rank], axis=0)
        ops = first.per_op * len(first.seconds) * len(per_rank)
        result["variants"][v] = {
            "median_s": float(np.median(slowest)),
            "min_s": float(np.min(slowest)),
            "mean_s": float(np.mean(slowest)),
            "repeats": len(slowest),
            "allreduces_per_call": first.per_op,
            "minor_faults_per_op": sum(r[v].minflt for r in per_rank) / ops,
            "involuntary_switches_per_op": sum(r[v].nivcsw for r in per_rank) / ops,
            "voluntary_switches_per_op": sum(r[v].nvcsw for r in per_rank) / ops,
        }
    stats = result["variants"]
    for s in stats.values():
        s["ratio_median_vs_raw"] = s["median_s"] / stats["raw"]["median_s"]
        s["ratio_min_vs_raw"] = s["min_s"] / stats["raw"]["min_s"]
        if s["allreduces_per_call"] > 1 and "raw_loop" in stats:  # batched: back-to-back ref
            s["ratio_median_vs_raw_loop"] = s["median_s"] / stats["raw_loop"]["median_s"]
            s["ratio_min_vs_raw_loop"] = s["min_s"] / stats["raw_loop"]["min_s"]
    return result


def _meta(comm: Any, sizes: Sequence[int], variants: Sequence[str], args: Any) -> dict[str, Any]:
    """Run conditions: ranks, sizes, environment that changes the result, versions."""
    import jax
    import mpi4jax
    import mpi4py
    from mpi4py import MPI

    affinity = comm.gather(sorted(os.sched_getaffinity(0)), root=0)
    return {
        "ranks": comm.Get_size(),
        "sizes_bytes": list(sizes),
        "variants": list(variants),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "loop_allreduces": {str(s): loop_count(s) for s in sizes},
        "timing": "per repeat: barrier, then the call; a repeat's time is the slowest rank's; "
        "batched variants divide by their allreduces per call",
        "env": {k: v for k, v in os.environ.items() if k in ENV_KEYS or _is_mca_setting(k)},
        "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "libc": " ".join(platform.libc_ver()),
        "cpu_affinity_per_rank": affinity,
        "cpu_count": os.cpu_count(),
        "machine": platform.platform(),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "mpi4jax": mpi4jax.__version__,
            "mpi4py": mpi4py.__version__,
            "mpi": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
        },
    }


def _is_mca_setting(name: str) -> bool:
    """An OpenMPI MCA parameter set by the user (``--mca``), not one mpirun always sets."""
    launcher = ("PREFIXES", "num_procs", "initial_wdir", "cpu_type")
    return name.startswith("OMPI_MCA_") and name[len("OMPI_MCA_") :] not in launcher


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _table(results: list[dict[str, Any]], variants: Sequence[str]) -> str:
    head = f"{'bytes':>10} " + " ".join(f"{v:>22}" for v in variants)
    lines = [head, " " * 11 + " ".join(f"{'median ms (x raw)':>22}" for _ in variants)]
    for r in results:
        cells = []
        for v in variants:
            s = r["variants"][v]
            cells.append(f"{s['median_s'] * 1e3:10.3f} ({s['ratio_median_vs_raw']:6.2f}x)")
        lines.append(f"{r['bytes']:>10} " + " ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line: output file, sizes in bytes, repeats, variants."""
    p = argparse.ArgumentParser(
        prog="mpirun -n P python -m refdl.bench.mpi_allreduce",
        description=(__doc__ or "").split("\n", 1)[0] + " (details: the module docstring)",
    )
    p.add_argument("--out", required=True, type=Path, help="JSON file written by rank 0")
    p.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="comma-separated message sizes in bytes (multiples of 4)",
    )
    p.add_argument("--repeats", type=int, default=15, help="timed repeats per size and variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed repeats first")
    p.add_argument(
        "--variant",
        action="append",
        help=f"variant(s), comma-separated or repeated; from {', '.join(ALL_VARIANTS)}, "
        f"or 'all' (default {','.join(DEFAULT_VARIANTS)}); raw is always included",
    )
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    if any(s <= 0 or s % 4 for s in args.sizes):
        p.error("--sizes must be positive multiples of 4 bytes")
    names = [v.strip() for a in args.variant or DEFAULT_VARIANTS for v in a.split(",")]
    names = list(ALL_VARIANTS) if "all" in names else names
    unknown = sorted(set(names) - set(ALL_VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(ALL_VARIANTS)}")
    args.variants = ["raw", *[v for v in ALL_VARIANTS if v in names and v != "raw"]]
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Time every size and variant; rank 0 prints a table and writes the JSON."""
    args = parse_args(argv)
    os.environ.setdefault("MPI4JAX_NO_WARN_JAX_VERSION", "1")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    results: list[dict[str, Any]] = []
    if rank == 0:
        print("\n".join(_table([], args.variants).splitlines()[:2]), flush=True)
    for nbytes in args.sizes:
        comm.Barrier()
        mach0, own0, t0 = machine_cpu_seconds(), process_cpu_seconds(), time.perf_counter()
        mine = time_size(nbytes, args.variants, args.repeats, args.warmup, comm)
        comm.Barrier()
        mach1, own1, t1 = machine_cpu_seconds(), process_cpu_seconds(), time.perf_counter()
        gathered = comm.gather(mine, root=0)
        own = comm.reduce(own1 - own0, op=MPI.SUM, root=0)
        if rank == 0:
            results.append(summarize(nbytes, gathered))
            results[-1]["wall_s"] = t1 - t0
            if mach0 is not None and mach1 is not None:
                results[-1]["foreign_cpu_s"] = max(0.0, mach1[0] - mach0[0] - own)
                results[-1]["stolen_cpu_s"] = mach1[1] - mach0[1]
            line = _table(results[-1:], args.variants).splitlines()[-1]
            foreign = results[-1].get("foreign_cpu_s", 0.0)
            if foreign > 0.05 * results[-1]["wall_s"]:
                line += f"  [other processes used {foreign:.1f} CPU-s: noisy]"
            print(line, flush=True)
    meta = _meta(comm, args.sizes, args.variants, args)
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
