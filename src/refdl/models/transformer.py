"""A small decoder-only Transformer language model (GPT-style, pre-LayerNorm)."""

from __future__ import annotations

from collections.abc import Callable

from refdl.config.values import Int, Option
from refdl.core.layers import (
    Dense,
    Embed,
    LayerNorm,
    PositionalEmbed,
    Sequential,
    TransformerBlock,
)
from refdl.errors import UsageError
from refdl.models.base import ModelDef, register

_YNN_WITHOUT_REDUCE = ",".join(
    f"LIBRARY_FUSION_TYPE_{t}" for t in ("DOT", "INDIVIDUAL_DOT", "INDIVIDUAL_CONVOLUTION")
)


def build(
    info, d_model: int = 128, heads: int = 4, layers: int = 2, mlp_dim: int = 512
) -> Sequential:
    """``Embed + positions -> blocks -> LayerNorm -> Dense(vocab)``; causal attention."""
    return decoder(info, d_model, heads, layers, mlp_dim)


def decoder(
    info, d_model: int, heads: int, layers: int, mlp_dim: int, ffn: Callable | None = None
) -> Sequential:
    """The decoder stack; ``ffn()`` makes each block's feed-forward module (the MLP when
    None)."""
    if d_model % heads:
        raise UsageError(f"d_model={d_model} must be divisible by heads={heads}")
    seq = [Embed(info.num_classes, d_model), PositionalEmbed(info.input_shape[0])]
    seq += [TransformerBlock(heads, mlp_dim, ffn=ffn() if ffn else None) for _ in range(layers)]
    seq += [LayerNorm(), Dense(info.num_classes, "embed", "vocab")]
    return Sequential(tuple(seq))


SHAPE_OPTIONS = {  # the decoder's; moe shares them
    "d_model": Option(128, Int(1, 1 << 16), "model width"),
    "heads": Option(4, Int(1, 1024), "attention heads (divide d_model)"),
    "layers": Option(2, Int(1, 256), "decoder blocks"),
}


TRANSFORMER = register(
    ModelDef(
        name="transformer",
        build=build,
        data_kind="tokens",
        options={**SHAPE_OPTIONS, "mlp_dim": Option(512, Int(1, 1 << 18), "MLP width")},
        defaults={"optimizer": "adam", "lr": 0.003, "dataset": "pytext"},
        doc="small decoder-only Transformer LM",
        # YNNPACK's reduction fusions cost this model 20-27 % of its CPU step (softmax,
        # LayerNorm and GELU between products); they help ResNet's, so only here (docs/speed.md).
        cpu_compiler_options=(("xla_cpu_experimental_ynn_fusion_type", _YNN_WITHOUT_REDUCE),),
        splits_sequence=True,
    )
)
