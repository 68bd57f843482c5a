"""Issue 51, Muon under every strategy: the optimizer against PyTorch's, each strategy
(and each of fsdp's schemes) against one device in float64, and the schemes' bytes
against their formula (``refdl.parallel.muon``)."""

from __future__ import annotations

import numpy as np
import pytest

from refdl.config.spec import RunSpec
from refdl.errors import UsageError
from refdl.run.build import build
from refdl.run.trajectory import run_steps

TINY = {"model_opts": (("d_model", "32"), ("heads", "4"), ("layers", "2"), ("mlp_dim", "32")),
        "data_opts": (("seq_len", "16"),), "batch_size": 8}  # fmt: skip


def rel_l2(a, b) -> float:
    import jax

    la, lb = jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
              for x, y in zip(la, lb, strict=True))  # fmt: skip
    return (num / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)) ** 0.5


def torch_muon_steps(w0: np.ndarray, grads: list[np.ndarray], lr: float) -> np.ndarray:
    """``torch.optim.Muon``'s algorithm (PyTorch 2.13, ``_single_tensor_muon``) written out
    in NumPy float64, on a ``[out, in]`` weight, without its cast to bf16."""
    a, b, c = 3.4445, -4.7750, 2.0315
    w, buf = w0.copy(), np.zeros_like(w0)
    for g in grads:
        buf += (1 - 0.95) * (g - buf)  # buf.lerp_(grad, 1 - momentum)
        u = g + 0.95 * (buf - g)  # grad.lerp(buf, momentum)
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / max(np.linalg.norm(x), 1e-7)  # .div_(norm().clamp(min=eps))
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if u.shape[0] > u.shape[1] else x
        w = w - lr * max(1.0, w.shape[0] / w.shape[1]) ** 0.5 * x
    return w


@pytest.mark.parametrize("shape", [(6, 10), (12, 5)])
def test_muon_is_torch_muons_algorithm_and_near_torch_itself(shape):
    """refdl's Muon on a flax ``[in, out]`` kernel equals PyTorch's algorithm on the
    ``[out, in]`` weight in float64 (measured 3e-15, 2e-15); real ``torch.optim.Muon`` runs
    its Newton-Schulz in bf16, so it agrees to bf16's precision only (measured 0.9 % and
    1.5 % of the update after four steps, 2026-11-26)."""
    import jax
    import jax.numpy as jnp

    from refdl.core.optim import muon, muon_dims

    jax.config.update("jax_enable_x64", True)
    try:
        rng = np.random.default_rng(0)
        out_, in_ = shape
        w0 = rng.normal(size=(out_, in_))
        grads = [rng.normal(size=(out_, in_)) for _ in range(4)]
        opt = muon(lambda _n: 0.02, muon_dims({"k": ("embed", "mlp")}))
        params = {"k": jnp.asarray(w0.T)}
        state = opt.init(params)
        for g in grads:
            updates, state = opt.update({"k": jnp.asarray(g.T)}, state, params)
            params = {"k": params["k"] + updates["k"]}
        mine = np.asarray(params["k"]).T
    finally:
        jax.config.update("jax_enable_x64", False)
    theirs = torch_muon_steps(w0, grads, 0.02)
    assert np.linalg.norm(mine - theirs) / np.linalg.norm(theirs - w0) < 1e-12
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.tensor(w0))
    opt_t = torch.optim.Muon([w], lr=0.02, weight_decay=0.0)
    for g in grads:
        w.grad = torch.tensor(g)
        opt_t.step()
    moved = w.detach().numpy() - w0
    assert np.linalg.norm(mine - w0 - moved) / np.linalg.norm(moved) < 3e-2


def test_which_parameters_muon_takes():
    """Matrices (dense, convolution, attention projections, each expert's) to Muon;
    biases, norms, embeddings, the output layer and the router to AdamW."""
    from refdl.core.optim import matrix_dims

    assert matrix_dims(("embed", "mlp")).reduction_axis == (0,)
    assert matrix_dims((None, None, "conv_in", "conv_out")).reduction_axis == (0, 1, 2)
    wo = matrix_dims(("heads", "head_dim", "embed"))
    assert wo.reduction_axis == (0, 1) and wo.output_axis == (2,)
    assert matrix_dims(("expert", "embed", "mlp")).reduction_axis == (1,)  # expert: batch
    for adamw in [("mlp",), ("vocab", "embed"), ("embed", "vocab"), ("embed", None),
                  (None, "embed"), ("expert", "mlp")]:  # fmt: skip
        assert matrix_dims(adamw) is None, adamw


CASES = [  # the acceptance layouts, fp64, 10 steps, the default model (mlp)
    pytest.param({"strategy": "data", "devices": 4}, marks=pytest.mark.slow),
    pytest.param({"strategy": "fsdp", "zero": 3, "devices": 4, "muon": "gather"},
                 marks=pytest.mark.slow),
    {"strategy": "fsdp", "zero": 3, "devices": 4, "muon": "owner"},
    pytest.param({"strategy": "model", "devices": 2}, marks=pytest.mark.slow),
    pytest.param({"strategy": "hybrid", "devices": 8, "mesh": "fsdp=2,model=2,pipe=2"},
                 marks=pytest.mark.slow),  # 11 s: the default suite's 15 min
]  # fmt: skip


@pytest.mark.parametrize("layout", CASES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_muon_under_a_strategy_equals_single_in_fp64(layout):
    """Measured 1.2e-15 .. 1.7e-15 (2026-11-26); the bound is the referee's 1e-10. The
    default suite proves fsdp's owner scheme; -m slow every layout."""
    base = {"optimizer": "muon", "precision": "fp64", "steps": 10, "progress": False}
    ref = run_steps(RunSpec(strategy="single", **base))
    got = run_steps(RunSpec(**base, **layout))
    assert rel_l2(got, ref) < 1e-10
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-10)


@pytest.mark.slow  # ~40 s: the transformer under context, pipeline, model and fsdp owner
@pytest.mark.parametrize("layout", [
    {"strategy": "context", "devices": 2},
    {"strategy": "pipeline", "devices": 2, "microbatches": 2},
    {"strategy": "fsdp", "zero": 1, "devices": 4, "muon": "owner"},
    {"strategy": "hybrid", "devices": 8, "mesh": "data=2,context=2,model=2"},
])  # fmt: skip
def test_muon_on_the_transformer_equals_single_in_fp64(layout):
    base = {"model": "transformer", "optimizer": "muon", "precision": "fp64", "steps": 10,
            "progress": False, **TINY}  # fmt: skip
    ref = run_steps(RunSpec(strategy="single", **base))
    assert rel_l2(run_steps(RunSpec(**base, **layout)), ref) < 1e-10


@pytest.mark.parametrize("scheme,zero", [pytest.param("gather", 3, marks=pytest.mark.slow),
                                         ("owner", 1)])  # fmt: skip
def test_fsdp_muon_bytes_equal_the_formula(scheme, zero):
    """gather: an all-gather of every Muon matrix, (P-1) Psi_muon; owner: point-to-point
    to the owner and back, 2 (P-1)/P Psi_muon (the compiled program's count)."""
    s = build(RunSpec(strategy="fsdp", model="transformer", optimizer="muon", zero=zero,
                      devices=4, muon=scheme, progress=False, **TINY)).strategy  # fmt: skip
    psi = sum(4 * -(-int(np.prod(v)) // 4) * 4 for v in s.muon_matrices.values())
    expect = 3 * psi if scheme == "gather" else 2 * 3 * psi // 4
    assert s.muon_bytes() == expect
    measured = s.comm["reduce-scatter"] + s.comm["all-gather"] + s.comm.get("collective-permute", 0)
    assert measured == s.analytic_comm_bytes()
    assert (s.comm.get("collective-permute", 0) == expect) == (scheme == "owner")


def test_a_muon_scheme_without_muon_is_one_line():
    from refdl.config.spec import command_line

    with pytest.raises(UsageError, match=r"^muon='owner' is a scheme of optimizer='muon'; add"):
        RunSpec(strategy="fsdp", muon="owner")
    with command_line(), pytest.raises(UsageError, match=r"^--muon owner is a scheme of --opt"):
        RunSpec(strategy="fsdp", muon="owner")


def test_predict_prices_the_schemes():
    """GPT-2 on 8 A100s: gather orthogonalizes every matrix on every rank and all-gathers
    them, owner a share each and half the bytes; one device pays every matrix once."""
    from refdl.perf import PredictOptions
    from refdl.perf.model_cost import model_cost
    from refdl.perf.muon import matrices, ns_flops
    from refdl.perf.prediction import predict_steps
    from refdl.strategies.base import traits_of

    def row(scheme: str, strategy: str = "fsdp") -> dict:
        opts = PredictOptions(muon=scheme, optimizer_words=1)
        return predict_steps("a100-nvlink", strategy, traits_of(strategy), "gpt2", 64, [1, 8],
                             opts=opts)  # fmt: skip

    gather, owner, plain = row("gather"), row("owner"), row(None)
    total = sum(k * ns_flops(a, b) for k, a, b in matrices(model_cost("gpt2")))
    assert total > 1e11  # GPT-2's 48 attention and 24 MLP matrices, 5 iterations each
    for one in (gather[0], owner[0]):  # one device: every matrix once, no bytes
        assert one["compute_s"] > plain[0]["compute_s"] and one["comm_s"] == plain[0]["comm_s"]
    assert gather[1]["comm_s"] > owner[1]["comm_s"] > plain[1]["comm_s"]
    assert gather[1]["compute_s"] > owner[1]["compute_s"] > plain[1]["compute_s"]


def validate_json(*flags: str) -> tuple[int, dict]:
    """``refdl validate --framework torch --optimizer muon FLAGS --json``: status, report."""
    import json
    import subprocess
    import sys

    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "refdl.validate", "--framework", "torch", "--optimizer",
           "muon", *flags, "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode == 1 and not proc.stdout:  # PyTorch's processes failed to start (a
        # gloo start-up race seen once in a full suite, 2026-11-27): no verdict, run again
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1) and proc.stdout, proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow  # since 2026-11-27: the default suite's 15 min (15 min 28 s, issue 53)
def test_validate_against_torch_muon_under_ddp():
    """The issue's command exits 0: DDP with torch.optim.Muon (matrices) and AdamW (the
    rest) departs from refdl by bf16's effect (measured 2.8e-2 of the parameters after
    10 steps, 2026-11-26), within MUON_BF16_FACTOR times the distance the same rounding moves
    refdl's own run; the forward pass agrees to fp32."""
    from refdl.validate.exact import FIRST_STEP_RTOL, MUON_BF16_FACTOR

    rc, r = validate_json("--strategy", "data", "--devices", "2", "--model", "mlp",
                          "--steps", "10")  # fmt: skip
    assert rc == 0 and r["passed"] and r["framework_impl"].startswith("DDP")
    env = r["muon_bf16_envelope"]
    factor = MUON_BF16_FACTOR["param_rel_l2"]
    assert 1e-3 < r["checks"]["param_rel_l2"] < factor * env["param_rel_l2"]
    assert 1e-3 < env["param_rel_l2"] < 0.2  # bf16's effect is real, and bounded
    assert r["checks"]["first_loss_rel"] <= FIRST_STEP_RTOL
    assert r["tolerance"]["param_rel_l2"] == factor * env["param_rel_l2"]


@pytest.mark.slow
def test_torch_muon_without_its_cast_equals_refdl_in_fp64_and_a_slip_fails():
    """With its Newton-Schulz in float64 (the bf16 cast taken away, nothing else),
    torch.optim.Muon under FSDP2 equals refdl's Muon to rounding (measured 2e-15); as
    shipped, Nesterov switched off departs beyond bf16's envelope."""
    rc, r = validate_json("--strategy", "fsdp", "--zero", "3", "--devices", "2", "--model",
                          "mlp", "--steps", "10", "--precision", "fp64", "--torch-muon-ns",
                          "native")  # fmt: skip
    assert rc == 0 and r["checks"]["param_rel_l2"] < 1e-12 and r["muon_bf16_envelope"] is None
    rc, r = validate_json("--model", "mlp", "--steps", "10", "--plant-bug", "muon-nesterov")
    assert rc == 1 and r["failed"] == ["loss_rel"]  # the first update: Nesterov or not, the same


def test_what_torch_muon_cannot_be_compared_with_is_one_line():
    """Refused before any run: a 4-D kernel (torch.optim.Muon takes 2-D parameters), a
    framework without Muon, ZeRO-1's one optimizer class, a Muon plant without Muon."""
    from refdl.validate.exact import check_muon
    from refdl.validate.request import Request

    cases = [({"model": "lenet5"}, r"^torch.optim.Muon takes 2-D parameters only"),
             ({"model": "mlp", "framework": "mxnet"}, r"^the mxnet adapter has no Muon"),
             ({"model": "mlp", "strategy": "fsdp", "zero": 1}, r"^PyTorch's ZeRO-1"),
             ({"model": "mlp", "optimizer": None, "plant_bug": "muon-scale"},
              r"configures torch.optim.Muon; add --optimizer muon")]  # fmt: skip
    for given, message in cases:
        with pytest.raises(UsageError, match=message):
            check_muon(Request(**{"optimizer": "muon", **given}))


def test_plan_prices_muon_and_names_the_scheme():
    """``refdl plan --optimizer muon``: every configuration carries Muon's term and says
    how whole matrices are reached; where ZeRO shards the state and the strategy offers
    the choice (fsdp), the scheme taken is the faster of gather and owner, and its
    train flags name it."""
    from refdl.config.mesh import MeshSpec
    from refdl.hw import load
    from refdl.perf.costs import link_of
    from refdl.perf.model_cost import model_cost
    from refdl.perf.muon import on_mesh
    from refdl.perf.planning import plan_configurations
    from refdl.perf.search import Config, Planner
    from refdl.strategies import STRATEGIES

    owners = {n: STRATEGIES.get(n).traits for n in STRATEGIES.names()}
    record, _ = plan_configurations("a100-nvlink", "gpt2", 4, 64, strategies=owners,
                                    optimizer="muon")  # fmt: skip
    rows = record["configurations"]
    assert rows and all(r["terms_s"]["muon"] > 0 for r in rows)
    for r in rows:  # Muon's term is part of the step the plan ranks by
        assert sum(r["terms_s"].values()) == pytest.approx(r["step_time_s"])
    schemes = {r["description"].split("muon ")[1].split(",")[0] for r in rows}
    assert schemes <= {"replicated", "sharded-ns", "gather", "owner"}
    # AlexNet (a shape-only model: every kernel a Muon matrix) under fsdp, ZeRO-1 over 8
    m, profile = model_cost("alexnet"), load("a100-nvlink")
    planner = Planner(m, profile, 8, 256, strategies=owners, muon=True, optimizer_words=1)
    p = planner.price(Config(MeshSpec(data=8), zero=1))
    assert p.config.strategy(False, owners) == "fsdp" and p.config.muon in ("gather", "owner")
    flags = p.config.train_flags(False, owners)
    assert flags[flags.index("--optimizer") :][:4] == ["--optimizer", "muon", "--muon",
                                                       p.config.muon]  # fmt: skip
    cfg = Config(MeshSpec(data=8), zero=1)
    _, opts, base = planner.formula_cost(cfg)
    hw = planner.view("fp32")
    times = {k: on_mesh(base, m, hw, 1, 8, k, link_of(hw, 8, opts)).step_time_s
             for k in ("gather", "owner")}  # fmt: skip
    assert min(times, key=times.get) == p.config.muon
    assert p.terms["muon"] == pytest.approx(min(times.values()) - base.step_time_s)


def test_muon_is_priced_by_who_holds_each_matrix():
    """An expert axis splits the expert banks' Newton-Schulz (Mixtral's shape on 64 H100s:
    Muon adds 8.6 s on data=64, 1.3 s on data=8,expert=8); predict prices a hybrid
    mesh as plan does (tensor and pipeline axes split, data replicas repeat)."""
    from refdl.perf import PredictOptions
    from refdl.perf.muon import matrices
    from refdl.perf.prediction import predict_steps
    from refdl.perf.shapes import parse_shape, register
    from refdl.perf.zoo import TRANSFORMERS
    from refdl.strategies import traits_of

    shape = parse_shape("layers=32,d_model=4096,heads=32,kv_heads=8,ffn=14336,experts=8,"
                        "top_k=2,glu=1,shared_experts=1", 4096)  # fmt: skip
    name = register(shape)

    class Cost:
        transformer = shape

    banks = [k for k, a, b in matrices(Cost, 8) if (a, b) in ((4096, 14336), (14336, 4096))]
    assert banks == [32.0, 32.0, 32.0, 32, 32, 32]  # 8 experts / 8 + the shared expert

    def muon_s(mesh: str) -> float:
        def step(mu: str | None) -> float:
            o = PredictOptions(mesh=mesh, muon=mu, optimizer_words=1, microbatches=1)
            return predict_steps("h100-nvlink-ib-ndr", "hybrid", traits_of("hybrid"), name, 512,
                                 [64], opts=o, precision="bf16")[0]["step_time_s"]  # fmt: skip

        return step("gather") - step(None)

    assert muon_s("data=8,expert=8") < muon_s("data=64") / 4
    assert TRANSFORMERS.get(name).shape.shared_experts == 1
