"""A matrix product's time by its shape (issue 52, compute by shape): two candidate models.

- ``roofline``: ``t0 + max(2MNK / (peak f), bytes / (bandwidth 0.9))`` - a kernel's
  latency, then the larger of its arithmetic at a fraction ``f`` of peak and its three
  matrices through memory once; a small product pays the latency and the memory-bound
  regime, a large one approaches ``f``.
- ``waves``: the same, with the arithmetic dealt as cuBLAS deals it: output tiles of
  ``tm x tn`` (256x128 ... 32x32, optionally split along K into ``s`` parts), one tile
  per streaming multiprocessor at a time, so a product takes ``ceil(tiles s / SMs)``
  waves of one tile's time (tile and wave quantization, NVIDIA's "Matrix Multiplication
  Background" guide); a tile of ``a`` elements runs at ``(a / 128^2)^decay`` of a
  128x128 tile's rate (at most 1), and the fastest tile and split are taken.

In both, a product with a dimension of no whole 16 bytes runs at ``unaligned`` of the
rate where Tensor Cores would run it (measured on a lent H200: a quarter in bf16).

``scripts/bench_gemm_shapes.py`` fits each model's figures to the calibration rows of
DeepBench's per-shape GEMMs (``docs/published/gemm_deepbench.csv``) and judges them on
the held-out rows. ``roofline`` predicted the held-out generation better, so a
transformer's step uses it (``step_overhead_s``, with ``STEP``'s figures): what its
matrix products, at their shapes on one device, take beyond their arithmetic at
``STEP.fraction`` of peak - a kernel's latency each, and the memory-bound excess of
small products. That excess is what gives a microbatch's size (and a tensor-parallel
degree) a price of its own (docs/performance-model.md). ``STEP`` keeps the P100's
figures (no Tensor Core, ``unaligned`` 1): on a step's scale its latency also carries a
layer's other kernels (refdl's own H200 step, ``scripts/bench_microbatch.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Streaming multiprocessors per device name (the profiles' [device] name): NVIDIA's Tesla
# P100 whitepaper (56 of the GP100's 60), Tesla V100 whitepaper (80 of 84), A100 (108 of
# 128) and H100 SXM5 (132 of 144) architecture whitepapers.
SMS = {"Tesla P100 PCIe": 56, "Tesla P100 SXM2": 56, "Tesla V100 SXM2": 80, "A100 SXM": 108,
       "H100 SXM": 132}  # fmt: skip
TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64), (32, 32))
SPLITS = (1, 2, 4, 8, 16)
MEMORY = 0.9  # of the datasheet bandwidth (the profiles' achieved memory fraction)
MODELS = ("roofline", "waves")


@dataclasses.dataclass(frozen=True)
class Device:
    """What a product's time depends on: peak FLOP/s of its dtype, memory bandwidth,
    streaming multiprocessors."""

    peak: float
    bandwidth: float
    sms: int


@dataclasses.dataclass(frozen=True)
class Figures:
    """A model's fitted figures: fraction of peak, a kernel's latency, tile decay, and the
    share of that rate a product keeps when a dimension is not ``ALIGN`` bytes whole
    (``unaligned``: 1 where no Tensor Core runs it)."""

    fraction: float
    latency_s: float
    decay: float = 0.0
    unaligned: float = 1.0


# Tensor Cores take rows of whole 16-byte units (NVIDIA's "Matrix Multiplication
# Background" guide: dimensions multiple of 8 in fp16); cuBLAS runs any other product on
# slower kernels - on the H200 measured here, DeepBench's 32 bf16 shapes with a dimension
# not a multiple of 8 ran at 0.22 of peak (median of those of 1e10 FLOP or more), the
# aligned at 0.70. (XLA pads such bf16 products to multiples of 8 before cuBLAS:
# ``CublasPadForGemms``.)
ALIGN = 16


# ``roofline``'s figures fitted to DeepBench's 160 P100 GEMMs (2017) and judged on the same
# shapes on a V100 (held out: 4.0 % median |error| in fp32, 10.6 % in fp16 on Tensor
# Cores; scripts/bench_gemm_shapes.py, docs/bench/gemm_shapes.json, 2026-11-27).
STEP = Figures(fraction=0.86, latency_s=1e-6 * 2 ** (9 / 2))  # 22.6 us


def memory_s(m: int, n: int, k: int, width: int, dev: Device) -> float:
    """The three matrices through memory once (``width`` bytes an element)."""
    return (m * k + k * n + m * n) * width / (dev.bandwidth * MEMORY)


def aligned(m: int, n: int, k: int, width: int) -> bool:
    """Whether every dimension of the product is whole ``ALIGN``-byte units."""
    return all(x * width % ALIGN == 0 for x in (m, n, k))


def rate_share(m: int, n: int, k: int, width: int, f: Figures) -> float:
    """The share of ``f.fraction`` of peak the product's arithmetic runs at."""
    return 1.0 if f.unaligned == 1.0 or aligned(m, n, k, width) else f.unaligned


def roofline_s(m: int, n: int, k: int, width: int, dev: Device, f: Figures) -> float:
    """``roofline``'s time of an ``m x k`` by ``k x n`` product."""
    rate = dev.peak * f.fraction * rate_share(m, n, k, width, f)
    return f.latency_s + max(2.0 * m * n * k / rate, memory_s(m, n, k, width, dev))


def waves_s(m: int, n: int, k: int, width: int, dev: Device, f: Figures) -> float:
    """``waves``'s time: the fastest tile and split-K, in whole waves over the SMs."""
    per_sm = dev.peak * f.fraction * rate_share(m, n, k, width, f) / dev.sms
    best = math.inf
    for tm, tn in TILES:
        rate = per_sm * min(1.0, (tm * tn / 128**2) ** f.decay)
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        for s in SPLITS:
            t = math.ceil(tiles * s / dev.sms) * 2.0 * tm * tn * (k / s) / rate
            best = min(best, t)
    return f.latency_s + max(best, memory_s(m, n, k, width, dev))


def gemm_s(model: str, m: int, n: int, k: int, width: int, dev: Device, f: Figures) -> float:
    """The time ``model`` gives one product."""
    return (waves_s if model == "waves" else roofline_s)(m, n, k, width, dev, f)


def _loss(model: str, rows: list[tuple], f: Figures) -> float:
    return sum(math.log(gemm_s(model, m, n, k, w, dev, f) / t) ** 2
               for m, n, k, w, dev, t in rows)  # fmt: skip


def fit(
    model: str, rows: list[tuple[int, int, int, int, Device, float]], tensor_cores: bool = False
) -> Figures:
    """The figures of ``model`` that fit ``rows`` (m, n, k, width, device, seconds) best:
    least squares on log time over a grid, so the fit is reproducible. With
    ``tensor_cores`` the aligned rows fit the figures and the others then ``unaligned``
    alone; without, every row fits them and ``unaligned`` stays 1."""
    decays = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5) if model == "waves" else (0.0,)
    first = [r for r in rows if aligned(*r[:4])] if tensor_cores else rows
    best = None
    for frac in [x / 100 for x in range(40, 101, 2)]:
        for lat in [1e-6 * 2 ** (j / 2) for j in range(0, 11)]:
            for d in decays:
                f = Figures(frac, lat, d)
                loss = _loss(model, first, f)
                if best is None or loss < best[0]:
                    best = (loss, f)
    f = best[1]
    rest = [r for r in rows if not aligned(*r[:4])] if tensor_cores else []
    if rest:
        shares = [x / 100 for x in range(5, 101, 5)]
        share = min(shares, key=lambda u: _loss(model, rest, dataclasses.replace(f, unaligned=u)))
        f = dataclasses.replace(f, unaligned=share)
    return f


def applies(device_name: str) -> bool:
    """Whether ``STEP``'s figures describe the device: the NVIDIA GPUs of ``SMS`` (the
    figures were fitted on a P100 and held out on a V100; a CPU's own operation rates,
    ``[device.ops]``, already carry its shapes)."""
    return device_name in SMS


def layer_products(shape: Any, tokens: float, tp: int = 1, ep: int = 1) -> list[tuple]:
    """One layer's forward matrix products on one device as ``(m, n, k, count, launches)``,
    for ``tokens`` tokens of a microbatch (the mean over layers where the first are
    dense): the attention's input projections as one product (latent attention's too,
    counted as from the residual stream: its FLOPs, not its exact shapes), its output
    projection, the MLP's up (gated: both halves) and down products split ``tp`` ways, a
    routed expert's over the tokens the ``ep`` ranks send it (``E / ep`` experts a device,
    launched as one grouped kernel a product, as Megatron-Core's grouped GEMM and
    torchtitan's grouped matmul run them: one latency, each expert's own memory), shared
    experts and the router."""
    h = shape.d_model
    inputs = (shape.attention_params() - shape.d_v * h) / h
    out = [(tokens, inputs / tp, h, 1.0, 1.0), (tokens, h, shape.d_v / tp, 1.0, 1.0)]

    def mlp(rows: float, width: float, count: float, launches: float) -> list[tuple]:
        ups = (2 if shape.gated else 1) * width / tp
        return [(rows, ups, h, count, launches), (rows, h, width / tp, count, launches)]

    if not shape.experts:
        return out + mlp(tokens, shape.hidden, 1.0, 1.0)
    moe = shape.moe_layers / shape.layers
    dense = 1.0 - moe
    if dense:
        out += mlp(tokens, shape.dense_ffn or shape.hidden, dense, dense)
    per_expert = max(1.0, tokens * ep * shape.routed / shape.experts)
    out += mlp(per_expert, shape.hidden, moe * shape.experts / ep, moe)
    if shape.shared_experts:
        out += mlp(tokens, shape.hidden, moe * shape.shared_experts, moe * shape.shared_experts)
    out.append((tokens, shape.experts, h, moe, moe))
    return out


def products_overhead_s(products: list[tuple], width: int, peak: float, bandwidth: float,
                        f: Figures = STEP) -> float:  # fmt: skip
    """What ``products`` take beyond their arithmetic at ``f.fraction`` of ``peak``:
    ``roofline``'s latency once a launch, and each product's memory-bound excess, on a
    device of ``bandwidth``."""
    dev = Device(peak, bandwidth, 0)
    extra = 0.0
    for m, n, k, count, launches in products:
        m, n, k = max(1, math.ceil(m)), max(1, math.ceil(n)), max(1, math.ceil(k))
        arithmetic = 2.0 * m * n * k / (peak * f.fraction)
        extra += launches * f.latency_s
        extra += count * max(0.0, memory_s(m, n, k, width, dev) - arithmetic)
    return extra


def step_overhead_s(shape: Any, tokens: float, layers: float, width: int, peak: float,
                    bandwidth: float, tp: int = 1, ep: int = 1, cp: int = 1,
                    remat: str = "none", ring: bool = True) -> float:  # fmt: skip
    """One microbatch's shape overhead on a device running ``layers`` layers (a stage's
    share of the logits beside them): each layer product's three forward-sized passes
    (forward, backward's two), four with ``full`` recomputation; the attention core as
    one fused kernel a pass (``attention_overhead_s``: its latency, and its memory-bound
    excess where there is one; one more pass with ``selective`` recomputation); the
    logits' three passes (never recomputed)."""
    passes = 4 if remat == "full" else 3
    per_layer = products_overhead_s(layer_products(shape, tokens, tp, ep), width, peak,
                                    bandwidth)  # fmt: skip
    logits = products_overhead_s([(tokens, shape.vocab / tp, shape.d_model, 1.0, 1.0)],
                                 width, peak, bandwidth)  # fmt: skip
    core = (passes + (remat == "selective")) * attention_overhead_s(
        shape, tokens, width, peak, bandwidth, tp, cp, ring
    )
    return layers * (passes * per_layer + core) + 3 * logits * layers / shape.layers


def attention_overhead_s(shape: Any, tokens: float, width: int, peak: float,
                         bandwidth: float, tp: int = 1, cp: int = 1,
                         ring: bool = True) -> float:  # fmt: skip
    """One pass of a layer's fused attention core (flash attention) beyond its arithmetic
    at ``STEP.fraction``: a kernel's latency (``cp`` of them on a context ring, one with
    all-to-all) and, where its bytes outweigh its FLOPs, the memory-bound excess - the
    roofline of the kernel reading queries, keys and values and writing its output (no
    scores): ``tokens`` queries of a microbatch, each against its own sequence's keys,
    the heads split ``tp`` ways. A ring block's kernel reads the queries and writes the
    output again (``cp`` times); all-to-all splits the heads, and so the keys and values,
    ``cp`` ways. Compute-bound from a few hundred tokens on (its FLOPs per byte grow
    with the sequence). Keys and values copied where ``kv_heads < tp`` are not counted."""
    keys = tokens * cp  # the microbatch's keys and values reach the device once
    flops = 2.0 * tokens * shape.seq * (shape.d_qk + shape.d_v) / tp
    heads_kv = shape.kv_heads or shape.heads
    kv = heads_kv * (shape.d_head + shape.rope_dim + (shape.v_head_dim or shape.d_head))
    q_o = tokens * (shape.d_qk + shape.d_v) * (cp if ring else 1)
    moved = (q_o + keys * kv / (1 if ring else cp)) * width / tp
    excess = max(0.0, moved / (bandwidth * MEMORY) - flops / (peak * STEP.fraction))
    return (cp if ring else 1) * STEP.latency_s + excess
