"""Shape-only models: paper-scale architectures for prediction, never trained.

Nothing here allocates weights: parameters and layer outputs come from
``jax.eval_shape``. The architectures follow their papers (input sizes and
widths as published):

- AlexNet (Krizhevsky et al. 2012, one tower: no grouped convolutions), 227x227x3, and
  the two variants published benchmarks ran: tf_cnn_benchmarks' (64/192 filters first)
  and BVLC's Caffe model (two groups) at 224x224x3;
- VGG-16 / VGG-19 (Simonyan & Zisserman 2015, configurations D / E), 224x224x3;
- GoogLeNet (Szegedy et al. 2015, Inception v1 without the auxiliary heads), 224x224x3;
- Inception V3 (Szegedy et al. 2016, without the auxiliary head), 299x299x3;
- ResNet-50 / ResNet-101 (He et al. 2016, bottleneck blocks; v1.5, the stride in the 3x3,
  and v1, the paper's, as tf_cnn_benchmarks runs them), 224x224x3;
- LeNet-5 (LeCun et al. 1998), 32x32x1;
- LSTM LM (Zaremba et al. 2014 "medium": 2 x 650, vocab 10k, 35 steps);
- GPT-2 small (Radford et al. 2019: 12 x 768, 12 heads, 1024 tokens, vocab 50257).

GPT-scale transformers are too large to lower here and are given by their shape
alone (``TRANSFORMERS``, costed in closed form by ``refdl.perf.transformer``):

- GPT-3 175B (Brown et al. 2020, table 2.1: 96 x 12288, 96 heads, 2048 tokens).

A user's own architecture joins them with ``register_shape_model`` (a flax module)
or ``register_transformer`` (a shape).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from refdl.perf.transformer import TransformerShape
from refdl.registry import Registry


@dataclasses.dataclass(frozen=True)
class ShapeModel:
    """A paper-scale architecture: a flax module, its per-sample input, and its source."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    input_dtype: Any
    outputs: int
    doc: str


SHAPE_MODELS: Registry[ShapeModel] = Registry("shape-only model")


def register_shape_model(
    name: str, input_shape: tuple[int, ...], outputs: int, doc: str, dtype: Any = jnp.float32
) -> Callable:
    """Decorator: register ``build`` (a function returning a flax module taking a batch of
    ``input_shape`` inputs, ``outputs`` classes or vocabulary) as a shape-only model."""

    def deco(build):
        SHAPE_MODELS.register(name)(ShapeModel(name, build, input_shape, dtype, outputs, doc))
        return build

    return deco


_register = register_shape_model


# ----------------------------------------------------------------- CNNs


def conv(x, f, k, s=1, pad="SAME"):
    k = (k, k) if isinstance(k, int) else k
    return nn.relu(nn.Conv(f, k, strides=(s, s), padding=pad)(x))


def max_pool(x, k=3, s=2, pad="SAME"):
    return nn.max_pool(x, (k, k), (s, s), padding=pad)


class AlexNet(nn.Module):
    """AlexNet's five convolutions and three dense layers: ``widths`` of the first two
    convolutions (the paper's 96 and 256; tf_cnn_benchmarks' 64 and 192), ``groups`` of
    the 2nd, 4th and 5th (2 in the paper's two-tower model as BVLC's Caffe model keeps
    it), the first pooling rounded up as Caffe pools (``ceil``) and ``classes``."""

    widths: tuple[int, int] = (96, 256)
    groups: int = 1
    ceil: bool = False
    classes: int = 1000

    @nn.compact
    def __call__(self, x):
        def gconv(x, f, k, groups):
            return nn.relu(nn.Conv(f, (k, k), padding="SAME", feature_group_count=groups)(x))

        g = self.groups
        x = conv(x, self.widths[0], 11, 4, "VALID")
        x = max_pool(x, 3, 2, ((0, 1), (0, 1)) if self.ceil else "VALID")
        x = max_pool(gconv(x, self.widths[1], 5, g), 3, 2, "VALID")
        x = gconv(gconv(conv(x, 384, 3), 384, 3, g), 256, 3, g)
        x = max_pool(x, 3, 2, "VALID").reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(4096)(x))
        x = nn.relu(nn.Dense(4096)(x))
        return nn.Dense(self.classes)(x)


VGG_CFG = {
    16: (2, 2, 3, 3, 3),
    19: (2, 2, 4, 4, 4),
}


class VGG(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        for reps, width in zip(VGG_CFG[self.depth], (64, 128, 256, 512, 512), strict=True):
            for _ in range(reps):
                x = conv(x, width, 3)
            x = max_pool(x, 2, 2)
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(4096)(x))
        x = nn.relu(nn.Dense(4096)(x))
        return nn.Dense(1000)(x)


class InceptionV1(nn.Module):
    """One GoogLeNet module: 1x1 | 1x1-3x3 | 1x1-5x5 | pool-1x1, concatenated."""

    c1: int
    c3r: int
    c3: int
    c5r: int
    c5: int
    cp: int

    @nn.compact
    def __call__(self, x):
        b1 = conv(x, self.c1, 1)
        b2 = conv(conv(x, self.c3r, 1), self.c3, 3)
        b3 = conv(conv(x, self.c5r, 1), self.c5, 5)
        b4 = conv(max_pool(x, 3, 1), self.cp, 1)
        return jnp.concatenate([b1, b2, b3, b4], -1)


GOOGLENET = (  # (c1, c3r, c3, c5r, c5, pool) per module, "pool" = max pool after
    (64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64), "pool",
    (192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
    (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128), "pool",
    (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128),
)  # fmt: skip


class GoogLeNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = max_pool(conv(x, 64, 7, 2))
        x = max_pool(conv(conv(x, 64, 1), 192, 3))
        for m in GOOGLENET:
            x = max_pool(x) if m == "pool" else InceptionV1(*m)(x)
        x = jnp.mean(x, (1, 2))
        return nn.Dense(1000)(x)


class InceptionV3(nn.Module):
    """Inception V3 (Szegedy et al. 2016, Figure 5-7 modules; torchvision's widths)."""

    @nn.compact
    def __call__(self, x):
        x = conv(x, 32, 3, 2, "VALID")
        x = conv(x, 32, 3, 1, "VALID")
        x = max_pool(conv(x, 64, 3), 3, 2, "VALID")
        x = conv(x, 80, 1)
        x = max_pool(conv(x, 192, 3, 1, "VALID"), 3, 2, "VALID")
        for pool_features in (32, 64, 64):  # 35x35: Figure 5
            b1 = conv(x, 64, 1)
            b5 = conv(conv(x, 48, 1), 64, 5)
            b3 = conv(conv(conv(x, 64, 1), 96, 3), 96, 3)
            bp = conv(nn.avg_pool(x, (3, 3), (1, 1), "SAME"), pool_features, 1)
            x = jnp.concatenate([b1, b5, b3, bp], -1)
        b3 = conv(x, 384, 3, 2, "VALID")  # reduction to 17x17
        bd = conv(conv(conv(x, 64, 1), 96, 3), 96, 3, 2, "VALID")
        x = jnp.concatenate([b3, bd, max_pool(x, 3, 2, "VALID")], -1)
        for c7 in (128, 160, 160, 192):  # 17x17: Figure 6 (n = 7)
            b1 = conv(x, 192, 1)
            b7 = conv(conv(conv(x, c7, 1), c7, (1, 7)), 192, (7, 1))
            bd = conv(x, c7, 1)
            for f, k in ((c7, (7, 1)), (c7, (1, 7)), (c7, (7, 1)), (192, (1, 7))):
                bd = conv(bd, f, k)
            bp = conv(nn.avg_pool(x, (3, 3), (1, 1), "SAME"), 192, 1)
            x = jnp.concatenate([b1, b7, bd, bp], -1)
        b3 = conv(conv(x, 192, 1), 320, 3, 2, "VALID")  # reduction to 8x8
        b7 = conv(conv(conv(conv(x, 192, 1), 192, (1, 7)), 192, (7, 1)), 192, 3, 2, "VALID")
        x = jnp.concatenate([b3, b7, max_pool(x, 3, 2, "VALID")], -1)
        for _ in range(2):  # 8x8: Figure 7
            b1 = conv(x, 320, 1)
            b3 = conv(x, 384, 1)
            b3 = jnp.concatenate([conv(b3, 384, (1, 3)), conv(b3, 384, (3, 1))], -1)
            bd = conv(conv(x, 448, 1), 384, 3)
            bd = jnp.concatenate([conv(bd, 384, (1, 3)), conv(bd, 384, (3, 1))], -1)
            bp = conv(nn.avg_pool(x, (3, 3), (1, 1), "SAME"), 192, 1)
            x = jnp.concatenate([b1, b3, bd, bp], -1)
        return nn.Dense(1000)(jnp.mean(x, (1, 2)))


class Bottleneck(nn.Module):
    """A bottleneck block, its stride in the 3x3 convolution (v1.5: torchvision,
    fb.resnet.torch, DeepLearningExamples) or with ``v1`` in the first 1x1 (the paper's,
    as tf_cnn_benchmarks runs ``resnet50``: the 3x3 at the lower resolution)."""

    width: int
    stride: int
    v1: bool = False

    @nn.compact
    def __call__(self, x):
        bn = functools.partial(nn.BatchNorm, use_running_average=False)
        cv = functools.partial(nn.Conv, use_bias=False)
        first, second = ((self.stride,) * 2, (1, 1)) if self.v1 else ((1, 1), (self.stride,) * 2)
        y = nn.relu(bn()(cv(self.width, (1, 1), first)(x)))
        y = nn.relu(bn()(cv(self.width, (3, 3), second)(y)))
        y = bn()(cv(4 * self.width, (1, 1))(y))
        if x.shape[-1] != 4 * self.width or self.stride != 1:
            x = cv(4 * self.width, (1, 1), (self.stride, self.stride))(x)
            x = nn.BatchNorm(use_running_average=False)(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    blocks: tuple[int, ...]
    v1: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (7, 7), (2, 2), use_bias=False)(x)
        x = max_pool(nn.relu(nn.BatchNorm(use_running_average=False)(x)))
        for stage, n in enumerate(self.blocks):
            for i in range(n):
                x = Bottleneck(64 * 2**stage, 2 if i == 0 and stage > 0 else 1, self.v1)(x)
        return nn.Dense(1000)(jnp.mean(x, (1, 2)))


class LeNet5(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.tanh(nn.Conv(6, (5, 5), padding="VALID")(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.tanh(nn.Conv(16, (5, 5), padding="VALID")(x)), (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.tanh(nn.Dense(120)(x))
        x = nn.tanh(nn.Dense(84)(x))
        return nn.Dense(10)(x)


# ----------------------------------------------------------------- sequence models


class LSTMLM(nn.Module):
    vocab: int = 10000
    hidden: int = 650
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.hidden)(tokens)
        for _ in range(self.layers):
            x = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(x)
        return nn.Dense(self.vocab)(x)


class GPT2Block(nn.Module):
    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(self.heads, qkv_features=self.d)(h, h, mask=mask)
        h = nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(x))))
        return x + h


class GPT2(nn.Module):
    vocab: int = 50257
    ctx: int = 1024
    d: int = 768
    layers: int = 12
    heads: int = 12

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.d)
        pos = self.param("pos", nn.initializers.normal(0.01), (self.ctx, self.d))
        x = embed(tokens) + pos[: tokens.shape[1]]
        for _ in range(self.layers):
            x = GPT2Block(self.d, self.heads)(x)
        return embed.attend(nn.LayerNorm()(x))  # tied output embedding


_register("alexnet", (227, 227, 3), 1000, "AlexNet (one tower), 227x227x3, 62.4 M")(AlexNet)
# The AlexNets benchmarks ran, each by its own code: tf_cnn_benchmarks' (tensorflow/
# benchmarks fd87986 scripts/tf_cnn_benchmarks/alexnet_model.py: conv 64 11x11/4 VALID,
# 192 5x5, 384, 384, 256; 227 input; 1001 classes) and BVLC's Caffe model (groups of 2,
# pooling rounded up) at the 224x224 jcjohnson/cnn-benchmarks fed it.
_register("alexnet_tf", (227, 227, 3), 1001, "tf_cnn_benchmarks' AlexNet, 64/192 filters, 61.8 M")(
    lambda: AlexNet(widths=(64, 192), classes=1001)
)
_register("alexnet_bvlc", (224, 224, 3), 1000, "BVLC AlexNet (2 groups), 224x224x3, 61.0 M")(
    lambda: AlexNet(groups=2, ceil=True)
)
_register("vgg16", (224, 224, 3), 1000, "VGG-16, 224x224x3, 138 M")(lambda: VGG(16))
_register("vgg19", (224, 224, 3), 1000, "VGG-19, 224x224x3, 144 M")(lambda: VGG(19))
_register("googlenet", (224, 224, 3), 1000, "GoogLeNet (Inception v1), 224x224x3")(GoogLeNet)
_register("inception_v3", (299, 299, 3), 1000, "Inception V3, 299x299x3, 24 M")(InceptionV3)
_register("resnet50", (224, 224, 3), 1000, "ResNet-50, 224x224x3, 25.6 M")(
    lambda: ResNet((3, 4, 6, 3))
)
_register("resnet101", (224, 224, 3), 1000, "ResNet-101, 224x224x3, 44.5 M")(
    lambda: ResNet((3, 4, 23, 3))
)
# ResNet v1 as tf_cnn_benchmarks runs resnet50/resnet101 (tensorflow/benchmarks 9165a70,
# 2017-05-04, through today: models/resnet_model.py bottleneck_block_v1).
_register("resnet50_v1", (224, 224, 3), 1000, "ResNet-50 v1 (stride in the 1x1), 25.6 M")(
    lambda: ResNet((3, 4, 6, 3), v1=True)
)
_register("resnet101_v1", (224, 224, 3), 1000, "ResNet-101 v1 (stride in the 1x1), 44.5 M")(
    lambda: ResNet((3, 4, 23, 3), v1=True)
)
_register("lenet5_1998", (32, 32, 1), 10, "LeNet-5 (1998), 32x32x1, 62 k")(LeNet5)
_register("lstm_lm_medium", (35,), 10000, "LSTM LM 2x650, vocab 10k, 35 steps", jnp.int32)(LSTMLM)
_register("gpt2", (1024,), 50257, "GPT-2 small, 12x768, 1024 tokens", jnp.int32)(GPT2)


@dataclasses.dataclass(frozen=True)
class ShapeTransformer:
    """A transformer known by its shape alone, and where the shape comes from."""

    name: str
    shape: TransformerShape
    doc: str


TRANSFORMERS: Registry[ShapeTransformer] = Registry("transformer shape")


def register_transformer(name: str, shape: TransformerShape, doc: str) -> ShapeTransformer:
    """Register ``shape`` as ``name`` for ``refdl predict --model``."""
    entry = ShapeTransformer(name, shape, doc)
    TRANSFORMERS.register(name)(entry)
    return entry


GPT3 = dict(seq=2048, vocab=50257)  # Brown et al. 2020: n_ctx 2048, GPT-2's BPE vocabulary
register_transformer("gpt2", TransformerShape(12, 768, 12, 1024, 50257),
                     "GPT-2 small's shape (the flax gpt2 above)")  # fmt: skip
# The GPT-3 family: Brown et al. 2020 (arXiv 2005.14165) Table 2.1 (layers, d_model, heads),
# section 2.1 ("a context window of n_ctx = 2048 tokens"), GPT-2's vocabulary of 50,257
# (Radford et al. 2019, section 2.3); learned positions and a tied output embedding
# (openai/gpt-2 src/model.py @ 9b63575e). Two cells of the table are misprinted: the 13B
# model's d_model is 5120, not 5140 (40 heads x 128; Table D.1's 12,850M parameters), and
# XL's 24 heads of 128 do not make 2048 (EleutherAI gpt-neox configs/XL.yml and Megatron-
# DeepSpeed use 16). The parameter counts are checked against Table D.1 in the tests.
GPT3_FAMILY = {
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 16),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "175b": (96, 12288, 96),
}
for _size, (_l, _h, _a) in GPT3_FAMILY.items():
    register_transformer(f"gpt3-{_size}", TransformerShape(_l, _h, _a, **GPT3),
                         f"GPT-3 {_size.upper()}, {_l}x{_h}, {_a} heads, 2048 tokens "
                         "(Brown et al. 2020, Table 2.1)")  # fmt: skip
# Llama 3 (Grattafiori et al. 2024, arXiv 2407.21783, Table 3; meta-llama/llama3 @ a0940f9c
# model.py and the checkpoints' config.json): SwiGLU, grouped-query attention with 8 key/value
# heads of 128, RoPE (no position parameters), untied embeddings, 128,256 tokens (the paper's
# 128,000 plus 256 reserved special ones), 8,192 tokens of context; 8.03 B and 70.6 B.
LLAMA3 = dict(kv_heads=8, gated=True, tied=False, positions=False, vocab=128256, seq=8192)
register_transformer("llama3-8b", TransformerShape(32, 4096, 32, ffn=14336, **LLAMA3),
                     "Llama 3 8B, 32x4096, 32 heads (8 kv), SwiGLU 14336, 8192 tokens")  # fmt: skip
register_transformer("llama3-70b", TransformerShape(80, 8192, 64, ffn=28672, **LLAMA3),
                     "Llama 3 70B, 80x8192, 64 heads (8 kv), SwiGLU 28672, 8192 tok.")  # fmt: skip


@functools.lru_cache(maxsize=64)
def shape_param_count(name: str) -> int:
    """Parameters of a shape-only model (``jax.eval_shape`` of its initialiser: instant)."""
    m = SHAPE_MODELS.get(name)
    x = jax.ShapeDtypeStruct((1, *m.input_shape), m.input_dtype)
    v = jax.eval_shape(m.build().init, jax.random.key(0), x)
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(v["params"])))
