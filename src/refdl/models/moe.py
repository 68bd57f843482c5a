"""The Transformer language model with mixture-of-experts feed-forward layers."""

from __future__ import annotations

from refdl.config.values import Float, Int, Option
from refdl.core.layers import Sequential
from refdl.core.moe import MoEFeedForward
from refdl.errors import UsageError
from refdl.models.base import ModelDef, register
from refdl.models.transformer import SHAPE_OPTIONS, TRANSFORMER, decoder


def build(
    info,
    d_model: int = 128,
    heads: int = 4,
    layers: int = 2,
    mlp_dim: int = 256,
    experts: int = 8,
    top_k: int = 2,
    capacity_factor: float = 1.25,
    aux_weight: float = 0.01,
) -> Sequential:
    """``transformer`` whose blocks' MLPs are ``experts`` MLPs of width ``mlp_dim``, each
    token through its ``top_k`` (``refdl.core.moe``)."""
    if top_k > experts:
        raise UsageError(f"moe: top_k={top_k} must be at most experts={experts}")
    ffn = dict(experts=experts, top_k=top_k, capacity_factor=capacity_factor,
               mlp_dim=mlp_dim, aux_weight=aux_weight)  # fmt: skip
    return decoder(info, d_model, heads, layers, mlp_dim, lambda: MoEFeedForward(**ffn))


MOE = register(
    ModelDef(
        name="moe",
        build=build,
        data_kind="tokens",
        options={
            **SHAPE_OPTIONS,
            "mlp_dim": Option(256, Int(1, 1 << 18), "each expert's MLP width"),
            "experts": Option(8, Int(1, 1 << 12), "experts per layer"),
            "top_k": Option(2, Int(1, 64), "experts per token"),
            "capacity_factor": Option(
                1.25, Float(0.01, 1e4), "slots per expert = factor x tokens x top_k / experts"
            ),
            "aux_weight": Option(0.01, Float(0.0, 1e3), "load-balancing loss weight"),
        },
        defaults=dict(TRANSFORMER.defaults),
        doc="Transformer LM with mixture-of-experts MLPs (top-k, capacity)",
        # XLA:CPU's all-reduce-promotion aborts the compiler (Check failure: "Invalid
        # binary instruction opcode copy") on a bf16 step of data x expert; without it the
        # bf16 all-reduces are summed in bf16 (found by scripts/bench_parity.py, 2026-11-26)
        cpu_compiler_options=(
            *TRANSFORMER.cpu_compiler_options,
            ("xla_disable_hlo_passes", "all-reduce-promotion"),
        ),
        splits_sequence=True,
    )
)
