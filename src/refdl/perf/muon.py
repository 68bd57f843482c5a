"""Muon's price: the Newton-Schulz FLOPs of every matrix, and the bytes a scheme moves
where no device holds a whole matrix (``refdl.parallel.muon``'s schemes on ZeRO shards).

A matrix ``[a, b]`` (``m = min``, ``n = max``) costs ``5 (4 m^2 n + 2 m^3)`` FLOPs: five
quintic iterations, each ``A = XX^T`` (``2 m^2 n``), ``A^2`` (``2 m^3``) and ``(bA + cA^2) X``
(``2 m^2 n``). Who pays them, per strategy formula:

- ``zero_sharding`` (fsdp): ``gather`` - every rank all of them (redundant) after an
  all-gather of ``Psi_muon``; ``owner`` - each rank its share (``1/P``, at least the
  largest matrix) and point-to-point traffic of ``2 (P - 1) / P Psi_muon`` in all;
- ``one_device`` and ``data_parallel``: every replica all of them (redundant, no bytes);
- any other (tensor, pipeline, mesh, context...): each device its ``1/P`` share (a stage's
  own matrices, or XLA's sharded products), no bytes counted.

The matrices: a transformer shape's attention projections and MLP (each expert's),
else those ``refdl.core.optim`` gives Muon (``ModelCost.muon_matrices``): a refdl model's
by its logical axes; a shape-only model's every kernel of two or more axes, convolutions
reshaped (it declares no axes, so its output layer is counted too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from refdl.perf import CostBreakdown, roofline_time
from refdl.perf.collectives import allgather_ring

NS_STEPS = 5
SCHEMES = ("gather", "owner")


def matrices(m: Any, expert: int = 1) -> list[tuple[float, int, int]]:
    """``(count, fan_in, fan_out)`` of the matrices Muon updates in model cost ``m`` that
    one device of an ``expert``-way expert axis holds (its share of each expert bank;
    the shared experts' MLPs whole)."""
    t = m.transformer
    if t is not None:
        h, f = t.d_model, t.hidden
        banks = t.layers * max(t.experts, 1) / (expert if t.experts else 1)
        mlp = []
        for count in (banks, t.layers * t.shared_experts):
            if count:
                mlp += [(count, h, f)] * (2 if t.gated else 1) + [(count, f, h)]
        return [(t.layers, h, t.d_q), (2 * t.layers, h, t.d_kv), (t.layers, t.d_q, h), *mlp]
    return list(m.muon_matrices)


def ns_flops(fan_in: int, fan_out: int) -> float:
    """Newton-Schulz FLOPs of one matrix (the module's docstring)."""
    small, large = min(fan_in, fan_out), max(fan_in, fan_out)
    return NS_STEPS * (4.0 * small * small * large + 2.0 * small**3)


def priced(formula_name: str, c: CostBreakdown, m: Any, hw: Any, workers: int,
           scheme: str, link: Any) -> CostBreakdown:  # fmt: skip
    """``c`` with Muon's compute, bytes and working memory added (the module's docstring);
    ``link``: the alpha-beta link of ``workers`` ranks."""
    p = max(workers, 1)
    if formula_name == "zero_sharding":
        return on_mesh(c, m, hw, 1, p, scheme, link)
    if formula_name in ("tensor", "pipeline"):  # a shard or a stage of the matrices each
        return on_mesh(c, m, hw, p, 1, scheme, link)
    return on_mesh(c, m, hw, 1, 1, scheme, link)  # replicas: every one all of them


def mesh_split(mesh: Any, data_zero: int = 0) -> tuple[int, int, int]:
    """``(split, shards, expert)`` of a mesh for ``on_mesh``: tensor and pipeline axes
    split the matrices, ZeRO over ``fsdp`` (and ``data`` with ``data_zero``) shards their
    state, the expert axis splits the expert banks; data and context replicas repeat."""
    return (mesh.model * mesh.pipe, mesh.fsdp * (mesh.data if data_zero else 1),
            mesh.expert)  # fmt: skip


def on_mesh(c: CostBreakdown, m: Any, hw: Any, split: int, shards: int, scheme: str,
            link: Any, expert: int = 1) -> CostBreakdown:  # fmt: skip
    """``c`` with Muon's terms where each device holds ``1/split`` of every matrix's work
    (tensor and pipeline axes: XLA's sharded products, a stage's own matrices; replicas
    repeat it) and ``shards`` ranks share each matrix's optimizer state (ZeRO), reached
    whole by ``scheme`` (``gather`` or ``owner``; ``link``: those ranks' link)."""
    mats = matrices(m, expert)
    if not mats:
        return c
    total = sum(k * ns_flops(a, b) for k, a, b in mats) / split
    largest = max(ns_flops(a, b) for _k, a, b in mats) / split
    psi = sum(4.0 * k * a * b for k, a, b in mats) / split
    comm_s, comm_bytes, flops = 0.0, 0.0, total
    if shards > 1 and scheme == "gather":
        comm_s, comm_bytes = allgather_ring(psi, shards, link), (shards - 1) * psi
    elif shards > 1:
        flops = max(total / shards, largest)
        comm_s = allgather_ring(2 * psi / shards, shards, link)
        comm_bytes = 2 * (shards - 1) * psi / shards
    work = max(4.0 * a * b for _k, a, b in mats) / split  # a matrix, its Gram, its result
    return dataclasses.replace(
        c,
        compute_s=c.compute_s + roofline_time(flops, 3 * NS_STEPS * psi / shards, hw),
        comm_s=c.comm_s + comm_s,
        flops=c.flops + flops,
        comm_bytes=c.comm_bytes + comm_bytes,
        memory_bytes=int(c.memory_bytes + 3 * work),
    )
