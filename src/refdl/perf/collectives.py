"""Alpha-beta (Hockney) cost of collectives, push/pull and neighbour exchange.

``alpha`` is the latency per message (s), ``beta`` the seconds per byte on the
link, ``gamma`` the seconds per byte reduced, ``n`` the message bytes and ``p``
the ranks. Formulas from Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005; the parameter
server and neighbour exchange as in Ben-Nun & Hoefler, ACM CSUR 2019. Every
function returns 0 for ``p = 1`` (nothing to communicate).
"""

from __future__ import annotations

import dataclasses
import math

from refdl.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's alpha (s per message), beta (s per byte) and gamma (s per byte reduced)."""

    alpha: float
    beta: float
    gamma: float = 0.0


def _lg(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def allreduce_ring(n: float, p: int, link: Link) -> float:
    """``2(p-1)α + 2n(p-1)/p·β + n(p-1)/p·γ``."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * n * (p - 1) / p * link.beta + n * (p - 1) / p * link.gamma


def allreduce_hierarchical(
    n: float, p: int, per_node: int, intra: Link, inter: Link, nics: int = 1
) -> float:
    """NCCL's two-level ring across nodes: reduce-scatter inside each node of ``g`` devices,
    a ring allreduce of the ``n/g`` shard across the ``N`` nodes (the node's ``nics`` NICs
    shared by its ``g`` devices), then an allgather inside the node."""
    g = max(1, min(per_node, p))
    nodes = math.ceil(p / g)
    if nodes <= 1:
        return allreduce_ring(n, p, intra)
    shared = Link(inter.alpha, inter.beta * g / max(1, min(nics, g)), inter.gamma)
    return (reduce_scatter_ring(n, g, intra) + allreduce_ring(n / g, nodes, shared)
            + allgather_ring(n, g, intra))  # fmt: skip


def allgather_hierarchical(
    n: float, p: int, per_node: int, intra: Link, inter: Link, nics: int = 1
) -> float:
    """A two-level all-gather of ``n`` gathered bytes over ``p`` devices, ``per_node`` of
    them to a node: each device gathers its rail's ``n / g`` across the nodes (the
    node's ``nics`` NICs shared by its ``g`` devices), then the node gathers the ``g``
    rails' blocks over ``intra``. A reduce-scatter runs the same steps reversed."""
    g = max(1, min(per_node, p))
    nodes = math.ceil(p / g)
    if nodes <= 1:
        return allgather_ring(n, p, intra)
    shared = Link(inter.alpha, inter.beta * g / max(1, min(nics, g)), inter.gamma)
    return allgather_ring(n / g, nodes, shared) + allgather_ring(n, g, intra)


def allreduce_lower_bound(
    n: float, p: int, per_node: int, intra: Link, inter: Link | None = None, nics: int = 1
) -> float:
    """No allreduce is faster: one latency plus the larger of each device sending the
    ``(p-1)/p`` of its vector the others need over its own link, and each node sending
    ``(N-1)/N`` of it over its NICs (in-network reduction, NVLink SHARP or IB SHARP,
    can reach these; rings need twice)."""
    if p <= 1:
        return 0.0
    g = max(1, min(per_node, p))
    nodes = math.ceil(p / g)
    t = n * (g - 1) / g * intra.beta
    if nodes > 1 and inter is not None:
        t = max(t, n * (nodes - 1) / nodes * inter.beta / max(1, min(nics, g)))
        return inter.alpha + t
    return intra.alpha + t


def allreduce_recursive_doubling(n: float, p: int, link: Link) -> float:
    """``lg p·α + n·lg p·β + n·lg p·γ``."""
    lg = _lg(p)
    return lg * link.alpha + n * lg * link.beta + n * lg * link.gamma


def allreduce_rabenseifner(n: float, p: int, link: Link) -> float:
    """Halving reduce-scatter + doubling allgather: ``2 lg p·α + 2n(p-1)/p·β + n(p-1)/p·γ``."""
    if p <= 1:
        return 0.0
    return 2 * _lg(p) * link.alpha + 2 * n * (p - 1) / p * link.beta + n * (p - 1) / p * link.gamma


def allreduce_tree(n: float, p: int, link: Link) -> float:
    """Binomial reduce then binomial broadcast: ``2 lg p·(α + nβ) + lg p·nγ``."""
    lg = _lg(p)
    return 2 * lg * (link.alpha + n * link.beta) + lg * n * link.gamma


def reduce_scatter_ring(n: float, p: int, link: Link) -> float:
    """``(p-1)α + n(p-1)/p·β + n(p-1)/p·γ``."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + n * (p - 1) / p * (link.beta + link.gamma)


def allgather_ring(n: float, p: int, link: Link) -> float:
    """``(p-1)α + n(p-1)/p·β`` (n is the gathered total)."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + n * (p - 1) / p * link.beta


def alltoall_pairwise(n: float, p: int, link: Link) -> float:
    """Pairwise exchange, ``n`` each rank's whole buffer (it keeps ``n/p``): ``(p-1)α +
    n(p-1)/p·β`` (Thakur et al.'s long-message all-to-all; NCCL's send/recv pairs)."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + n * (p - 1) / p * link.beta


def reduce_tree(n: float, p: int, link: Link) -> float:
    """Binomial tree: ``lg p·α + n·lg p·β + n·lg p·γ``."""
    return allreduce_recursive_doubling(n, p, link)


def broadcast_scatter_allgather(n: float, p: int, link: Link) -> float:
    """Scatter then allgather: ``2 lg p·α + 2n(p-1)/p·β``."""
    if p <= 1:
        return 0.0
    return 2 * _lg(p) * link.alpha + 2 * n * (p - 1) / p * link.beta


def ps_push_pull(n: float, p: int, link: Link, servers: int = 1) -> float:
    """Parameter server: one server ``2(α + P·n·β)`` (its link serialises every push and
    pull); sharded over k servers ``≈ 2kα + 2nβ·max(1, P/k)``."""
    if p <= 1:
        return 0.0
    if servers <= 1:
        return 2 * (link.alpha + p * n * link.beta)
    return 2 * servers * link.alpha + 2 * n * link.beta * max(1.0, p / servers)


def neighbour_exchange(n: float, degree: int, link: Link, concurrent: bool = True) -> float:
    """Decentralized exchange with ``degree`` neighbours: ``α + nβ`` with concurrent links,
    ``d(α + nβ)`` serialised."""
    if degree <= 0:
        return 0.0
    one = link.alpha + n * link.beta
    return one if concurrent else degree * one


def allreduce_sparse(
    n: float,
    p: int,
    link: Link,
    density: float,
    value_bits: int = 32,
    algorithm: str = "recursive-doubling",
) -> float:
    """SparCML's sparse allreduce (``refdl.comm.sparse``) of ``n`` bytes of fp32 values of
    which each rank keeps ``density``. Recursive doubling: per round ``α`` + its message's
    bytes ``β`` (the sets double; from the switch round the dense vector), plus ``γ`` on
    the dense rounds. Split-allgather: per phase ``p - 1`` messages, ``(p - 1) α`` + the
    phase's bytes ``β``, plus ``γ`` on a dense first phase (the owner's sum)."""
    if p <= 1:
        return 0.0
    if p & (p - 1) and algorithm == "recursive-doubling":
        raise UsageError(f"the sparse allreduce needs a power-of-two --workers, not {p} "
                         "(--algo sparse-split takes any)")  # fmt: skip
    if not 0 < density <= 1:
        raise UsageError(f"--density must be in (0, 1], not {density}")
    if value_bits not in (32, 8, 4):
        raise UsageError(f"--value-bits must be 32, 8 or 4, not {value_bits}")
    from refdl.comm.sparse import SparseAllreduce  # (here: the profiles load without JAX)

    values = max(1, int(n // 4))
    sp = SparseAllreduce(values, max(1, math.ceil(density * values)), p, value_bits, algorithm)
    split = algorithm == "split-allgather"
    return sum(
        (p - 1 if split else 1) * link.alpha
        + b * link.beta
        + (b * link.gamma if kind == "dense" and not (split and s == 1) else 0.0)
        for s, ((kind, _), b) in enumerate(zip(sp.rounds(), sp.bytes_per_device(), strict=True))
    )


ALLREDUCE = {
    "ring": allreduce_ring,
    "recursive-doubling": allreduce_recursive_doubling,
    "rabenseifner": allreduce_rabenseifner,
    "halving-doubling": allreduce_rabenseifner,
    "tree": allreduce_tree,
}
OPS = {
    "allreduce": ALLREDUCE,
    "reduce-scatter": {"ring": reduce_scatter_ring},
    "allgather": {"ring": allgather_ring},
    "alltoall": {"pairwise": alltoall_pairwise},
    "reduce": {"tree": reduce_tree},
    "broadcast": {"scatter-allgather": broadcast_scatter_allgather},
}
# nccl-tests (doc/PERFORMANCE.md): busbw = algbw x factor(p)
BUS_FACTOR = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce-scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def collective_time(op: str, algo: str, n: float, p: int, link: Link) -> float:
    """The predicted time of collective ``op`` with algorithm ``algo``."""
    if op not in OPS:
        raise UsageError(f"unknown --op {op!r}; choose one of: {', '.join(OPS)}")
    if algo not in OPS[op]:
        raise UsageError(f"--op {op} has no --algo {algo!r}; choose one of: {', '.join(OPS[op])}")
    if p < 1 or n < 0:
        raise UsageError(f"--workers must be >= 1 and --bytes >= 0 (got {p}, {n})")
    return OPS[op][algo](n, p, link)


def bandwidths(op: str, n: float, p: int, seconds: float) -> tuple[float, float]:
    """nccl-tests' ``algbw = n / t`` and ``busbw = algbw x factor(p)`` (bytes/s)."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = n / seconds
    return algbw, algbw * BUS_FACTOR[op](p)
