"""Cross-framework validation (real PyTorch), Deep500 metrics, recipes and bench compare.

PyTorch tests skip with the reason when torch is absent; ``scripts/setup.sh``
installs it. Tolerances are refdl.validate's (stated there and in the README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from refdl.bench import metrics as M
from refdl.bench import recipes as R
from refdl.errors import UsageError
from refdl.validate.request import Request

torch = pytest.importorskip("torch", reason="PyTorch not installed (bash scripts/setup.sh does)")

from refdl.adapters import torch as A  # noqa: E402
from refdl.adapters.torch import models as AM  # noqa: E402
from refdl.validate import __main__ as VM  # noqa: E402
from refdl.validate import exact as V  # noqa: E402


def _args(**kw):
    """The Request refdl validate makes of these flags (the library takes no Namespace)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    return Request.of(vars(VM.build_parser().parse_args(flags)))


def run_module(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


# ----------------------------------------------------------------------------- adapter


@pytest.mark.parametrize(
    "model",
    [
        "mlp",
        pytest.param("lenet5", marks=pytest.mark.slow),  # slow: the suite's 15 min
        pytest.param("resnet", marks=pytest.mark.slow),
        "lstm_lm",
        pytest.param("transformer", marks=pytest.mark.slow),  # 10 s (the suite's 15 min)
    ],
)
def test_converted_model_computes_refdls_forward_pass(model):
    import jax.numpy as jnp

    from refdl.config.spec import RunSpec
    from refdl.run.build import build

    run = build(RunSpec(model=model, progress=False))
    state = run.task.init_state(0)
    batch = run.batch(0)
    ours, _ = run.task.model.apply(state.params, state.model_state, jnp.asarray(batch["x"]))
    plan = A.ModelPlan.of(run.task.model, run.task.sample_x)
    theirs = plan.build(A.flatten(state.params)).eval()(torch.from_numpy(batch["x"]))
    np.testing.assert_allclose(theirs.detach().numpy(), np.asarray(ours), rtol=1e-4, atol=1e-5)
    # and the weights come back unchanged through PyTorch's layouts
    back = A.export(plan.build(A.flatten(state.params)))
    for k, v in A.flatten(state.params).items():
        np.testing.assert_array_equal(back[k], v)


def test_same_padding_puts_the_odd_pixel_high_like_xla():
    assert AM._same_pads(8, 3, 2) == (0, 1)
    assert AM._same_pads(8, 5, 1) == (2, 2)
    assert AM._same_pads(7, 2, 2) == (0, 1)


@pytest.mark.parametrize(
    "model",
    [
        "mlp",
        "lenet5",
        pytest.param("resnet", marks=pytest.mark.slow),
        "lstm_lm",
        pytest.param("transformer", marks=pytest.mark.slow),
    ],
)
def test_validate_single_passes_for_each_model(model):
    r = V.validate(_args(strategy="single", model=model, steps=3))
    assert r["passed"], r["failed"]
    assert r["checks"]["first_loss_rel"] < 1e-5
    assert r["checks"]["first_update_param_rel_l2"] < 1e-5
    assert len(r["torch_loss"]) == 3
    d = r["deep500"]
    assert d["MaxError"] == r["param_max_abs_diff"]
    assert d["L2Error"] == pytest.approx(r["param_rel_l2_diff"] * r["param_l2_norm"], rel=1e-9)
    assert d["MaxError"] <= d["L2Error"] <= d["NormDifference"]  # |x|_inf <= |x|_2 <= |x|_1


@pytest.mark.slow
def test_validate_ddp_matches_refdl_data():
    r = V.validate(_args(strategy="data", model="lenet5", steps=3, devices=2))
    assert r["passed"], r["failed"]
    assert r["checks"]["param_rel_l2"] < 1e-6  # observed 4e-8


@pytest.mark.slow
def test_validate_pipelining_matches_refdl_pipeline():
    r = V.validate(_args(strategy="pipeline", model="mlp", steps=3, schedule="gpipe"))
    assert r["passed"], r["failed"]
    assert r["stage_boundaries"] == [2] and r["microbatches"] == 4
    assert r["checks"]["param_rel_l2"] < 1e-6


@pytest.mark.slow  # heavy for the default run on 2 cores (-m slow runs it)
def test_perturbed_pytorch_side_fails_with_a_readable_report():
    proc = run_module("refdl.validate", "--strategy", "single", "--model", "mlp", "--steps", "3",
                      "--perturb", "1e-3")  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    out = proc.stdout
    assert "FAIL first loss" in out and "FAIL parameters after 1 update" in out
    assert out.strip().splitlines()[-1].startswith("FAILED: torch and refdl differ")


def test_native_batchnorm_is_refused_for_ddp():
    with pytest.raises(UsageError, match="SyncBatchNorm runs only on GPUs"):
        V.validate(_args(strategy="data", model="resnet", steps=1, torch_batchnorm="native"))


def test_validate_cli_json_and_bad_input(capsys):
    code = VM.main(["--framework", "torch", "--strategy", "single", "--model", "mlp",
                   "--steps", "3", "--json"])  # fmt: skip
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] and len(r["loss_abs_diff"]) == 3
    assert set(r["deep500"]) == {"NormDifference", "L2Error", "MaxError"}
    # a planted bug lives in the twins it names (tests/validate/test_torch_twins.py)
    bad = run_module("refdl.validate", "--strategy", "fsdp", "--model", "mlp", "--plant-bug",
                     "rowwise")  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "refdl.validate: error: --plant-bug rowwise is planted in the model, hybrid twin, "
        "not in --strategy fsdp's"
    )


@pytest.mark.slow  # slow since 2026-11-26 (the default suite's 15 min)
def test_results_report_on_a_real_pytorch_log(tmp_path, capsys):
    """A PyTorch training log (written by the adapter from refdl's start, and saying so with
    the start's fingerprint) compared exactly with refdl's reference."""
    from refdl.config.spec import RunSpec
    from refdl.validate.export import start_of, start_spec

    ref = V.reference_run(RunSpec(model="mlp", steps=6, progress=False))
    plan = A.TrainPlan(model=ref.plan, params=ref.init_params, batches=tuple(ref.batches),
                       lrs=tuple(ref.lrs), optimizer=ref.spec.optimizer)  # fmt: skip
    res = A.train_single(plan)
    config = {"model": "mlp", "strategy": "single", "batch_size": 64, "steps": 6, "hw": "local"}
    config["start"] = start_of(start_spec(config))[3]
    log = tmp_path / "torch.jsonl"
    lines = [json.dumps({"config": config})]
    pairs = zip(res.losses, res.step_times, strict=True)
    lines += [
        json.dumps({"step": t, "loss": v, "samples_per_s": 64 / dt})
        for t, (v, dt) in enumerate(pairs)
    ]
    log.write_text("\n".join(lines) + "\n")
    out = tmp_path / "report"
    assert VM.main(["--results", str(log), "--report", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["comparison"] == "exact"
    assert rep["steps_compared"] == 6 and rep["loss_max_rel_diff"] < 1e-5
    assert rep["samples_per_s"]["predicted"] > 0 and rep["samples_per_s"]["framework"] > 0
    assert "PASSED" in (out / "report.md").read_text()
    # a log whose losses are off fails, as CSV too
    csv = tmp_path / "off.csv"
    csv.write_text(f"# config: {json.dumps(config)}\nstep,loss\n"
                   + "".join(f"{t},{v * 1.01}\n" for t, v in enumerate(res.losses)))  # fmt: skip
    capsys.readouterr()
    assert VM.main(["--results", str(csv)]) == 1
    assert "FAILED" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"config": {"model": "mlp", "dtype": "int8"}}\n{"step": 0, "loss": 1}\n')
    assert VM.main(["--results", str(bad)]) == 2
    assert "configuration dtype must be one of float32" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "data", "pipeline"])
@pytest.mark.parametrize("model", ["mlp", "lenet5", "resnet", "lstm_lm"])
def test_validate_passes_20_steps(strategy, model):
    """The acceptance matrix: 20 steps, every strategy x model, default tolerances."""
    proc = run_module("refdl.validate", "--framework", "torch", "--strategy", strategy,
                      "--model", model, "--steps", "20", "--json", timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout)["passed"]


# ----------------------------------------------------------------------------- metrics


def test_deep500_errors_by_hand():
    a, b = np.array([1.0, 2.0, 3.0]), np.array([1.0, 0.0, 7.0])
    e = M.deep500_errors(a, b)
    assert e["NormDifference"] == pytest.approx(6.0)  # |0| + |2| + |-4|
    assert e["L2Error"] == pytest.approx(np.sqrt(20.0))
    assert e["MaxError"] == pytest.approx(4.0)
    c = V.compare_params({"w": a}, {"w": b})
    assert c["rel_l2"] == pytest.approx(np.sqrt(20.0) / np.sqrt(14.0))


def test_speedup_and_efficiency_as_jaeger_define_them():
    s = M.speedup({1: 100.0, 2: 180.0, 4: 300.0})
    assert s[2] == {"Speedup": 1.8, "ScalingEfficiency": 0.9}
    assert s[4]["ScalingEfficiency"] == pytest.approx(0.75)
    with pytest.raises(ValueError):
        M.speedup({2: 1.0})


def test_time_to_accuracy_and_run_metrics():
    rows = [{"step": 10, "elapsed_s": 1.0, "test_accuracy": 0.5},
            {"step": 20, "elapsed_s": 2.5, "test_accuracy": 0.93},
            {"step": 30, "elapsed_s": 3.0, "test_accuracy": 0.97}]  # fmt: skip
    assert M.time_to_accuracy(rows, 0.9) == 2.5
    assert M.time_to_accuracy(rows, 0.99) is None
    m = M.from_run({"steps": 30, "comm_bytes_per_step": 100, "wall_time_s": 4.0}, rows, 0.95)
    assert m["CommunicationVolume"] == 3000 and m["TimeToAccuracy"] == 3.0
    assert m["BubbleFraction"] is None


# ----------------------------------------------------------------------------- recipes


def _recipe(tmp_path, acceptable: str, extra: str = ""):
    p = tmp_path / "r.toml"
    p.write_text(f"""[recipe]
name = "t"
[fixed]
model = "mlp"
steps = 30
eval_every = 15
{extra}
[mutable]
strategy = "single"
lr = 0.05
[acceptable]
{acceptable}
[options]
target_accuracy = 0.5
""")
    return p


def test_recipe_errors_name_the_key(tmp_path):
    with pytest.raises(UsageError, match="Accuracy is not a metric"):
        R.load(_recipe(tmp_path, "Accuracy = { min = 1 }"))
    with pytest.raises(UsageError, match=r"needs \{ min"):
        R.load(_recipe(tmp_path, "TestAccuracy = 0.9"))
    r = R.load(_recipe(tmp_path, "TestAccuracy = { min = 0.5 }"))
    with pytest.raises(UsageError, match="steps is fixed by the recipe"):
        r.settings({"steps": "5"})
    with pytest.raises(UsageError, match="no mutable key 'devices'"):
        r.settings({"devices": "2"})
    assert r.settings({"lr": "0.1"})["lr"] == 0.1
    argv, ranks = R.train_argv({"model": "mlp", "data_opt": ["a=1", "b=2"], "ranks": 3}, "/o")
    assert ranks == 3 and argv[-4:] == ["--data-opt", "a=1", "--data-opt", "b=2"]


def test_a_recipe_whose_settings_are_refused_leaves_no_folder(tmp_path):
    ok = _recipe(tmp_path, "TestAccuracy = { min = 0.5 }")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "refdl.bench", "run", str(ok), "--set",
                           "strategy=warp"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "TMPDIR": str(scratch)})  # fmt: skip
    assert proc.returncode == 2 and "refused its settings" in proc.stderr
    assert list(scratch.iterdir()) == []  # the run folder it made, removed


@pytest.mark.slow
def test_recipe_passes_and_an_impossible_threshold_exits_1(tmp_path):
    ok = _recipe(tmp_path, "TestAccuracy = { min = 0.5 }\nTimeToAccuracy = { max = 600 }")
    proc = run_module("refdl.bench", "run", str(ok), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert res["passed"] and res["metrics"]["TestAccuracy"] > 0.5
    assert res["metrics"]["TrainingAccuracy"] > 0.5 and res["metrics"]["TimeToAccuracy"] > 0
    impossible = tmp_path / "impossible.toml"
    impossible.write_text(ok.read_text().replace("min = 0.5", "min = 1.01"))
    proc = run_module("refdl.bench", "run", str(impossible))
    assert proc.returncode == 1
    assert "MISSED" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("FAILED")
    proc = run_module("refdl.bench", "run", str(ok), "--set", "strategy=warp")
    assert proc.returncode == 2 and "refused its settings" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["single", "data", "model", "pipeline", "hybrid", "ps", "decentralized"]
)
def test_shipped_digits_recipe_passes(name):
    proc = run_module("refdl.bench", "run", f"recipes/digits-{name}.toml", timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_every_shipped_recipe_loads():
    files = sorted((ROOT / "recipes").glob("*.toml"))
    assert len(files) >= 10
    names = {R.load(f).name for f in files}
    assert {f"digits-{s}" for s in ("single", "data", "model", "pipeline", "hybrid", "ps",
                                    "decentralized")} <= names  # fmt: skip


# ----------------------------------------------------------------------------- compare


@pytest.mark.slow
def test_bench_compare_writes_json_and_png(tmp_path):
    proc = run_module("refdl.bench", "compare", "--frameworks", "refdl,torch", "--model", "mlp",
                      "--strategy", "data", "--devices", "1,2", "--steps", "6", "--warmup", "2",
                      "--rounds", "1", "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads((tmp_path / "compare_mlp_data.json").read_text())
    assert [row["devices"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        assert row["refdl_samples_per_s"] > 0 and row["torch_samples_per_s"] > 0
        assert row["refdl_vs_torch"] == pytest.approx(
            row["refdl_samples_per_s"] / row["torch_samples_per_s"]
        )
    assert (tmp_path / "compare_mlp_data.png").stat().st_size > 1000


@pytest.mark.slow
def test_bench_compare_on_a_busy_machine_warns_with_the_load_and_the_spread():
    """Two processes spinning on the 2 cores while bench compare measures: a warning names
    the load (and the JSON records it, trusted false); --strict makes it exit 1."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]  # fmt: skip
    try:
        proc = run_module("refdl.bench", "compare", "--model", "mlp", "--strategy", "single",
                          "--devices", "1", "--steps", "12", "--warmup", "2", "--rounds", "2",
                          "--json", "--strict")  # fmt: skip
    finally:
        for h in hogs:
            h.kill()
    assert proc.returncode == 1, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["trusted"] is False and r["others_load_cores"]["during"] > 0.5
    assert r["others_load_cores"]["before"] > 0.5
    assert set(r["spread"]) == {"refdl on 1", "torch on 1"}
    lo, hi = r["rows"][0]["refdl_vs_torch_range"]
    assert lo <= r["rows"][0]["refdl_vs_torch"] <= hi
    warning = [ln for ln in proc.stderr.splitlines() if "warning: the ratio cannot be" in ln]
    assert len(warning) == 1 and "other processes used" in warning[0]


def test_bench_compare_refuses_unknown_frameworks():
    bad = run_module("refdl.bench", "compare", "--frameworks", "refdl,tf")
    assert bad.returncode == 2 and "--frameworks" in bad.stderr


@pytest.mark.slow  # heavy for the default run on 2 cores (-m slow runs it)
def test_bench_compare_times_refdl_as_the_loop_waits():
    """--sync-every 3 over 7 steps: the first step alone, then two windows of 3, each step
    carrying its window's mean; single-device PyTorch runs in a process of its own."""
    from refdl.bench.compare import refdl_step_times

    t = refdl_step_times("mlp", "single", 1, 7, 16, sync_every=3)
    assert len(t) == 7 and all(x > 0 for x in t)
    assert t[1] == t[2] == t[3] and t[4] == t[5] == t[6]
    proc = run_module("refdl.bench", "compare", "--model", "mlp", "--strategy", "single",
                      "--devices", "1", "--steps", "7", "--warmup", "1", "--rounds", "1",
                      "--sync-every", "3", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["refdl_sync_every"] == 3 and r["rows"][0]["devices"] == 1
    assert r["rows"][0]["torch_samples_per_s"] > 0
    bad = run_module("refdl.bench", "compare", "--strategy", "single", "--devices", "1",
                     "--sync-every", "0")  # fmt: skip
    assert bad.returncode == 2 and "--sync-every" in bad.stderr


def test_a_logs_own_mistakes_are_answered_before_jax_loads(tmp_path):
    """Issue 54: every bad log of the reliability harness must get its line within a
    second; refdl validate loaded JAX, torch and the comparisons first (4-5 s here). The
    log's own checks now come before (0.1-0.6 s on 2026-11-27)."""
    far = tmp_path / "far.jsonl"
    far.write_text('{"config": {"model": "mlp"}}\n{"step": 0, "loss": 2.3}\n'
                   '{"step": 999999999, "loss": 2.3}\n')  # fmt: skip
    code = ("import sys\nfrom refdl.validate.__main__ import main\n"
            f"rc = [main(['--results', p]) for p in ({str(far)!r}, 'missing.jsonl')]\n"
            "print(rc, 'jax' in sys.modules, 'torch' in sys.modules)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.stdout.split() == ["[2,", "2]", "False", "False"], proc.stdout + proc.stderr
    assert "more than the 100,000 refdl reruns" in proc.stderr


def test_a_logs_momentum_beside_adam_is_warned_of_not_refused():
    """Frameworks may record momentum whatever the optimizer: refdl's rerun drops it and
    says so (a RunSpec refuses momentum beside Adam)."""
    from refdl.validate.results import _spec, declared

    config = {"model": "mlp", "optimizer": "adam", "momentum": 0.5}
    assert _spec(config, 5).momentum == 0.9  # the default: not given to Adam
    assert "momentum 0.5: ignored, the optimizer adam has no heavy ball" in declared(config)[1]
    heavy = {"model": "mlp", "optimizer": "momentum", "momentum": 0.5}
    assert _spec(heavy, 5).momentum == 0.5 and not declared(heavy)[1]
    assert _spec({"model": "lstm_lm", "momentum": 0.5}, 5).momentum == 0.9  # its own: adam


@pytest.mark.slow  # 25 s: six models built and converted (the suite's 15 min)
def test_the_models_said_to_hold_a_batchnorm_are_those_whose_twin_holds_one():
    # validate refuses --torch-batchnorm native for the others: the list must be the truth
    from refdl.config.spec import RunSpec
    from refdl.run.build import build
    from refdl.validate.exact import BATCHNORM_MODELS, COVERS

    held = []
    for model in COVERS["torch"][1]:
        run = build(RunSpec(model=model, progress=False))
        state = run.task.init_state(0)
        plan = A.ModelPlan.of(run.task.model, run.task.sample_x)
        module = plan.build(A.flatten(state.params))
        if any(isinstance(m, torch.nn.BatchNorm2d) for m in module.modules()):
            held.append(model)
    assert tuple(held) == BATCHNORM_MODELS == ("resnet",)
