"""PyTorch twins of refdl models, layer by layer, with refdl's weights copied in exactly.

``ModelPlan.of(model, sample_x)`` records each layer and its input shape;
``ModelPlan.build(flat_params)`` builds a ``torch.nn.Module`` from a refdl
``Sequential`` (``mlp``, ``lenet5``, ``resnet``, ``lstm_lm``, ``transformer``):

- the input stays refdl's NHWC; the first block permutes it to PyTorch's NCHW,
  and ``Flatten`` permutes back before flattening, so Dense kernels keep rows;
- Dense ``(in, out)`` -> ``Linear.weight (out, in)``; Conv kernels HWIO -> OIHW;
  SAME padding is computed per call as XLA does (the extra pixel goes high);
- LSTM ``w_ih (D, 4H)``, ``w_hh (H, 4H)`` -> ``weight_ih/weight_hh (4H, .)`` with
  the same gate order (i, f, g, o); refdl has one bias, so ``bias_hh`` stays zero
  and frozen (two trained biases would take the same gradient twice);
- Transformer blocks: ``wq/wk/wv (d, heads, head_dim)`` -> bias-free
  ``Linear.weight (heads * head_dim, d)``, ``wo`` likewise; causal
  ``scaled_dot_product_attention``; GELU is the tanh approximation (jax.nn.gelu's);
- BatchNorm ``scale/bias`` -> ``weight/bias``; flax's momentum 0.9 is PyTorch's
  0.1. PyTorch updates ``running_var`` with the unbiased batch variance and flax
  with the biased one, so running statistics are not compared (parameters are).

No JAX is imported at module level, so spawned PyTorch workers start fast.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from refdl.errors import UsageError

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # pragma: no cover - exercised where torch is absent
    torch = None  # type: ignore[assignment]

NATIVE_DDP_REFUSED = (
    "torch.nn.SyncBatchNorm runs only on GPUs, and DDP with per-rank BatchNorm is not "
    "refdl's data parallelism; drop --torch-batchnorm native for --strategy data"
)
INSTALL_HINT = "install it with: .venv/bin/pip install torch==2.13.0 (scripts/setup.sh does)"
Flat = dict[str, np.ndarray]


def available() -> bool:
    """Whether PyTorch can be imported."""
    return torch is not None


def require() -> None:
    """Raise a one-line UsageError when PyTorch is missing."""
    if torch is None:
        raise UsageError(f"the torch adapter needs PyTorch; {INSTALL_HINT}")


def flatten(tree: Any, prefix: str = "") -> Flat:
    """A nested dict of arrays as ``{"00_conv/kernel": array}`` (NumPy, float32 kept)."""
    out: Flat = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict) or hasattr(value, "items"):
            out.update(flatten(dict(value), path))
        else:
            out[path] = np.array(value, copy=True)  # never a view of a (donated) buffer
    return out


# ----------------------------------------------------------------------------- layers
# Each block maps its tensors to refdl paths: ``links()`` yields
# (refdl path, torch parameter, to_torch, from_torch).

Link = tuple[str, Any, Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]
_same = lambda a: a  # noqa: E731
_t2 = lambda a: a.T  # noqa: E731
_hwio_to_oihw = lambda a: a.transpose(3, 2, 0, 1)  # noqa: E731
_oihw_to_hwio = lambda a: a.transpose(2, 3, 1, 0)  # noqa: E731

_ACT = {
    None: lambda x: x,
    "relu": lambda x: F.relu(x),
    "tanh": lambda x: torch.tanh(x),
    "sigmoid": lambda x: torch.sigmoid(x),
    "gelu": lambda x: F.gelu(x, approximate="tanh"),  # jax.nn.gelu's default
}


def _same_pads(size: int, k: int, s: int) -> tuple[int, int]:
    """XLA's SAME padding of one spatial axis: ``(low, high)``, the odd pixel high."""
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


if torch is not None:

    class Block(nn.Module):
        """A PyTorch layer standing for refdl layer ``key``."""

        key: str = ""

        def links(self) -> Iterator[Link]:
            return iter(())

    class ToNCHW(Block):
        """refdl feeds NHWC images; PyTorch convolutions want NCHW."""

        def forward(self, x):
            return x.permute(0, 3, 1, 2) if x.dim() == 4 else x

    class Dense(Block):
        def __init__(self, key: str, n_in: int, n_out: int, act: str | None, bias: bool) -> None:
            super().__init__()
            self.key, self.act = key, act
            self.linear = nn.Linear(n_in, n_out, bias=bias)

        def forward(self, x):
            return _ACT[self.act](self.linear(x))

        def links(self):
            yield f"{self.key}/kernel", self.linear.weight, _t2, _t2
            if self.linear.bias is not None:
                yield f"{self.key}/bias", self.linear.bias, _same, _same

    class Conv(Block):
        """Conv2d with XLA's SAME/VALID padding (computed per input size)."""

        def __init__(self, key, c_in, c_out, kernel, strides, padding, act, bias) -> None:
            super().__init__()
            self.key, self.act, self.padding = key, act, padding
            self.kernel, self.strides = tuple(kernel), tuple(strides)
            self.conv = nn.Conv2d(c_in, c_out, self.kernel, self.strides, padding=0, bias=bias)

        def forward(self, x):
            if self.padding == "SAME":
                (kh, kw), (sh, sw) = self.kernel, self.strides
                top, bottom = _same_pads(x.shape[2], kh, sh)
                left, right = _same_pads(x.shape[3], kw, sw)
                x = F.pad(x, (left, right, top, bottom))
            return _ACT[self.act](self.conv(x))

        def links(self):
            yield f"{self.key}/kernel", self.conv.weight, _hwio_to_oihw, _oihw_to_hwio
            if self.conv.bias is not None:
                yield f"{self.key}/bias", self.conv.bias, _same, _same

    class Pool(Block):
        """flax's max/avg pool: SAME pads with -inf (max) or zeros counted in the mean (avg)."""

        def __init__(self, key, kind, window, stride, padding) -> None:
            super().__init__()
            self.key, self.kind, self.window, self.stride = key, kind, window, stride
            self.padding = padding

        def forward(self, x):
            if self.padding == "SAME":
                top, bottom = _same_pads(x.shape[2], self.window, self.stride)
                left, right = _same_pads(x.shape[3], self.window, self.stride)
                fill = float("-inf") if self.kind == "max" else 0.0
                x = F.pad(x, (left, right, top, bottom), value=fill)
            pool = F.max_pool2d if self.kind == "max" else F.avg_pool2d
            return pool(x, self.window, self.stride)

    class Flatten(Block):
        """Flatten in refdl's NHWC order so the next Dense kernel's rows line up."""

        def __init__(self, key) -> None:
            super().__init__()
            self.key = key

        def forward(self, x):
            if x.dim() == 4:
                x = x.permute(0, 2, 3, 1)
            return x.reshape(x.shape[0], -1)

    class GlobalAvgPool(Block):
        def __init__(self, key) -> None:
            super().__init__()
            self.key = key

        def forward(self, x):
            return x.mean(dim=(2, 3))

    class BatchNorm2d(nn.BatchNorm2d):
        """BatchNorm written with PyTorch tensor ops, global over all ranks when ``sync``.

        Two reasons not to use ``torch.nn.BatchNorm2d``/``SyncBatchNorm``: PyTorch's
        CPU batch-norm backward kernel loses precision (the bias gradient of a
        64x8x8 batch is 3.5e-3 off its float64 value, against 1.5e-6 for these
        tensor ops; README, "Cross-framework validation"), and ``SyncBatchNorm``
        accepts only GPU tensors. Statistics are flax's: ``var = E[x^2] - E[x]^2``
        over the batch (of every rank when ``sync``; ``torch.distributed.nn``'s
        all_reduce carries the gradients back). ``native=True`` in ``ModelPlan.build``
        selects PyTorch's own kernel instead.
        """

        sync: bool = False

        def forward(self, x):
            if not self.training:
                return super().forward(x)
            c = x.shape[1]
            n_local = float(x.shape[0] * x.shape[2] * x.shape[3])
            sums = torch.cat([x.sum(dim=(0, 2, 3)), (x * x).sum(dim=(0, 2, 3))])
            n = n_local
            if self.sync:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    from torch.distributed.nn.functional import all_reduce

                    sums = all_reduce(sums)
                    n = n_local * dist.get_world_size()
            mean, meansq = sums[:c] / n, sums[c:] / n
            var = torch.clamp(meansq - mean * mean, min=0.0)
            with torch.no_grad():  # PyTorch's convention: the unbiased variance
                self.num_batches_tracked.add_(1)
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(m * mean)
                self.running_var.mul_(1 - m).add_(m * var * n / max(n - 1, 1))
            shape = (1, c, 1, 1)
            y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
            return y * self.weight.view(shape) + self.bias.view(shape)

    def _batchnorm(c: int, bn: str) -> nn.BatchNorm2d:
        """``bn``: ``local`` (this module), ``sync`` (global over ranks) or ``native``."""
        if bn == "native":
            return nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)
        module = BatchNorm2d(c, eps=1e-5, momentum=0.1)
        module.sync = bn == "sync"
        return module

    def _bn_links(prefix: str, bn: nn.BatchNorm2d) -> Iterator[Link]:
        yield f"{prefix}/BatchNorm_0/scale", bn.weight, _same, _same
        yield f"{prefix}/BatchNorm_0/bias", bn.bias, _same, _same

    class ConvBN(Block):
        """refdl's stem: conv3x3 (no bias), BatchNorm, activation."""

        def __init__(self, key, c_in, c_out, act, bn) -> None:
            super().__init__()
            self.key, self.act = key, act
            self.conv = Conv(f"{key}/Conv_0", c_in, c_out, (3, 3), (1, 1), "SAME", None, False)
            self.bn = _batchnorm(c_out, bn)

        def forward(self, x):
            return _ACT[self.act](self.bn(self.conv(x)))

        def links(self):
            yield from self.conv.links()
            yield from _bn_links(f"{self.key}/BatchNorm_0", self.bn)

    class ResidualBlock(Block):
        """He et al.'s basic block with the option-A shortcut, as refdl builds it."""

        def __init__(self, key, c_in, c_out, stride, bn) -> None:
            super().__init__()
            self.key, self.stride, self.c_out = key, stride, c_out
            s = (stride, stride)
            self.conv0 = Conv(f"{key}/Conv_0", c_in, c_out, (3, 3), s, "SAME", None, False)
            self.bn0 = _batchnorm(c_out, bn)
            self.conv1 = Conv(f"{key}/Conv_1", c_out, c_out, (3, 3), (1, 1), "SAME", None, False)
            self.bn1 = _batchnorm(c_out, bn)

        def forward(self, x):
            y = F.relu(self.bn0(self.conv0(x)))
            y = self.bn1(self.conv1(y))
            shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride != 1 else x
            extra = self.c_out - shortcut.shape[1]
            if extra > 0:
                shortcut = F.pad(shortcut, (0, 0, 0, 0, extra // 2, extra - extra // 2))
            return F.relu(y + shortcut)

        def links(self):
            yield from self.conv0.links()
            yield from _bn_links(f"{self.key}/BatchNorm_0", self.bn0)
            yield from self.conv1.links()
            yield from _bn_links(f"{self.key}/BatchNorm_1", self.bn1)

    class Embed(Block):
        def __init__(self, key, vocab, features) -> None:
            super().__init__()
            self.key = key
            self.embedding = nn.Embedding(vocab, features)

        def forward(self, x):
            return self.embedding(x.long())

        def links(self):
            yield f"{self.key}/embedding", self.embedding.weight, _same, _same

    class LSTM(Block):
        """``torch.nn.LSTM`` (one layer, batch first); ``bias_hh`` frozen at zero."""

        def __init__(self, key, d_in, hidden) -> None:
            super().__init__()
            self.key = key
            self.lstm = nn.LSTM(d_in, hidden, num_layers=1, batch_first=True)
            with torch.no_grad():
                self.lstm.bias_hh_l0.zero_()
            self.lstm.bias_hh_l0.requires_grad_(False)

        def forward(self, x):
            return self.lstm(x)[0]

        def links(self):
            yield f"{self.key}/w_ih", self.lstm.weight_ih_l0, _t2, _t2
            yield f"{self.key}/w_hh", self.lstm.weight_hh_l0, _t2, _t2
            yield f"{self.key}/bias", self.lstm.bias_ih_l0, _same, _same

    class PositionalEmbed(Block):
        """Learned positions added to ``[B, T, D]``."""

        def __init__(self, key, max_len, features) -> None:
            super().__init__()
            self.key = key
            self.embedding = nn.Parameter(torch.zeros(max_len, features))

        def forward(self, x):
            return x + self.embedding[None, : x.shape[1]]

        def links(self):
            yield f"{self.key}/embedding", self.embedding, _same, _same

    class LayerNorm(Block):
        """refdl's ``LayerNorm`` (flax's, eps 1e-5) over the last axis."""

        def __init__(self, key, features) -> None:
            super().__init__()
            self.key = key
            self.norm = nn.LayerNorm(features, eps=1e-5)

        def forward(self, x):
            return self.norm(x)

        def links(self):
            yield f"{self.key}/LayerNorm_0/scale", self.norm.weight, _same, _same
            yield f"{self.key}/LayerNorm_0/bias", self.norm.bias, _same, _same

    class TransformerBlock(Block):
        """Pre-LN decoder block: x + MHA(LN(x)) with a causal mask, then x + MLP(LN(x));
        refdl's ``(d, heads, head_dim)`` projections are bias-free ``Linear`` layers."""

        def __init__(self, key, d, heads, mlp_dim) -> None:
            super().__init__()
            self.key, self.heads, self.hd = key, heads, d // heads
            self.ln0 = LayerNorm(f"{key}/LayerNorm_0", d)
            self.ln1 = LayerNorm(f"{key}/LayerNorm_1", d)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.fc0 = Dense(f"{key}/Dense_0", d, mlp_dim, "gelu", True)
            self.fc1 = Dense(f"{key}/Dense_1", mlp_dim, d, None, True)
            self.ffn = None

        def forward(self, x):
            b, t, _ = x.shape
            y = self.ln0(x)
            # -1 heads: under tensor parallelism a rank holds heads / tp of them
            q, k, v = (w(y).view(b, t, -1, self.hd).transpose(1, 2)
                       for w in (self.wq, self.wk, self.wv))  # fmt: skip
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(ctx.transpose(1, 2).reshape(b, t, -1))
            if self.ffn is not None:
                return x + self.ffn(self.ln1(x))
            return x + self.fc1(self.fc0(self.ln1(x)))

        def moe(self, ffn: Block) -> None:
            """Replace the MLP by a mixture of experts (refdl's ``moe`` model)."""
            del self.fc0, self.fc1
            self.fc0 = self.fc1 = None
            self.ffn = ffn

        def links(self):
            n, h = self.heads, self.hd
            yield from self.ln0.links()
            yield from self.ln1.links()
            for name in ("wq", "wk", "wv"):  # (d, n, h) <-> Linear.weight (n h, d)
                yield (f"{self.key}/{name}", getattr(self, name).weight,
                       lambda a: a.reshape(a.shape[0], -1).T,
                       lambda a, n=n, h=h: a.T.reshape(-1, n, h))  # fmt: skip
            yield (f"{self.key}/wo", self.wo.weight, lambda a: a.reshape(-1, a.shape[-1]).T,
                   lambda a, n=n, h=h: a.T.reshape(n, h, -1))  # fmt: skip
            for f in (self.fc0, self.fc1, self.ffn):
                if f is not None:
                    yield from f.links()

    class MoEFeedForward(Block):
        """refdl's mixture of experts (``refdl.core.moe``): the router in >= fp32, top-k
        choices, gates renormalised (k > 1), ``C`` slots per expert and sequence given
        first choices first then by position, a choice past ``C`` dropped; each expert a
        GELU MLP. ``aux`` keeps the forward's load-balancing loss (added to the objective
        by the runner). ``exchange(buffers, experts)`` reaches the experts where they are
        split over ranks (``refdl.adapters.torch.experts``); by default they are here."""

        def __init__(self, key, d, experts, top_k, factor, mlp_dim, aux_weight) -> None:
            super().__init__()
            self.key, self.e, self.k, self.factor = key, experts, top_k, factor
            self.aux_weight = aux_weight
            self.router = nn.Parameter(torch.zeros(d, experts))
            self.w1 = nn.Parameter(torch.zeros(experts, d, mlp_dim))
            self.b1 = nn.Parameter(torch.zeros(experts, mlp_dim))
            self.w2 = nn.Parameter(torch.zeros(experts, mlp_dim, d))
            self.b2 = nn.Parameter(torch.zeros(experts, d))
            self.exchange = None
            self.aux = None

        def experts(self, buffers, lo: int = 0, hi: int | None = None):
            """Experts ``lo..hi-1`` on their ``[B, E', C, D]`` buffers."""
            w1, b1, w2, b2 = (p[lo:hi] for p in (self.w1, self.b1, self.w2, self.b2))
            h = F.gelu(torch.einsum("becd,edf->becf", buffers, w1) + b1[None, :, None],
                       approximate="tanh")  # fmt: skip
            return torch.einsum("becf,efd->becd", h, w2) + b2[None, :, None]

        def forward(self, x):
            b, t, _ = x.shape
            e, k = self.e, self.k
            slots = max(1, min(t, math.ceil(self.factor * t * k / e)))
            wide = torch.promote_types(x.dtype, torch.float32)
            probs = torch.softmax(x.to(wide) @ self.router.to(wide), dim=-1)
            gates, chosen = torch.topk(probs, k, dim=-1)
            if k > 1:
                gates = gates / gates.sum(-1, keepdim=True)
            onehot = F.one_hot(chosen, e)  # [B, T, k, E]
            ranked = onehot.permute(0, 2, 1, 3).reshape(b, k * t, e)  # first choices first
            slot = ((ranked.cumsum(1) - 1) * ranked).sum(-1).reshape(b, k, t).permute(0, 2, 1)
            kept = slot < slots
            place = F.one_hot(torch.where(kept, slot, slots), slots + 1)[..., :slots]
            oh, place = onehot.to(probs.dtype), place.to(probs.dtype)
            dispatch = torch.einsum("btke,btkc->btec", oh, place)
            combine = torch.einsum("btke,btkc,btk->btec", oh, place, gates)
            buffers = torch.einsum("btec,btd->becd", dispatch.to(x.dtype), x)
            out = self.exchange(buffers, self) if self.exchange else self.experts(buffers)
            share = onehot.to(wide).mean(2).mean(1)  # f [B, E]
            self.aux = self.aux_weight * (e * (share * probs.mean(1)).sum(-1)).mean()
            return torch.einsum("btec,becd->btd", combine.to(out.dtype), out)

        def links(self):
            for name in ("router", "w1", "b1", "w2", "b2"):
                yield f"{self.key}/{name}", getattr(self, name), _same, _same

    class _ContiguousGrad(torch.autograd.Function):
        """Identity whose backward makes the gradient contiguous: a pipeline stage sends
        its input's gradient to the previous stage, and gloo sends only contiguous tensors."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g.contiguous()

    class TorchModel(nn.Module):
        """A refdl ``Sequential`` in PyTorch: block 0 adapts the input, block i+1 is layer i."""

        def __init__(self, blocks: list[Block], dtype: Any = None) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(blocks)
            self.dtype = dtype or torch.float32  # refdl's fp64 runs: a float64 twin

        def forward(self, x):
            if x.is_floating_point() and x.dtype != self.dtype:  # refdl's images are fp32
                x = x.to(self.dtype)
            if x.requires_grad:  # a later pipeline stage's input
                x = _ContiguousGrad.apply(x)
            for b in self.blocks:
                x = b(x)
            return x.contiguous()  # pipelining sends stage outputs; gloo needs contiguous

        def links(self) -> Iterator[Link]:
            for b in self.blocks:
                yield from b.links()


def _layer_block(layer: Any, key: str, shape: tuple[int, ...], bn: str) -> Any:
    """The PyTorch block for one refdl layer applied to an input of NHWC ``shape``."""
    from refdl.core import layers as L

    kind = type(layer)
    c = shape[-1] if shape else 0
    if kind is L.Dense:
        block = Dense(key, c, layer.features, layer.act, layer.use_bias)
        block.refdl_axes = (layer.in_axis, layer.out_axis)  # what tensor parallelism splits
        return block
    if kind is L.Conv:
        return Conv(
            key, c, layer.features, layer.kernel_size, layer.strides, layer.padding,
            layer.act, layer.use_bias,
        )  # fmt: skip
    if kind is L.Pool:
        return Pool(key, layer.kind, layer.window, layer.stride, layer.padding)
    if kind is L.Flatten:
        return Flatten(key)
    if kind is L.GlobalAvgPool:
        return GlobalAvgPool(key)
    if kind is L.ConvBN:
        return ConvBN(key, c, layer.features, layer.act, bn)
    if kind is L.ResidualBlock:
        return ResidualBlock(key, c, layer.features, layer.strides, bn)
    if kind is L.Embed:
        return Embed(key, layer.vocab_size, layer.features)
    if kind is L.LSTM:
        return LSTM(key, c, layer.hidden)
    if kind is L.PositionalEmbed:
        return PositionalEmbed(key, layer.max_len, c)
    if kind is L.LayerNorm:
        return LayerNorm(key, c)
    if kind is L.TransformerBlock:
        block = TransformerBlock(key, c, layer.num_heads, layer.mlp_dim)
        if layer.ffn is not None:  # refdl.core.moe.MoEFeedForward
            f = layer.ffn
            block.moe(MoEFeedForward(f"{key}/ffn", c, f.experts, f.top_k, f.capacity_factor,
                                     f.mlp_dim, f.aux_weight))  # fmt: skip
        return block
    raise UsageError(
        f"the torch adapter has no twin for layer {type(layer).__name__} ({key}); "
        "it covers mlp, lenet5, resnet, lstm_lm, transformer and moe"
    )


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """What a worker process needs to rebuild the PyTorch model without JAX:
    one ``(refdl layer, key, input shape)`` per layer (flax modules pickle)."""

    layers: tuple[tuple[Any, str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, model: Any, sample_x: np.ndarray) -> ModelPlan:
        """Record each layer's input shape by abstract evaluation of ``model``."""
        import jax
        import jax.numpy as jnp

        params = model.abstract_params(jnp.asarray(sample_x))
        state = model.abstract_variables(jnp.asarray(sample_x))[1]
        x = jax.ShapeDtypeStruct(sample_x.shape, jnp.asarray(sample_x).dtype)
        rows = []
        for i, key in enumerate(model.keys):
            rows.append((model.layers[i], key, tuple(x.shape)))
            stage = model.stage(i, i + 1)
            x = jax.eval_shape(lambda p, s, v, st=stage: st.apply(p, s, v)[0], params, state, x)
        return cls(tuple(rows))

    def build(
        self, flat_params: Flat, bn: str = "local", start: int = 0, stop: int | None = None
    ) -> Any:
        """The PyTorch model of layers ``start..stop-1`` with refdl's weights copied in;
        the input adapter comes first when ``start`` is 0. ``bn``: BatchNorm over this
        process's batch (``local``), over all ranks (``sync``), or ``torch.nn.BatchNorm2d``
        (``native``). Float64 parameters (a ``--precision fp64`` run) give a float64 model."""
        require()
        rows = self.layers[start:stop]
        blocks = [ToNCHW()] if start == 0 else []
        blocks += [_layer_block(layer, key, shape, bn) for layer, key, shape in rows]
        wide = any(np.asarray(v).dtype == np.float64 for v in flat_params.values())
        module = TorchModel(blocks, torch.float64 if wide else torch.float32)
        if wide:
            module.double()
        load(module, flat_params)
        return module


def load(module: Any, flat_params: Flat) -> None:
    """Copy refdl's parameters (flat paths) into ``module``, converting layouts."""
    with torch.no_grad():
        for path, tensor, to_torch, _ in module.links():
            dtype = np.float64 if tensor.dtype == torch.float64 else np.float32
            value = to_torch(np.asarray(flat_params[path], dtype))
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(f"{path}: refdl {value.shape} vs torch {tuple(tensor.shape)}")
            tensor.copy_(torch.from_numpy(np.array(value, dtype, copy=True)))


def export(module: Any) -> Flat:
    """The parameters of ``module`` in refdl's layout and paths."""
    return {
        path: np.array(from_torch(tensor.detach().cpu().numpy()), copy=True, order="C")
        for path, tensor, _, from_torch in module.links()
    }
