"""Issue 52, any model by its shape: ``--model-shape`` and ``--model-shape-file`` counted
as the published figures count them, priced by ``refdl predict`` and ``refdl plan``."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from refdl.errors import UsageError
from refdl.perf.shapes import describe, parse_shape, register, shape_from_config
from refdl.perf.zoo import TRANSFORMERS

# Mixtral 8x7B's config.json (mistralai/Mixtral-8x7B-v0.1), the keys a shape reads
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
           "intermediate_size": 14336, "max_position_embeddings": 32768,
           "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
           "num_key_value_heads": 8, "num_local_experts": 8, "vocab_size": 32000,
           "tie_word_embeddings": False}  # fmt: skip
GPT2 = {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257,
        "activation_function": "gelu_new"}  # fmt: skip
SHAPE = "layers=42,d_model=5120,heads=40,kv_heads=8,ffn=13824,vocab=32000,glu=1"
# DeepSeek-V2's and -V3's config.json (deepseek-ai/DeepSeek-V2, -V3), the keys a shape reads
DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "first_k_dense_replace": 1,
               "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 12288,
               "kv_lora_rank": 512, "moe_intermediate_size": 1536, "n_routed_experts": 160,
               "n_shared_experts": 2, "num_attention_heads": 128, "num_experts_per_tok": 6,
               "num_hidden_layers": 60, "num_key_value_heads": 128, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "tie_word_embeddings": False,
               "v_head_dim": 128, "vocab_size": 102400}  # fmt: skip
DEEPSEEK_V3 = {**DEEPSEEK_V2, "architectures": ["DeepseekV3ForCausalLM"],
               "first_k_dense_replace": 3, "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "num_hidden_layers": 61, "vocab_size": 129280,
               "num_nextn_predict_layers": 1}  # fmt: skip


def test_a_shape_counts_as_the_published_models_do(tmp_path):
    """Llama 3 8B by its shape is the zoo's (8.03 B, Meta's figure); Mixtral's config.json
    gives 46.7 B parameters and 12.9 B active per token (Mistral's figures); GPT-2's
    config.json is the zoo's GPT-2 (124.4 M, tied, learned positions)."""
    llama = parse_shape("layers=32,d_model=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,"
                        "glu=1", 8192)  # fmt: skip
    zoo = TRANSFORMERS.get("llama3-8b").shape
    assert llama == zoo and round(llama.params / 1e9, 2) == 8.03
    (tmp_path / "mixtral.json").write_text(json.dumps(MIXTRAL))
    mixtral = shape_from_config(str(tmp_path / "mixtral.json"), 4096)
    assert round(mixtral.params / 1e9, 1) == 46.7 and mixtral.gated and mixtral.top_k == 2
    assert "12.9 B active per token" in describe(mixtral)
    (tmp_path / "gpt2.json").write_text(json.dumps(GPT2))
    gpt2 = shape_from_config(str(tmp_path / "gpt2.json"), 1024)
    assert shape_from_config(str(tmp_path / "gpt2.json")).seq == 2048  # not n_positions
    assert gpt2 == TRANSFORMERS.get("gpt2").shape and gpt2.params == 124_356_864
    # shared experts: every token's dense MLP, counted beside the routed ones
    moe = parse_shape("layers=2,d_model=64,heads=4,experts=8,top_k=2,vocab=100", 16)
    shared = parse_shape("layers=2,d_model=64,heads=4,experts=8,top_k=2,shared_experts=1,"
                         "vocab=100", 16)  # fmt: skip
    assert shared.params - moe.params == 2 * moe.mlp_params()
    assert shared.layer_forward_flops() - moe.layer_forward_flops() == 2 * 16 * moe.mlp_params()
    assert register(llama) == register(llama)  # registered once, by a name that spells it
    tied = parse_shape("layers=2,d_model=8,heads=2,tied=1", 16)
    assert register(tied) != register(parse_shape("layers=2,d_model=8,heads=2", 16))
    assert TRANSFORMERS.get(register(tied)).shape == tied  # never another shape's name


def test_deepseeks_latent_attention_and_dense_first_layers_count_as_its_reports_do(tmp_path):
    """DeepSeek-V2: 236 B parameters, 21 B active per token; DeepSeek-V3: 671 B, 37 B (the
    reports' abstracts; V3's multi-token-prediction module left out, as its total does).
    Multi-head latent attention's projections and the dense first layers are counted."""
    got = {}
    for name, cfg in (("v2", DEEPSEEK_V2), ("v3", DEEPSEEK_V3)):
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        got[name] = shape_from_config(str(tmp_path / f"{name}.json"), 4096)
    v2, v3 = got["v2"], got["v3"]
    assert abs(v2.params / 236e9 - 1) < 0.005 and abs(v2.active_params() / 21e9 - 1) < 0.03
    assert abs(v3.params / 671e9 - 1) < 0.001 and abs(v3.active_params() / 37e9 - 1) < 0.03
    assert (v3.dense_layers, v3.dense_ffn, v3.kv_lora, v3.q_lora, v3.rope_dim) == (
        3, 18432, 512, 1536, 64)  # fmt: skip
    # one layer of latent attention, by hand: q down and up (and the latent's norm), kv
    # down with the shared rotary key, its norm, kv up, out
    h, n = 7168, 128
    attn = h * 1536 + 1536 + 1536 * n * 192 + h * 576 + 512 + 512 * n * 256 + n * 128 * h
    assert v3.attention_params() == attn == 187_107_328
    assert "latent attention (kv 512, q 1536), 3 dense first layers" in describe(v3)
    text = ("layers=61,d_model=7168,heads=128,kv_heads=128,head_dim=128,ffn=2048,experts=256,"
            "top_k=8,shared_experts=1,dense_layers=3,dense_ffn=18432,q_lora=1536,kv_lora=512,"
            "rope_dim=64,v_head_dim=128,vocab=129280,glu=1")  # fmt: skip
    assert parse_shape(text, 4096) == v3
    # scores see the rotary part: 2 s^2 heads (192 + 128) a layer, against GQA's 4 s^2 d_q
    plain = parse_shape("layers=2,d_model=64,heads=4,vocab=100", 16)
    assert plain.layer_forward_flops() == 2 * 16 * plain.attention_params() + 4 * 16**2 * 64 + (
        2 * 16 * plain.mlp_params())  # fmt: skip


@pytest.mark.parametrize("text,message", [
    ("layers=2,dmodel=8", "'dmodel=8' is not KEY=VALUE"),
    ("layers=2,d_model=8", "heads missing"),
    ("layers=2,d_model=8,heads=3", "d_model 8 must divide by heads 3"),
    ("layers=2,d_model=8,heads=2,glu=2", "glu is 0 or 1"),
    ("layers=x,d_model=8,heads=2", "layers='x' is not a number"),
    ("layers=2,d_model=8,heads=2,shared_experts=1", "shared_experts needs experts"),
    ("layers=2,d_model=8,heads=2,dense_layers=1", "dense_layers and dense_ffn need experts"),
    ("layers=2,d_model=8,heads=2,experts=4,dense_layers=2", "dense_layers must be below"),
    ("layers=2,d_model=8,heads=2,rope_dim=4", "give kv_lora too"),
    ("layers=0,d_model=8,heads=2", "layers must be >= 1"),
    ("layers=2,d_model=40,heads=10,kv_heads=3", "heads 10 must divide by kv_heads 3"),
    ("layers=2,d_model=8,heads=2,top_k=2", "top_k needs experts"),
])  # fmt: skip
def test_a_bad_shape_is_one_line(text, message):
    with pytest.raises(UsageError, match=message):
        parse_shape(text)


def test_a_config_file_is_read_as_data(tmp_path):
    for content, message in ((b"\x00\x01", "not JSON"), (b"[1, 2]", "not a JSON object"),
                             (b"{}", "num_hidden_layers or n_layer, hidden_size or")):  # fmt: skip
        (tmp_path / "c.json").write_bytes(content)
        with pytest.raises(UsageError, match=message):
            shape_from_config(str(tmp_path / "c.json"))
    (tmp_path / "big.json").write_bytes(b" " * (2 << 20))
    with pytest.raises(UsageError, match="larger than 1 MiB"):
        shape_from_config(str(tmp_path / "big.json"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refdl", *args], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.slow  # since 2026-11-27: the default suite's 15 min (16 min 47 s with issue 53)
def test_plan_and_predict_take_a_shape():
    """The issue's plan command: configurations with their mesh, schedule, microbatches,
    recomputation, stage boundaries, interval and memory, well under 30 s; predict's
    command: the step with its interval and the model FLOPs per device and second."""
    t0 = time.perf_counter()
    p = cli("plan", "--hw", "a100-nvlink-ib-hdr", "--model-shape", SHAPE, "--devices", "256",
            "--batch-size", "1024", "--seq-len", "4096", "--top", "5", "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert time.perf_counter() - t0 < 30
    r = json.loads(p.stdout)
    assert r["model_shape"].startswith("11.9 B parameters") and len(r["configurations"]) == 5
    for c in r["configurations"]:
        assert {"mesh", "schedule", "microbatches", "recompute", "stage_boundaries",
                "step_time_s", "step_time_low_s", "step_time_high_s",
                "memory_bytes_per_device"} <= set(c)  # fmt: skip
        assert c["step_time_low_s"] < c["step_time_s"] < c["step_time_high_s"]
        pipe = c["mesh"]["pipe"]
        assert (c["stage_boundaries"] is None) == (pipe == 1)
    mesh = "data=16,model=4,pipe=2"
    args = ["predict", "--hw", "h100-nvlink-ib-ndr", "--model-shape", SHAPE, "--batch-size",
            "512", "--seq-len", "4096", "--mesh", mesh, "--schedule", "interleaved",
            "--recompute", "full", "--precision", "bf16", "--json"]  # fmt: skip
    p = cli(*args)
    assert p.returncode == 0, p.stderr
    row = json.loads(p.stdout)[0]
    assert row["strategy"] == "hybrid" and row["workers"] == 128
    assert row["step_time_low_s"] < row["step_time_s"] < row["step_time_high_s"]
    mfu = row["model_flops_per_device_per_s"] / 989e12  # H100 SXM's dense bf16 peak
    assert 0.05 < mfu < 0.6
    unfused = json.loads(cli(*args, "--attention", "unfused").stdout)[0]
    assert unfused["memory_bytes"] == row["memory_bytes"]  # full recomputation keeps no scores
    p = cli("predict", "--hw", "a100-nvlink", "--model", "gpt2", "--model-shape", SHAPE)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "give one of" in p.stderr


def test_uneven_stages_are_priced():
    """126 layers on 16 stages (Llama 3 405B's pipeline): a layer fewer on the first and
    last stage, priced by the busiest stage (8 layers, as 128 layers' even stages), a
    worse cut dearer."""
    from refdl.perf import PredictOptions
    from refdl.perf.prediction import predict_steps
    from refdl.perf.shapes import parse_shape, register
    from refdl.perf.transformer import stage_layers
    from refdl.strategies import traits_of

    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]
    assert stage_layers(10, 4) == [2, 3, 3, 2] and stage_layers(8, 2, (3,)) == [3, 5]
    with pytest.raises(UsageError, match="15 increasing layer indices"):
        stage_layers(126, 16, (5, 13))
    shape = "d_model=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,glu=1"
    l126, l128 = (register(parse_shape(f"layers={n},{shape}", 8192)) for n in (126, 128))

    def step(model: str, cuts: tuple[int, ...] | None = None) -> float:
        opts = PredictOptions(mesh="data=16,model=8,pipe=16", microbatches=64,
                              remat="full", stage_boundaries=cuts)  # fmt: skip
        return predict_steps("h100-nvlink-ib-ndr", "hybrid", traits_of("hybrid"), model, 2048,
                             [2048], opts=opts, precision="bf16")[0]["step_time_s"]  # fmt: skip

    even, uneven = step(l128), step(l126)
    assert uneven == pytest.approx(even, rel=0.02) and uneven < even
    worse = (*range(7, 119, 8), 120)  # 7, 15, ..., 111, 120: a stage of 9 before the last
    assert stage_layers(126, 16, worse)[-2] == 9
    assert step(l126, worse) == pytest.approx(uneven * 9 / 8, rel=0.02)


@pytest.mark.slow  # 9 s
def test_the_planner_offers_uneven_stages():
    """The issue's 126-layer shape: the planner offers pipe=16 with uneven stages and
    their boundaries (a layer fewer on the first and last)."""
    from refdl.perf.planning import plan_configurations
    from refdl.perf.shapes import parse_shape, register
    from refdl.strategies import STRATEGIES

    shape = "d_model=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,glu=1"
    l126 = register(parse_shape(f"layers=126,{shape}", 8192))
    owners = {n: STRATEGIES.get(n).traits for n in STRATEGIES.names()}
    record, _ = plan_configurations("h100-nvlink-ib-ndr", l126, 512, 512, strategies=owners,
                                    top=400, precisions=("bf16",))  # fmt: skip
    sixteen = [c for c in record["configurations"] if c["mesh"]["pipe"] == 16]
    assert sixteen and all("uneven stages" in c["description"] for c in sixteen)
    cuts = sixteen[0]["stage_boundaries"]
    assert len(cuts) == 15 and cuts[0] == 7 and cuts[-1] == 119


def test_one_device_prices_a_transformers_memory_in_its_precision():
    """The shape measured on the lent H200 through refdl train (2.42 B, bf16, 16 x 1024
    tokens; it fit in 139 GiB, 2026-11-27): single's memory is the mesh formula's on one
    device, 93.5 GB with bf16 activations (148 GB while single counted them in fp32)."""
    from refdl.perf import PredictOptions
    from refdl.perf.prediction import predict_steps
    from refdl.perf.shapes import parse_shape, register
    from refdl.strategies import traits_of

    name = register(parse_shape("layers=48,d_model=2048,heads=16,ffn=8192,vocab=65,"
                                "positions=1", 1024))  # fmt: skip

    def memory(strategy: str, **kw) -> float:
        opts = PredictOptions(optimizer_words=2, microbatches=1, **kw)
        return predict_steps("h100-nvlink", strategy, traits_of(strategy), name, 16, [1],
                             opts=opts, precision="bf16")[0]["memory_bytes"]  # fmt: skip

    single = memory("single")
    assert single == pytest.approx(memory("hybrid", mesh="data=1"), rel=1e-6)
    assert 90e9 < single < 139 * 2**30
