"""A GPT-style transformer's training step on a six-axis mesh, in closed form.

What the six axes cost cannot be read off a compiled single-device step: the
context ring, the experts' all-to-all and sequence parallelism exist only in the
parallel program, and a GPT-3-size step cannot be compiled here. So, for a
``TransformerShape`` (dense or mixture-of-experts), this module counts:

- FLOPs (Narayanan et al. 2021, eq. 3): per layer and sequence of ``s`` tokens the
  forward is ``2 s x (matrix parameters)`` plus ``4 s^2 h`` for scores and values,
  the logits ``2 s h V``; backward is twice the forward; recomputation adds a
  layer forward (``full``) or the attention core ``4 s^2 h`` (``selective``,
  Korthikanti et al. 2022). An expert layer runs each token through ``top_k``
  experts, ``capacity_factor`` times over (the padded slots compute too).
- Activation memory per layer (Korthikanti et al. 2022, section 4: 16-bit values,
  1-byte dropout masks): ``s b h (34 + 5 a s / h)``, split ``t`` ways where tensor
  parallelism splits it (all of it with sequence parallelism), ``34 s b h`` kept
  with selective recomputation, ``2 s b h`` with full; fp32 doubles the 16-bit part.
- Each axis's collectives per step and device (``axis_comm``), on the link its
  group spans when the axes are placed as Megatron-Core places them (``NODE_ORDER``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from refdl.config.mesh import MeshSpec
from refdl.core.moe import capacity
from refdl.errors import UsageError
from refdl.perf import GRAD_REDUCE
from refdl.perf.collectives import (
    Link,
    allgather_hierarchical,
    allgather_ring,
    allreduce_hierarchical,
    allreduce_ring,
    alltoall_pairwise,
)

# Megatron-Core's rank order (tp-cp-ep-dp-pp): the model axis innermost, so its
# collectives stay inside a node; pipe outermost, crossing nodes with one message.
NODE_ORDER = ("model", "context", "expert", "fsdp", "data", "pipe")
# Bytes per parameter of the training state before optimizer words (Rajbhandari et al.
# 2020, section 3.1): fp32 weights and gradients (4 + 4), or in mixed precision 16-bit
# weights and gradients and an fp32 master copy (2 + 2 + 4); then 4 per optimizer word.
STATE_BYTES = 8
ACT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer: GPT's (learned positions, GELU MLP of 4h, tied
    embedding) by default; ``gated`` for SwiGLU's three matrices, ``kv_heads`` < heads
    for grouped-query attention, ``experts`` > 0 for a mixture-of-experts MLP in
    every layer (``top_k`` experts per token, ``capacity_factor`` slots per routed
    token; 1.0 also stands for dropless routing) but the first ``dense_layers`` (a dense
    MLP of ``dense_ffn``: DeepSeek's), ``head_dim`` where heads x head_dim is not
    d_model (Qwen3's). ``kv_lora`` > 0 is multi-head latent attention (DeepSeek-V2/V3):
    keys and values from a ``kv_lora``-wide latent, queries from a ``q_lora``-wide one
    (0: straight from the residual stream), ``head_dim`` + ``rope_dim`` per query/key
    head and ``v_head_dim`` per value head."""

    layers: int
    d_model: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0  # 0: 4 x d_model
    kv_heads: int = 0  # 0: heads
    head_dim: int = 0  # 0: d_model / heads
    gated: bool = False
    experts: int = 0
    top_k: int = 1
    capacity_factor: float = 1.0
    tied: bool = True
    positions: bool = True
    shared_experts: int = 0  # always-active experts beside the routed ones (DeepSeek's)
    dense_layers: int = 0  # with experts: the first layers' MLPs are dense (DeepSeek's)
    dense_ffn: int = 0  # their width (0: ffn)
    q_lora: int = 0  # multi-head latent attention (kv_lora > 0): the queries' latent
    kv_lora: int = 0  # the keys' and values' latent
    rope_dim: int = 0  # rotary part of a query/key head, beside head_dim
    v_head_dim: int = 0  # a value head (0: head_dim)

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise UsageError(f"transformer shape: {name} must be >= 1")
        if self.d_model % self.heads and not self.head_dim:
            raise UsageError(f"transformer shape: d_model {self.d_model} must divide by "
                             f"heads {self.heads}")  # fmt: skip
        if self.kv_heads and (self.kv_heads < 0 or self.heads % self.kv_heads):
            raise UsageError(f"transformer shape: heads {self.heads} must divide by kv_heads "
                             f"{self.kv_heads} (each key-value head serves a group of "
                             "query heads)")  # fmt: skip
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise UsageError(f"transformer shape: top_k must be in 1..experts ({self.experts})")
        if self.shared_experts and not self.experts:
            raise UsageError("transformer shape: shared_experts needs experts (routed ones)")
        if (self.dense_layers or self.dense_ffn) and not self.experts:
            raise UsageError("transformer shape: dense_layers and dense_ffn need experts")
        if self.dense_layers >= self.layers:
            raise UsageError(f"transformer shape: dense_layers must be below layers "
                             f"({self.layers})")  # fmt: skip
        if (self.q_lora or self.rope_dim or self.v_head_dim) and not self.kv_lora:
            raise UsageError("transformer shape: q_lora, rope_dim and v_head_dim are latent "
                             "attention's; give kv_lora too")  # fmt: skip

    @property
    def hidden(self) -> int:
        return self.ffn or 4 * self.d_model

    @property
    def d_head(self) -> int:
        return self.head_dim or self.d_model // self.heads

    @property
    def d_q(self) -> int:
        """Width of the queries (and of the attention output): ``heads x head_dim``."""
        return self.heads * self.d_head

    @property
    def d_kv(self) -> int:
        """Width of the keys (and of the values): ``kv_heads x head_dim``."""
        return (self.kv_heads or self.heads) * self.d_head

    @property
    def d_qk(self) -> int:
        """Width of the queries as the scores see them (latent attention adds the rotary
        part of each head)."""
        return self.heads * (self.d_head + self.rope_dim)

    @property
    def d_v(self) -> int:
        """Width of the values as the heads weigh them (and of the attention output)."""
        return self.heads * (self.v_head_dim or self.d_head)

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the experts'."""
        return self.layers - self.dense_layers if self.experts else 0

    def dense_mlp_params(self) -> int:
        """A dense layer's MLP among experts' layers (``dense_ffn`` wide)."""
        return (3 if self.gated else 2) * self.d_model * (self.dense_ffn or self.hidden)

    @property
    def routed(self) -> float:
        """MLP passes per token: with experts, the slots of a sequence over its tokens,
        ``E x min(s, ceil(capacity_factor x s x top_k / E)) / s`` (refdl's per-sequence
        capacity, ``refdl.core.moe.capacity``; about ``top_k x capacity_factor``), else 1."""
        if not self.experts:
            return 1.0
        slots = capacity(self.seq, self.experts, self.top_k, self.capacity_factor)
        return self.experts * slots / self.seq

    @property
    def mlp_passes(self) -> float:
        """MLP passes per token and layer, in MLPs of ``ffn``: the routed ones and every
        shared expert's, averaged with the dense first layers' (of ``dense_ffn``)."""
        if not self.dense_layers:
            return self.routed + self.shared_experts
        dense = self.dense_layers * self.dense_mlp_params() / self.mlp_params()
        return (dense + self.moe_layers * (self.routed + self.shared_experts)) / self.layers

    def mlp_params(self) -> int:
        return (3 if self.gated else 2) * self.d_model * self.hidden

    def attention_params(self) -> int:
        """Q, K, V and the output projection; latent attention's down- and
        up-projections and its latents' norms (DeepSeek-V2, section 2.1)."""
        h = self.d_model
        if not self.kv_lora:
            return 2 * h * (self.d_q + self.d_kv)
        q = h * self.d_qk if not self.q_lora else h * self.q_lora + self.q_lora * (1 + self.d_qk)
        kv = h * (self.kv_lora + self.rope_dim) + self.kv_lora
        kv += self.kv_lora * (self.heads * self.d_head + self.d_v)
        return q + kv + self.d_v * h

    def expert_params(self) -> int:
        """Parameters the expert axis splits: every expert layer's experts."""
        return self.moe_layers * self.experts * self.mlp_params()

    def dense_params(self) -> int:
        """Every other parameter: attention, norms, router, embeddings, the MLPs of a
        dense model or of the dense first layers, shared experts."""
        h = self.d_model
        dense = self.dense_layers if self.experts else self.layers
        mlps = dense * (self.dense_mlp_params() if self.experts else self.mlp_params())
        mlps += self.moe_layers * (self.experts * h + self.shared_experts * self.mlp_params())
        embed = self.vocab * h * (1 if self.tied else 2) + (self.seq * h if self.positions else 0)
        return self.layers * (self.attention_params() + 4 * h) + mlps + embed + 2 * h

    def active_params(self) -> int:
        """Parameters a token passes through: all but the experts it is not routed to."""
        return self.params - self.expert_params() + self.moe_layers * self.top_k * self.mlp_params()

    @property
    def params(self) -> int:
        return self.dense_params() + self.expert_params()

    def layer_forward_flops(self) -> float:
        """One layer's forward on one sequence (the mean over layers where the first are
        dense): products, scores and values, router."""
        s, h = self.seq, self.d_model
        f = 2 * s * self.attention_params() + 2 * s * s * (self.d_qk + self.d_v)
        f += 2 * s * self.mlp_params() * self.mlp_passes
        if self.experts:
            f += 2 * s * h * self.experts * self.moe_layers / self.layers
        return float(f)

    def flops_per_sequence(self, remat: str = "none") -> float:
        """Forward, backward and ``remat``'s recomputation of one sequence (Narayanan's
        eq. 3 with ``remat="full"``: ``96 s l h^2 (1 + s/6h + V/16lh)`` for GPT)."""
        layer = self.layer_forward_flops()
        core = 2.0 * self.seq**2 * (self.d_qk + self.d_v)  # scores and values
        extra = {"none": 0.0, "full": layer, "selective": core}
        if remat not in extra:
            raise UsageError(f"unknown --remat {remat!r}; choose none, selective or full")
        logits = 2.0 * self.seq * self.d_model * self.vocab
        return 3 * (self.layers * layer + logits) + self.layers * extra[remat]

    def layer_activation_bytes(
        self, batch: float, tp: int = 1, cp: int = 1, sp: bool = False,
        remat: str = "none", precision: str = "bf16", fused: bool = True,
    ) -> float:  # fmt: skip
        """Bytes one layer keeps for its backward, for ``batch`` sequences of ``seq / cp``
        tokens on one device of a ``tp``-way tensor-parallel group (Korthikanti et al.
        2022, table 2): of ``34 s b h`` (16-bit), 24 are split by tensor parallelism and
        the other 10 (norm inputs, dropout masks) only by sequence parallelism; ``5 a s^2
        b`` of scores only where attention is not ``fused`` (a fused kernel, flash
        attention, keeps none; neither does selective recomputation nor context
        parallelism's blockwise attention); an MLP's 19 per pass (routed and shared)."""
        s, h = self.seq / cp, self.d_model
        sbh = s * batch * h
        if remat == "full":
            return 2 * sbh / (tp if sp else 1) * ACT_BYTES[precision] / 2
        split = 8 + 16 * self.mlp_passes  # of the MLP's 19: 16 split by tp, 3 not
        whole = 3 + 3 * self.mlp_passes + 4
        per = split / tp + whole / (tp if sp else 1)
        scores = 0.0
        if remat == "none" and cp == 1 and not fused:
            scores = 5 * self.heads * s / h / tp
        return sbh * (per + scores) * ACT_BYTES[precision] / 2


def stage_layers(layers: int, pipe: int, boundaries: tuple[int, ...] | None = None) -> list[int]:
    """The layers of each of ``pipe`` stages: cut at ``boundaries`` (the layers where the
    second stage on begin, as ``refdl train --stage-boundaries``), else equal where
    ``pipe`` divides ``layers``, else a layer fewer on the stages at the ends, first and
    last first (as Llama 3's 126 layers on 16 stages: the first and last stages also
    hold the embedding and the output layer).

    >>> stage_layers(126, 16)
    [7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]
    >>> stage_layers(8, 2, (3,))
    [3, 5]
    """
    if boundaries:
        edges = [0, *boundaries, layers]
        sizes = [b - a for a, b in itertools.pairwise(edges)]
        if len(boundaries) != pipe - 1 or min(sizes) < 1:
            raise UsageError(f"--stage-boundaries must be {pipe - 1} increasing layer indices "
                             f"in 1..{layers - 1} for {pipe} stages (got "
                             f"{','.join(map(str, boundaries))})")  # fmt: skip
        return sizes
    if layers < pipe:
        raise UsageError(f"{layers} layers cannot fill pipe={pipe} stages")
    base = -(-layers // pipe)
    sizes = [base] * pipe
    ends = [i for pair in zip(range(pipe), range(pipe - 1, -1, -1), strict=True) for i in pair]
    for i in list(dict.fromkeys(ends))[: base * pipe - layers]:
        sizes[i] -= 1
    return sizes


def axis_links(mesh: MeshSpec, hw: Any, link_of: Any) -> dict[str, Link]:
    """Each axis's link: the node's while the devices from the innermost axis (in
    ``NODE_ORDER``) up to this one fit in a node, else the network's."""
    span, out = 1, {}
    for axis in NODE_ORDER:
        span *= getattr(mesh, axis)
        out[axis] = link_of(span)
    return out


@dataclasses.dataclass(frozen=True)
class Nodes:
    """A machine's nodes as a group spanning them sees them: ``per_node`` devices joined
    by ``intra``, nodes by ``inter`` through ``nics`` NICs each (``refdl.hw``'s
    ``devices_per_node`` and ``nics_per_node``)."""

    per_node: int
    intra: Link
    inter: Link
    nics: int = 1


def members_per_node(mesh: MeshSpec, axes: tuple[str, ...], per_node: int) -> int:
    """How many devices of one group over ``axes`` share a node, a node holding
    ``per_node`` consecutive devices in ``NODE_ORDER`` (the innermost axes fill it first).

    >>> members_per_node(MeshSpec(data=32, pipe=2), ("data",), 8)
    8
    >>> members_per_node(MeshSpec(data=8, model=8), ("data",), 8)
    1
    """
    count, span = 1, 1
    for axis in NODE_ORDER:
        room = per_node // span
        if room <= 1:
            break
        take = min(getattr(mesh, axis), room)
        if axis in axes:
            count *= take
        span *= take
    return count


@dataclasses.dataclass(frozen=True)
class AxisComm:
    """One axis's collectives in one step on one device: the time on the link, the part
    of it no computation hides, and the bytes the device sends."""

    time_s: float
    exposed_s: float
    bytes: float


def axis_comm(
    shape: TransformerShape,
    mesh: MeshSpec,
    batch: float,
    links: dict[str, Link],
    *,
    microbatches: int = 1,
    chunks: int = 1,
    cp: str = "ring",
    sp: bool = False,
    remat: str = "none",
    precision: str = "bf16",
    flop_rate: float = 0.0,
    grad_reduce: str = "fp32",
    nodes: Nodes | None = None,
) -> dict[str, AxisComm]:
    """The collectives of each axis > 1 for one step of ``batch`` sequences.

    With ``r`` forward passes (2: forward and backward; 3 with full recomputation), a
    microbatch of ``b`` sequences and ``n = b s / cp x h x bytes`` per device:

    - model: ``2r`` all-reduces of ``n`` per layer (Megatron's two per block each way;
      with sequence parallelism each is a reduce-scatter and an all-gather, the same ring
      time; Korthikanti et al. 2022, section 4.2.2);
    - context, ring: per layer ``cp - 1`` hops of the local keys and values (``2n
      d_kv / h / tp``) forward, twice that backward (values and their gradients);
      each hop overlaps the attention of the block it brings (half a block with
      zig-zag order), so only ``max(0, hop - block)`` is exposed;
    - context, all-to-all (Ulysses): per layer four all-to-alls (q, k, v, output) each
      way, of ``n / tp`` (k and v ``d_kv / h`` of that);
    - expert: per layer dispatch and combine each way, ``n x top_k x capacity_factor``
      (over ``tp`` with sequence parallelism, else each tensor rank sends its copy);
    - pipe: an activation forward and a gradient backward per microbatch and chunk, of
      ``n / tp`` (Megatron's scatter/gather: each tensor rank sends its share);
    - data (with context and expert, which hold replicas too) and fsdp: the fp32
      gradients of the device's share of the parameters, a ring all-reduce; fsdp
      without pipe gathers the parameters twice (forward, backward) in the compute
      precision and reduce-scatters the fp32 gradient for every microbatch (FSDP2's
      default ``reshard_after_forward=True`` under torchtitan's accumulation loop,
      DeepSpeed's ZeRO-3, ``refdl train --strategy fsdp --zero 3``); with pipe it
      gathers once a step and reduce-scatters at the last backward (torchtitan keeps
      a stage's parameters gathered under pipelining, ``reshard_after_forward = not
      pp_enabled``, and ``torch.distributed.pipelining`` turns gradient sync off until
      the last backward; ``fsdp_gathered_bytes`` holds the price in memory).
      ``grad_reduce="compute"`` reduces the gradients in the compute precision
      instead (Megatron-Core's default, ``grad_reduce_in_fp32=False``; Megatron-LM's
      fp16 runs of 2021).

    ``flop_rate`` (FLOP/s) times the ring's block overlap; every other collective is
    returned exposed (the caller's ``overlap`` may hide a share behind the compute).
    Given ``nodes``, the data axis's gradient all-reduce, where its group spans nodes
    with several members in each, runs in two levels, as NCCL's rings do on nodes of
    several NICs (``allreduce_hierarchical``, as ``refdl predict collective`` and the
    data strategy price it): the node's link inside it, across nodes each device's
    share of its node's NICs (every device of a node reduces at once); a group with one
    member a node runs one ring across nodes at that share; a group inside a node one
    ring on the axis's link. The fsdp axis's gathers and reduce-scatters run in the
    same two levels (``allgather_hierarchical``), the bytes as one collective a pass,
    and each layer's own collectives (FSDP's unit is a block) adding their latency.
    DeepSpeed's ZeRO-3 of 2021 ran below this rate (Narayanan et al.'s Table 2 rows are
    predicted 13-64 % fast); FSDP2's Automodel row holds it."""
    h, s = shape.d_model, shape.seq
    tp, c, ep, pp = mesh.model, mesh.context, mesh.expert, mesh.pipe
    replicas = mesh.data * mesh.fsdp * ep
    b = batch / replicas / microbatches
    passes = 3 if remat == "full" else 2
    layers = shape.layers / pp
    n = b * s / c * h * ACT_BYTES[precision]  # one microbatch's activations on a device
    slots = layers * microbatches
    out: dict[str, AxisComm] = {}
    if tp > 1:
        t = 2 * passes * slots * allreduce_ring(n, tp, links["model"])
        out["model"] = AxisComm(t, t, 2 * passes * slots * 2 * n * (tp - 1) / tp)
    if c > 1:
        kv = n * shape.d_kv / h / tp
        q = n * shape.d_q / h / tp
        if cp == "ring":
            hop = 2 * kv  # keys and values
            lk = links["context"]
            block = 0.5 * 4 * b * (s / c) ** 2 * shape.d_q / tp / flop_rate if flop_rate else 0.0
            hops = (c - 1) * slots
            msgs = hops * (passes - 1 + 2)  # forward(s): K,V; backward: K,V and dK,dV
            t = msgs * (lk.alpha + hop * lk.beta)
            fwd = max(0.0, lk.alpha + hop * lk.beta - block)
            bwd = max(0.0, 2 * (lk.alpha + hop * lk.beta) - 2 * block)
            hidden_fwd = (passes - 1) * fwd
            out["context"] = AxisComm(t, hops * (hidden_fwd + bwd), msgs * hop)
        elif cp == "all-to-all":
            per = 2 * q + 2 * kv  # q and output; k and v
            a2a = sum(alltoall_pairwise(x, c, links["context"]) for x in (q, q, kv, kv))
            t = passes * slots * a2a
            out["context"] = AxisComm(t, t, passes * slots * per * (c - 1) / c)
        else:
            raise UsageError(f"unknown --cp {cp!r}; choose ring or all-to-all")
    if ep > 1:
        tokens = n * shape.routed / (tp if sp else 1)
        t = 2 * passes * slots * alltoall_pairwise(tokens, ep, links["expert"])
        out["expert"] = AxisComm(t, t, 2 * passes * slots * tokens * (ep - 1) / ep)
    if pp > 1:
        msg = n / tp  # each tensor rank sends its 1/tp (Narayanan et al. 2021, section 4.1)
        lk = links["pipe"]
        count = 2 * microbatches * chunks
        t = count * (lk.alpha + msg * lk.beta)
        out["pipe"] = AxisComm(t, t, count * msg)
    if grad_reduce not in GRAD_REDUCE:
        raise UsageError(f"--grad-reduce must be fp32 or compute (got {grad_reduce!r})")
    word = grad_word(grad_reduce, precision)
    grads_dense = word * shape.dense_params() / (tp * pp * mesh.fsdp)
    grads_expert = word * shape.expert_params() / (tp * pp * ep * mesh.fsdp)
    group = mesh.data * c

    def two_levels(n: float, p: int, axes: tuple[str, ...], ring, hierarchical) -> float:
        g = members_per_node(mesh, axes, nodes.per_node) if nodes else 1
        if not nodes or g >= p:  # no two levels known, or the group fits in a node
            return ring(n, p, links[axes[0]])
        # every device of a node reduces at once (the other groups are its siblings over
        # the other axes): a device's share of the node's NICs is min(nics, per_node) /
        # per_node, whatever its group's g (the hierarchical forms share among g)
        share = nodes.per_node / max(1, min(nodes.nics, nodes.per_node))
        inter = dataclasses.replace(nodes.inter, beta=nodes.inter.beta * share)
        if g == 1:  # one member a node: one ring across nodes
            return ring(n, p, inter)
        inter = dataclasses.replace(inter, beta=inter.beta * min(nodes.nics, g) / g)
        return hierarchical(n, p, g, nodes.intra, inter, nodes.nics)

    def reduce(n: float, p: int, axes: tuple[str, ...]) -> float:
        return two_levels(n, p, axes, allreduce_ring, allreduce_hierarchical)

    if group * ep > 1:
        t = reduce(grads_dense, group * ep, ("data", "context", "expert"))
        t += reduce(grads_expert, group, ("data", "context")) if grads_expert else 0.0
        sent = 2 * grads_dense * (group * ep - 1) / (group * ep)
        sent += 2 * grads_expert * (group - 1) / group if group > 1 else 0.0
        out["data"] = AxisComm(t, t, sent)
    if mesh.fsdp > 1:
        whole = stage_params(shape, mesh)  # the parameters an fsdp group gathers
        gathers, rounds = (1, 1) if pp > 1 else (2, microbatches)
        words = gathers * ACT_BYTES[precision] + word  # gathers in the compute precision, grads
        t = rounds * two_levels(words * whole, mesh.fsdp, ("fsdp",), allgather_ring,
                                allgather_hierarchical)  # fmt: skip
        # one collective a unit and pass: each layer is its own unit (FSDP2's fully_shard
        # of a block, ZeRO-3's module), the embedding and output one more; the bytes are
        # priced above as one, so each further collective adds its latency only
        units = math.ceil(shape.layers / pp) + 1
        one = two_levels(0.0, mesh.fsdp, ("fsdp",), allgather_ring, allgather_hierarchical)
        t += rounds * ((gathers + 1) * units - 1) * one
        out["fsdp"] = AxisComm(t, t, rounds * words * whole * (mesh.fsdp - 1) / mesh.fsdp)
    return out


def state_bytes(
    shape: TransformerShape, mesh: MeshSpec, words: int, zero: int = 0, precision: str = "fp32"
) -> float:
    """Weights, gradients and optimizer words on one device: the dense parameters split
    over ``model x pipe``, the experts also over ``expert``, all of it over ``fsdp``;
    ``STATE_BYTES`` per parameter plus 4 per optimizer word. ZeRO over ``data``
    (Rajbhandari et al. 2020): stage 1 splits the optimizer words (and, in mixed
    precision, the fp32 master copy) over it, stage 2 the gradients too."""
    w = ACT_BYTES.get(precision, 4)  # weights and gradients: compute precision, fp32 master
    master = 0 if w == 4 else 4
    weights, grads, optimizer = w, w, master + 4 * words  # w + w + master = STATE_BYTES
    d = mesh.data if zero else 1
    per = weights + (grads / d if zero >= 2 else grads) + optimizer / d
    return per * stage_params(shape, mesh) / mesh.fsdp


def grad_word(grad_reduce: str, precision: str) -> float:
    """Bytes of a gradient as the data and fsdp axes reduce it: fp32, or the compute
    precision (``grad_reduce="compute"``)."""
    return 4.0 if grad_reduce == "fp32" else float(ACT_BYTES.get(precision, 4))


def stage_params(shape: TransformerShape, mesh: MeshSpec) -> float:
    """The parameters of one device's share before fsdp shards it: the dense ones over
    ``model x pipe``, the experts also over ``expert`` (what an fsdp group gathers)."""
    split = mesh.model * mesh.pipe
    return shape.dense_params() / split + shape.expert_params() / (split * mesh.expert)


def fsdp_gathered_bytes(
    shape: TransformerShape, mesh: MeshSpec, precision: str, grad_reduce: str = "fp32"
) -> float:
    """What an fsdp axis holds unsharded on a device beside its shards: with pipe, the
    stage's parameters in the compute precision and their gradients accumulated in the
    reduction's precision, kept over the step's microbatches (torchtitan under
    pipelining: ``reshard_after_forward=False``; FSDP2 accumulates unsharded gradients
    in ``reduce_dtype``); without pipe, two mean layers' parameters (the one computing
    and the one prefetched; an embedding unit larger than a layer, and the unsharded
    gradient a reduce-scatter holds, are left out)."""
    if mesh.fsdp == 1:
        return 0.0
    act = float(ACT_BYTES.get(precision, 4))
    stage = stage_params(shape, mesh)
    if mesh.pipe > 1:
        return stage * (act + grad_word(grad_reduce, precision))
    return 2 * act * stage / shape.layers


def activation_bytes(
    shape: TransformerShape, mesh: MeshSpec, batch: float, microbatches: int, stash: int,
    sp: bool, remat: str, precision: str, fused: bool = True, busiest: float | None = None,
) -> float:  # fmt: skip
    """Activations the busiest stage holds: ``stash`` microbatches of its ``busiest``
    layers (default ``layers / pipe``), plus one microbatch's fp32 logits split over
    ``model`` (the last stage's)."""
    b = batch / mesh.replicas / microbatches
    per_layer = shape.layer_activation_bytes(b, mesh.model, mesh.context, sp, remat, precision,
                                             fused)  # fmt: skip
    logits = 4.0 * b * shape.seq / mesh.context * shape.vocab / mesh.model
    return stash * per_layer * (busiest or shape.layers / mesh.pipe) + logits


def check_mesh(shape: TransformerShape, mesh: MeshSpec, cp: str) -> None:
    """The splits the shape must allow: heads over ``model`` (and ``context`` for
    all-to-all), tokens over ``context``, experts over ``expert``, layers over ``pipe``."""
    if mesh.expert > 1 and not shape.experts:
        raise UsageError("--mesh expert=.. needs a model with experts (a mixture-of-experts "
                         "shape); set expert=1")  # fmt: skip
    if shape.experts and shape.experts % mesh.expert:
        raise UsageError(f"{shape.experts} experts do not split over expert={mesh.expert}")
    if shape.seq % mesh.context:
        raise UsageError(f"sequence {shape.seq} does not split over context={mesh.context}")
    if shape.heads % (mesh.model * (mesh.context if cp == "all-to-all" else 1)):
        raise UsageError(f"{shape.heads} heads do not split over model={mesh.model}"
                         + (f" x context={mesh.context} (all-to-all)" if cp == "all-to-all"
                            else ""))  # fmt: skip
    if shape.layers < mesh.pipe:
        raise UsageError(f"{shape.layers} layers cannot fill pipe={mesh.pipe} stages")


def remat_factor(shape: TransformerShape, remat: str) -> float:
    """Step FLOPs with ``remat`` over those without."""
    return shape.flops_per_sequence(remat) / shape.flops_per_sequence("none")


def model_flops(shape: TransformerShape, sequences: float, counted: str = "model") -> float:
    """A step's FLOPs as a publication counts them: ``model`` (no recomputation, MFU's),
    ``hardware`` with full recomputation (Narayanan et al.'s 96 s l h^2 formula)."""
    remat = {"model": "none", "hardware": "full"}.get(counted)
    if remat is None:
        raise ValueError(f"unknown FLOPs convention {counted!r}")
    return sequences * shape.flops_per_sequence(remat)
