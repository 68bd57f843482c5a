"""Adding a strategy is one module plus its registration: a small strategy written and
registered in this test alone - its traits carrying its own option check and naming its
own cost formula - runs through ``refdl train``, ``refdl validate`` (exact, against
PyTorch's plain training, which is single's twin) and ``refdl predict``, and no file of
refdl knows its name. Its parameters equal single's (``assert_equivalent``)."""

from __future__ import annotations

import functools
import json

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.config.plan import Plan, Traits
from refdl.config.spec import RunSpec
from refdl.errors import UsageError
from refdl.perf.costs import FORMULAS
from refdl.strategies import STRATEGIES, Strategy, register
from refdl.testing import assert_equivalent

NAME = "gspmd_data"  # a name nothing in src/ mentions (checked below)
COST = f"{NAME}_cost"


def at_most_four(spec: RunSpec, plan: Plan) -> None:
    """Its own rule, run by the planner with everyone else's: at most 4 replicas."""
    if plan.mesh.data > 4:
        raise UsageError(f"--strategy {NAME} keeps at most 4 replicas, not {plan.mesh.data}")


def cost(m, hw, batch, workers, opts):
    """Its own cost formula: data parallelism's (XLA's partitioner inserts the same
    allreduce)."""
    return FORMULAS.get("data_parallel")(m, hw, batch, workers, opts)


class GspmdData(Strategy):
    """Data parallelism left to XLA's partitioner: the state replicated, the batch split on
    ``data``; ``Task.step`` jitted with those shardings, no collective written by hand."""

    traits = Traits(axes=("data",), options=frozenset({"mesh"}), multiprocess="spmd",
                    checks=(at_most_four,), cost=COST)  # fmt: skip

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        mesh = plan.mesh.make(devices)
        self.replicated = NamedSharding(mesh, P())
        step = functools.partial(task.step, microbatches=plan.microbatches)
        self._step = self.jit(step, donate_argnums=0,
                              in_shardings=(self.replicated, NamedSharding(mesh, P("data"))),
                              out_shardings=self.replicated)  # fmt: skip

    def place_state(self, host_state):
        return jax.device_put(host_state, self.replicated)

    def train_step(self, state, batch):
        return self._step(state, batch)


@pytest.fixture(scope="module")
def registered():
    register(NAME)(GspmdData)
    FORMULAS.register(COST)(cost)
    yield NAME
    STRATEGIES.unregister(NAME)
    FORMULAS.unregister(COST)


def test_no_file_of_refdl_knows_the_name():
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src" / "refdl"
    assert not [f for f in src.rglob("*.py") if NAME in f.read_text()]


def test_its_parameters_equal_singles(registered):
    report = assert_equivalent(
        RunSpec(strategy=NAME, devices=4, model="mlp", batch_size=32, steps=6),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    assert report.max_abs < 1e-5


def test_train_runs_it_and_refuses_options_it_does_not_declare(registered, tmp_path, capsys):
    from refdl.train import main

    out = tmp_path / "run"
    code = main(["--strategy", NAME, "--model", "mlp", "--devices", "2", "--steps", "12",
                 "--out", str(out), "--no-progress"])  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == NAME and summary["steps"] == 12
    assert summary["test_accuracy"] > 0.5  # it trains: 10 classes, chance is 0.1
    assert main(["--strategy", NAME, "--zero", "3", "--out", str(tmp_path / "no")]) == 2
    assert (
        f"--zero is an option of --strategy fsdp, not of --strategy {NAME}"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "no").exists()
    assert main(["--strategy", NAME, "--devices", "8", "--out", str(tmp_path / "eight")]) == 2
    assert f"--strategy {NAME} keeps at most 4 replicas, not 8" in capsys.readouterr().err
    assert not (tmp_path / "eight").exists()


@pytest.mark.skipif(not __import__("refdl.adapters.torch", fromlist=["available"]).available(),
                    reason="PyTorch is not installed")  # fmt: skip
def test_validate_compares_it_exactly_with_plain_pytorch(registered, capsys):
    from refdl.validate.__main__ import main

    code = main(["--framework", "torch", "--strategy", NAME, "--model", "mlp", "--steps", "5",
                 "--devices", "2", "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report["failed"]
    assert report["strategy"] == NAME and report["framework_impl"] == "plain PyTorch"
    assert report["param_rel_l2_diff"] < 1e-4 and report["loss_max_rel_diff"] < 1e-4


def test_predict_asks_its_traits(registered, capsys):
    rows = json.loads(_predict_json(NAME, capsys))
    data = json.loads(_predict_json("data", capsys))
    assert [r["step_time_s"] for r in rows] == [r["step_time_s"] for r in data]
    assert rows[0]["speedup"] == 1.0 and rows[2]["speedup"] > rows[1]["speedup"] > 1.0


def _predict_json(strategy: str, capsys) -> str:
    from refdl.predict import main

    assert main(["--hw", "p100-nvlink", "--strategy", strategy, "--model", "resnet50",
                 "--batch-size", "64", "--workers", "1,2,4", "--json"]) == 0  # fmt: skip
    return capsys.readouterr().out
