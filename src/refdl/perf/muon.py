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
else a model's fully connected layers but the last (the output layer goes to AdamW, as
do embeddings, norms and biases); convolution kernels are not counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from refdl.perf import CostBreakdown, roofline_time
from refdl.perf.collectives import allgather_ring

NS_STEPS = 5
SCHEMES = ("gather", "owner")


def matrices(m: Any) -> list[tuple[int, int, int]]:
    """``(count, fan_in, fan_out)`` of the matrices Muon updates in model cost ``m``."""
    t = m.transformer
    if t is not None:
        h, f = t.d_model, t.hidden
        mlp = [(t.layers * max(t.experts, 1), h, f)] * (2 if t.gated else 1)
        mlp.append((t.layers * max(t.experts, 1), f, h))
        return [(t.layers, h, t.d_q), (2 * t.layers, h, t.d_kv), (t.layers, t.d_q, h), *mlp]
    return [(1, fan_in, fan_out) for _rows, fan_in, fan_out, _n in m.dense_layers[:-1]]


def ns_flops(fan_in: int, fan_out: int) -> float:
    """Newton-Schulz FLOPs of one matrix (the module's docstring)."""
    small, large = min(fan_in, fan_out), max(fan_in, fan_out)
    return NS_STEPS * (4.0 * small * small * large + 2.0 * small**3)


def priced(formula_name: str, c: CostBreakdown, m: Any, hw: Any, workers: int,
           scheme: str, link: Any) -> CostBreakdown:  # fmt: skip
    """``c`` with Muon's compute, bytes and working memory added (the module's docstring);
    ``link``: the alpha-beta link of ``workers`` ranks."""
    mats = matrices(m)
    if not mats:
        return c
    total = sum(k * ns_flops(a, b) for k, a, b in mats)
    largest = max(ns_flops(a, b) for _k, a, b in mats)
    psi = sum(4.0 * k * a * b for k, a, b in mats)
    p = max(workers, 1)
    comm_s, comm_bytes = 0.0, 0.0
    if formula_name == "zero_sharding" and p > 1:
        if scheme == "gather":
            flops = total
            comm_s, comm_bytes = allgather_ring(psi, p, link), (p - 1) * psi
        else:
            flops = max(total / p, largest)
            comm_s, comm_bytes = allgather_ring(2 * psi / p, p, link), 2 * (p - 1) * psi / p
    elif formula_name in ("one_device", "data_parallel"):
        flops = total
    else:
        flops = total / p
    work = max(4.0 * a * b for _k, a, b in mats)  # one matrix, its Gram and result at once
    return dataclasses.replace(
        c,
        compute_s=c.compute_s + roofline_time(flops, 3 * NS_STEPS * psi / p, hw),
        comm_s=c.comm_s + comm_s,
        flops=c.flops + flops,
        comm_bytes=c.comm_bytes + comm_bytes,
        memory_bytes=int(c.memory_bytes + 3 * work),
    )
