"""A user's transformer by its shape: ``--model-shape layers=L,d_model=D,heads=H,...`` or a
Hugging Face ``config.json`` (``--model-shape-file``), for ``refdl predict`` and
``refdl plan``.

The shape becomes a ``TransformerShape`` (``refdl.perf.transformer``), registered under a
name that spells it, so that every formula prices it as it prices the zoo's GPT-3 and
Llama 3. Its parameters and FLOPs are those closed forms: Narayanan et al.'s count
(``6N`` per token plus attention's ``12 l s h``), extended to grouped-query attention,
SwiGLU's three matrices, routed and shared experts, dense first layers and multi-head
latent attention (DeepSeek-V2/V3). ``describe`` says them in a line.

A user's shape is modern by default: untied embeddings and rotary positions (no position
table); ``tied=1`` and ``positions=1`` give GPT's. A config file is read as data: JSON
only, at most 1 MiB, and only the keys below are looked at.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from refdl.config.values import Int
from refdl.errors import UsageError
from refdl.perf.transformer import TransformerShape
from refdl.perf.zoo import TRANSFORMERS, register_transformer

# --model-shape's keys, each with the TransformerShape field it sets
KEYS = {"layers": "layers", "d_model": "d_model", "heads": "heads", "kv_heads": "kv_heads",
        "ffn": "ffn", "vocab": "vocab", "head_dim": "head_dim", "experts": "experts",
        "top_k": "top_k", "shared_experts": "shared_experts",
        "capacity_factor": "capacity_factor", "glu": "gated", "tied": "tied",
        "positions": "positions", "seq": "seq", "dense_layers": "dense_layers",
        "dense_ffn": "dense_ffn", "q_lora": "q_lora", "kv_lora": "kv_lora",
        "rope_dim": "rope_dim", "v_head_dim": "v_head_dim"}  # fmt: skip
FLAGS = ("glu", "tied", "positions")
# Keys whose 0 stands for a default in TransformerShape: given as 0 on the command line it
# would silently be that default, so it is refused (leaving the key out gives it).
ZERO_IS_DEFAULT = {"ffn": "4 x d_model", "kv_heads": "heads", "head_dim": "d_model / heads",
                   "dense_ffn": "ffn", "v_head_dim": "head_dim",
                   "seq": "--seq-len or 2,048"}  # fmt: skip
REQUIRED = ("layers", "d_model", "heads")
AT_LEAST_ONE = (*REQUIRED, "vocab")  # the others may be 0 (no experts, no latent, ...)
# The largest each key may be: far beyond any model trained (so that a typo is one line,
# not a memory error); the widths' (d_model, ffn, heads, ...) is WIDEST.
LIMITS = {"layers": 10_000, "dense_layers": 10_000, "seq": 1 << 24, "vocab": 1 << 24,
          "experts": 1 << 14, "top_k": 1 << 14, "shared_experts": 1 << 14}  # fmt: skip
WIDEST = 1 << 20
DEFAULT_VOCAB = 32000  # Llama 2's and Mistral's tokenizer, where no vocab is given
DEFAULT_SEQ = 2048
MAX_CONFIG_BYTES = 1 << 20
# Hugging Face config.json keys (Llama, Mistral, Qwen, Mixtral, DeepSeek, GPT-2, GPT-NeoX)
HF = {
    "layers": ("num_hidden_layers", "n_layer"),
    "d_model": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "vocab": ("vocab_size",),
    "head_dim": ("head_dim",),
    "experts": ("num_local_experts", "n_routed_experts", "num_experts"),
    "top_k": ("num_experts_per_tok",),
    "shared_experts": ("n_shared_experts",),
    "dense_layers": ("first_k_dense_replace",),  # DeepSeek's dense first layers
    "q_lora": ("q_lora_rank",),  # DeepSeek's latent attention (None: no query latent)
    "kv_lora": ("kv_lora_rank",),
    "rope_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
}


def parse_shape(text: str, seq_len: int | None = None) -> TransformerShape:
    """``layers=L,d_model=D,heads=H[,kv_heads=G][,ffn=F][,vocab=V][,experts=E,top_k=K,
    shared_experts=S][,glu=1]...`` as a shape (``seq_len`` or ``seq=``, not two different)."""
    given: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in KEYS:
            raise UsageError(f"--model-shape: {part!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(KEYS)}")  # fmt: skip
        if key in given:
            raise UsageError(f"--model-shape: {key} given twice")
        given[key] = value.strip()
    values: dict[str, object] = {}
    for key, value in given.items():
        try:
            number = float(value) if key == "capacity_factor" else int(value)
        except ValueError:
            raise UsageError(f"--model-shape: {key}={value!r} is not a number") from None
        if key in FLAGS and number not in (0, 1):
            raise UsageError(f"--model-shape: {key} is 0 or 1 (got {value})")
        if number < (least := 1 if key in AT_LEAST_ONE else 0):
            raise UsageError(f"--model-shape: {key} must be >= {least} (got {value})")
        if number == 0 and key in ZERO_IS_DEFAULT:
            raise UsageError(f"--model-shape: {key}=0 would be read as its default "
                             f"({ZERO_IS_DEFAULT[key]}); leave {key} out for that, or give a "
                             "size")  # fmt: skip
        values[key] = bool(number) if key in FLAGS else number
    if seq_len and values.get("seq") not in (None, seq_len):
        raise UsageError(f"--model-shape seq={values['seq']} and --seq-len {seq_len} disagree; "
                         "give the sequence once")  # fmt: skip
    return _shape(values, seq_len, "--model-shape")


def shape_from_config(path: str, seq_len: int | None = None) -> TransformerShape:
    """A Hugging Face ``config.json`` as a shape: layers, width, heads (and key/value
    heads), the MLP's width (``intermediate_size``; an MoE's per-expert
    ``moe_intermediate_size``), experts, vocabulary, a gated MLP from ``hidden_act``
    (SwiGLU; Gemma's GeGLU). The sequence is ``seq_len`` or 2,048: a config's
    ``max_position_embeddings`` is the longest context, not the training length. Not
    read too: DeepSeek's dense first layers (``first_k_dense_replace``, of
    ``intermediate_size``) and latent attention (``q_lora_rank``, ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``). Its multi-token
    prediction module is not counted (its reports' totals leave it out)."""
    p = Path(path)
    if not p.is_file():
        what = "a folder, not a config.json" if p.is_dir() else "no such file"
        raise UsageError(f"--model-shape-file {path}: {what}")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise UsageError(f"--model-shape-file {path}: larger than 1 MiB; not a config.json")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--model-shape-file {path}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"--model-shape-file {path}: not a JSON object")
    flag = f"--model-shape-file {path}"

    def number(name: str) -> int | None:
        """The config's integer ``name`` (None where absent or null; else one line)."""
        v = cfg.get(name)
        if v is not None and (problem := Int(max=None).problem(v)):
            raise UsageError(f"{flag}: {name} must be {problem}")
        return v

    def first(names: tuple[str, ...], key: str) -> int | None:
        """The first of ``names`` the config gives; a 0 that would be read as ``key``'s
        default is refused, as ``--model-shape`` refuses it."""
        name, v = next(((n, v) for n in names if (v := number(n)) is not None), ("", None))
        if v == 0 and key in ZERO_IS_DEFAULT:
            raise UsageError(
                f"{flag}: {name} is 0, which would be read as its default "
                f"({ZERO_IS_DEFAULT[key]}); remove it for that, or give a size"
            )
        return v

    values: dict[str, object] = {}
    for key, names in HF.items():
        found = first(names, key)
        if found is not None:
            values[key] = found
    experts = int(values.get("experts") or 0)
    moe = ("moe_intermediate_size",) if experts else ()
    ffn = first((*moe, "intermediate_size", "n_inner"), "ffn")
    if ffn is not None:
        values["ffn"] = ffn
    if values.get("kv_lora") and isinstance(cfg.get("qk_nope_head_dim"), int):
        values["head_dim"] = cfg["qk_nope_head_dim"]  # latent attention's per-head query/key
    if experts and values.get("dense_layers") and isinstance(cfg.get("intermediate_size"), int):
        values["dense_ffn"] = cfg["intermediate_size"]
    if not values.get("kv_lora"):
        for k in ("q_lora", "rope_dim", "v_head_dim"):
            values.pop(k, None)
    act_keys = ("hidden_activation", "hidden_act", "activation_function")
    act = str(next((cfg[k] for k in act_keys if k in cfg), ""))
    gemma = any("Gemma" in str(a) for a in cfg.get("architectures") or [])
    values["gated"] = act in ("silu", "swiglu", "swish") or (gemma and "gelu" in act)  # GeGLU
    tied = cfg.get("tie_word_embeddings", True)  # Hugging Face's default
    if not isinstance(tied, bool):
        raise UsageError(f"{flag}: tie_word_embeddings must be true or false (got {tied!r})")
    values["tied"] = tied
    values["positions"] = "n_positions" in cfg  # GPT-2's learned table; else rotary
    if not experts:
        for k in ("top_k", "shared_experts", "dense_layers"):
            values.pop(k, None)
    return _shape(values, seq_len, flag)


def _shape(values: dict[str, object], seq_len: int | None, flag: str) -> TransformerShape:
    if missing := [k for k in REQUIRED if values.get(k) is None]:
        names = (" or ".join(HF[k]) for k in missing) if flag != "--model-shape" else missing
        raise UsageError(f"{flag}: {', '.join(names)} missing (needs layers, d_model, heads)")
    for key, v in values.items():
        if key == "capacity_factor" and not 0 < v <= 64:  # type: ignore[operator]
            raise UsageError(f"{flag}: capacity_factor must be above 0 and at most 64 (got {v})")
        if key in FLAGS or key in ("gated", "capacity_factor"):
            continue
        least = 1 if key in AT_LEAST_ONE else 0
        if problem := Int(min=least, max=LIMITS.get(key, WIDEST)).problem(v):
            raise UsageError(f"{flag}: {key} must be {problem}")
    kw = {KEYS.get(k, k): v for k, v in values.items()}
    kw["seq"] = seq_len or values.get("seq") or DEFAULT_SEQ
    kw.setdefault("vocab", DEFAULT_VOCAB)
    kw.setdefault("tied", False)
    kw.setdefault("positions", False)
    if not kw.get("experts"):  # shared_experts alone: TransformerShape says so
        if values.get("top_k", 1) != 1:  # 1: a dense model's own
            raise UsageError(f"{flag}: top_k needs experts (routed ones); give experts=E "
                             "too, or leave top_k out for a dense model")  # fmt: skip
        kw.pop("top_k", None)
    try:
        return TransformerShape(**kw)
    except UsageError as e:
        raise UsageError(f"{flag}: {str(e).removeprefix('transformer shape: ')}") from None


def register(shape: TransformerShape) -> str:
    """The name ``shape`` is priced under (registered once): every field it sets beyond
    the defaults, so that two shapes never share a name."""
    required = ("layers", "d_model", "heads", "seq", "vocab")
    parts = [f"{f.name}={getattr(shape, f.name)}" for f in dataclasses.fields(shape)
             if f.name in required or getattr(shape, f.name) != f.default]  # fmt: skip
    name = "shape:" + ",".join(parts)
    if name not in TRANSFORMERS.names():
        register_transformer(name, shape, "a user's shape (--model-shape)")
    return name


def describe(shape: TransformerShape) -> str:
    """The count in a line: parameters (and those active per token), training FLOPs per
    token, and what the shape assumed."""
    active = shape.active_params()
    per_token = shape.flops_per_sequence() / shape.seq
    moe = f", {active / 1e9:.3g} B active per token" if shape.experts else ""
    return (f"{shape.params / 1e9:.3g} B parameters{moe}; {per_token / 1e9:.3g} GFLOP per "
            f"token to train (forward and backward, closed form); vocab {shape.vocab:,}, "
            f"{shape.seq:,} tokens, {'SwiGLU' if shape.gated else 'GELU'}, "
            f"{'tied' if shape.tied else 'untied'} embeddings, "
            f"{'learned' if shape.positions else 'rotary'} positions{_extras(shape)}")  # fmt: skip


def _extras(shape: TransformerShape) -> str:
    """Latent attention and dense first layers, where the shape has them."""
    out = f", latent attention (kv {shape.kv_lora}, q {shape.q_lora})" if shape.kv_lora else ""
    return out + (f", {shape.dense_layers} dense first layers" if shape.dense_layers else "")


def model_named(model: str | None, shape: str | None, shape_file: str | None,
                seq_len: int | None = None) -> tuple[str, TransformerShape | None]:  # fmt: skip
    """The name to price from ``--model``, ``--model-shape`` or ``--model-shape-file``
    (exactly one), and the user's shape where one was given."""
    given = [f for f, v in (("--model", model), ("--model-shape", shape),
                            ("--model-shape-file", shape_file)) if v]  # fmt: skip
    if len(given) != 1:
        raise UsageError(
            "give one of --model NAME, --model-shape KEY=VALUE,... or "
            f"--model-shape-file config.json (got {', '.join(given) or 'none'})"
        )
    if seq_len is not None and (problem := Int(min=1, max=1 << 24).problem(seq_len)):
        raise UsageError(f"--seq-len must be {problem}")
    if model:
        return model, None
    found = parse_shape(shape, seq_len) if shape else shape_from_config(shape_file, seq_len)
    return register(found), found


def with_seq(model: str, seq_len: int) -> str:
    """``model`` (a zoo transformer) at ``seq_len`` tokens, registered as a shape."""
    if model not in TRANSFORMERS.names():
        raise UsageError(f"--seq-len is for transformers; --model {model} is not one")
    return register(dataclasses.replace(TRANSFORMERS.get(model).shape, seq=seq_len))
