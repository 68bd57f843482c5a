"""Every degree, divisibility and option check, in one place, without devices or data:
the model is given as shapes (``ModelShape``), the strategies by their ``Traits``."""

from __future__ import annotations

import dataclasses
import re

import pytest

from refdl.config.mesh import MeshSpec
from refdl.config.plan import Layer, ModelShape, balance, check_batch, plan
from refdl.config.rules import TENSOR_RULES
from refdl.config.spec import RunSpec
from refdl.errors import UsageError
from refdl.strategies import STRATEGIES

# The strategies as they declare themselves (the one place a strategy's traits are written).
OWNERS = {name: STRATEGIES.get(name).traits for name in STRATEGIES}
PS = OWNERS["ps"]


# An MLP 64 -> 24 -> 10 as shapes: layer 0 flattens, 1 and 2 are dense (Megatron axes).
MLP = ModelShape(
    "mlp",
    (
        Layer("00_flatten", {}),
        Layer("01_dense", {"kernel": ((64, 24), ("embed", "mlp")), "bias": ((24,), ("mlp",))}),
        Layer("02_dense", {"kernel": ((24, 10), ("mlp", None)), "bias": ((10,), (None,))}),
    ),
    train_size=1437,
)


def check(strategy: str, ranks: int = 1, model: ModelShape = MLP, **kw):
    spec = RunSpec(strategy=strategy, model=model.name, **kw).validate()
    return plan(spec, strategy, OWNERS[strategy], model, ranks=ranks, owners=OWNERS)


def refused(message: str, strategy: str, **kw) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        check(strategy, **kw)


def test_plans_of_every_kind():
    assert check("single").mesh == MeshSpec()
    assert check("data", devices=4).mesh == MeshSpec(data=4)
    assert check("model", devices=2).mesh == MeshSpec(model=2)
    p = check("hybrid", devices=8, mesh="data=2,model=2,pipe=2", microbatches=2)
    assert p.mesh == MeshSpec(2, 2, 2) and p.microbatches == 2 and p.cuts == (2,)
    assert p.rules == TENSOR_RULES and p.batch_axes == "data"
    pipe = check("pipeline", devices=2)
    assert pipe.microbatches == 4 and pipe.cuts == (2,)  # pipelines default to 4 microbatches
    sim = check("ps", simulate=True, workers=4)
    assert (sim.mode, sim.workers, sim.servers) == ("simulate", 4, 1)
    mpi = check("ps", ranks=4, servers=2, devices=4)
    assert (mpi.mode, mpi.workers, mpi.servers) == ("mpi", 2, 2)


@pytest.mark.parametrize(
    "strategy,kw,message",
    [
        ("single", {"devices": 2}, "--strategy single runs on one device, not 2"),
        ("data", {"devices": 4, "mesh": "data=2,model=2"},
         "--strategy data splits over data, not model"),
        ("data", {"devices": 4, "batch_size": 30},
         "--batch-size 30 does not split into 4 shards x 1 microbatches; use a multiple of 4"),
        ("data", {"devices": 2, "microbatches": 4, "batch_size": 12},
         "use a multiple of 8 (e.g. 8 or 16)"),
        ("data", {"devices": 6, "batch_size": 60, "allreduce": "halving-doubling"},
         "needs a power-of-two data degree, not 6"),
        ("model", {"devices": 5, "batch_size": 60}, "5-way split of layer 01_dense's mlp width 24"),
        ("model", {"devices": 16}, "16-way split of layer 01_dense's mlp width 24 (parameter"),
        ("single", {"allreduce": "ring"},
         "--allreduce is an option of --strategy data, decentralized, not of --strategy single"),
        ("data", {"devices": 2, "preset": "owt"},
         "--preset is an option of --strategy hybrid, not of --strategy data"),
        ("hybrid", {"devices": 8, "mesh": "data=2,model=2,pipe=2", "preset": "owt"},
         "--preset owt does not combine with pipe > 1"),
        ("pipeline", {"devices": 4}, "4 stages x 1 chunks = 4 need at least as many layers"),
        ("pipeline", {"devices": 2, "chunks": 2}, "--chunks 2 needs --schedule interleaved"),
        ("pipeline", {"devices": 2, "stages": 3}, "--stages 3 needs --devices 3"),
        ("pipeline", {"devices": 2, "stage_boundaries": (2, 1)},
         "need 1 increasing layer indices between 1 and 2"),
        ("pipeline", {"devices": 2, "schedule": "interleaved", "microbatches": 3, "batch_size": 66},
         "microbatches divisible by stages (3 % 2 != 0)"),
        ("data", {"devices": 2, "batch_size": 2000}, "--batch-size 2000 is larger than the 1437"),
        ("ps", {}, "--strategy ps needs server and worker ranks"),
        ("ps", {"simulate": True, "workers": 3}, "into 3 worker shares of 1 microbatches"),
        ("ps", {"simulate": True, "workers": 8, "servers": 7},
         "the model has only 4 parameter arrays"),
        ("ps", {"simulate": True, "servers": 5}, "--servers 5 is more than the 4 simulated"),
        ("ps", {"simulate": True, "straggler": "0:1"},
         "rank 0 is not a worker (workers are ranks 1..4)"),
    ],
)  # fmt: skip
def test_bad_plans_are_one_line_errors(strategy, kw, message):
    refused(message, strategy, **kw)


def test_under_mpirun():
    assert check("data", ranks=4, devices=4).mode == "spmd"  # one runtime over the ranks
    with pytest.raises(UsageError, match="runs in one process; launch it without mpirun"):
        check("single", ranks=2, devices=2)
    with pytest.raises(UsageError, match="--servers 4 leaves no worker among 4 ranks"):
        check("ps", ranks=4, servers=4, devices=4)
    with pytest.raises(UsageError, match="pipe > 1 runs its stages from one host process"):
        check("hybrid", ranks=4, devices=4, mesh="data=2,pipe=2")


def test_batch_statistics_refused_where_workers_keep_them():
    bn = dataclasses.replace(MLP, name="resnet", batch_stats=True)
    with pytest.raises(UsageError, match="does not support resnet"):
        check("ps", model=bn, simulate=True)
    check("data", model=bn, devices=2)


def test_check_batch_and_balance_by_hand():
    check_batch(64, 4, 2)
    with pytest.raises(UsageError, match=r"use a multiple of 8 \(e\.g\. 56 or 64\)"):
        check_batch(60, 4, 2)
    with pytest.raises(UsageError, match="--microbatches must be >= 1"):
        check_batch(64, 1, 0)
    assert balance([1, 1, 1, 1], 2) == [2]
    assert balance([10, 1, 1, 1, 1, 10], 3) == [1, 5]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1]  # the largest group is 5 either way: first cut


def test_a_resumed_runs_own_pipeline_options_without_stages_are_kept():
    # refused for a new run since 2026-11-28 (they change nothing); a run started with
    # them before resumes as it was started (tests/run/test_resume_old_settings.py)
    kw = {"devices": 2, "mesh": "data=2", "stage_boundaries": (2,)}
    refused("--stage-boundaries 2 needs pipeline stages (pipe > 1)", "hybrid", **kw)
    assert check("hybrid", resume="runs/old", **kw).mesh.data == 2
    # what only a command line sets (where a plot goes) is not the run's own
    refused("--plot-schedule s.png needs pipeline stages", "hybrid", resume="runs/old",
            plot_schedule="s.png", **kw)  # fmt: skip
    # nor are momentum and a step decay the run's own on a new run
    with pytest.raises(UsageError, match="momentum sets the heavy ball"):
        RunSpec(optimizer="adam", momentum=0.5).validate()
    assert RunSpec(optimizer="adam", momentum=0.5, lr_decay_every=5, resume="r").validate()
