"""refdl held against PyTorch's own parallelism, step by step (issue 48): FSDP2, DTensor
tensor and sequence parallelism, the two on a 2-D mesh, every pipelining schedule, a
mixture of experts over all_to_all_single, and D-PSGD over isend/irecv.

Each twin runs in fp64 (both sides float64: refdl under JAX's 64-bit mode, the twin in
torch.float64), where the only difference left is summation order: every case below
keeps the parameters' relative L2 under 1e-12 (measured 2e-17 to 4e-15, 2026-11-26;
docs/validation.md's table), so a planted bug - a realistic mistake switched on in
PyTorch's side - is caught by a margin of 10^9 and more, and ``refdl validate`` exits 1
naming the step and the parameter. The default run keeps the cheapest twin in fp64 and
the one-line refusals; ``-m slow`` runs every acceptance command of the issue in fp32 and
fp64 and every planted bug (scripts/bench_referee.py runs them all too).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed (bash scripts/setup.sh does)")

from refdl.validate import __main__ as VM  # noqa: E402
from refdl.validate import exact as V  # noqa: E402
from refdl.validate.request import Request  # noqa: E402

# (validate's flags, the PyTorch API it must name in framework_impl)
TWINS = {
    "fsdp": (["--strategy", "fsdp", "--zero", "3", "--devices", "2", "--model",
              "transformer"], "fully_shard"),
    "fsdp-zero1": (["--strategy", "fsdp", "--zero", "1", "--devices", "2", "--model", "mlp"],
                   "ZeroRedundancyOptimizer"),
    "model-sp": (["--strategy", "model", "--devices", "2", "--model", "transformer",
                  "--sequence-parallel"], "SequenceParallel"),
    "model": (["--strategy", "model", "--devices", "2", "--model", "mlp"], "RowwiseParallel"),
    "hybrid-2d": (["--strategy", "hybrid", "--devices", "4", "--mesh", "fsdp=2,model=2",
                   "--model", "mlp"], "init_device_mesh 2x2"),
    "zbv": (["--strategy", "pipeline", "--devices", "2", "--schedule", "zbv", "--model",
             "mlp"], "ScheduleZBVZeroBubble"),
    "dualpipev": (["--strategy", "pipeline", "--devices", "2", "--schedule", "dualpipev",
                   "--model", "mlp"], "ScheduleDualPipeV"),
    "interleaved": (["--strategy", "pipeline", "--devices", "2", "--schedule", "interleaved",
                     "--chunks", "2", "--model", "mlp"], "ScheduleInterleaved1F1B"),
    "experts": (["--strategy", "hybrid", "--devices", "4", "--mesh", "data=2,expert=2",
                 "--model", "moe"], "all_to_all_single"),
    "gossip": (["--strategy", "decentralized", "--workers", "4", "--topology", "ring",
                "--model", "mlp"], "isend"),
    "gossip-torus": (["--strategy", "decentralized", "--workers", "4", "--topology", "torus",
                      "--model", "mlp"], "isend"),
}  # fmt: skip
DEFAULT = {("model", "fp64")}  # the cheapest twin (2 processes, mlp, 3 steps)


def validate(flags: list[str]) -> dict:
    """refdl validate in this process (8 simulated devices: tests/conftest.py)."""
    args = VM.build_parser().parse_args(["--framework", "torch", *flags])
    return V.validate(Request.of(vars(args)))


@pytest.mark.parametrize(
    "name,precision",
    [pytest.param(n, p, id=f"{n}-{p}", marks=() if (n, p) in DEFAULT else pytest.mark.slow)
     for n in TWINS for p in ("fp32", "fp64")],
)  # fmt: skip
def test_twin_matches_refdl(name, precision):
    flags, api = TWINS[name]
    steps = "3" if (name, precision) in DEFAULT else "10"
    r = validate([*flags, "--steps", steps, "--precision", precision])
    assert r["passed"], (r["failed"], r["checks"])
    assert api in r["framework_impl"], r["framework_impl"]
    assert r["precision"] == precision
    if precision == "fp64":
        assert r["param_rel_l2_diff"] < 1e-12 and r["loss_max_rel_diff"] < 1e-12, r["checks"]


# (twin's flags, the bug planted in PyTorch's side)
BUGS = {
    "divide": ["--strategy", "fsdp", "--zero", "2", "--devices", "2", "--model", "mlp"],
    "rowwise": ["--strategy", "model", "--devices", "2", "--model", "mlp"],
    "microbatch-scale": ["--strategy", "pipeline", "--devices", "2", "--schedule", "1f1b",
                         "--model", "mlp"],
    "expert-return": ["--strategy", "hybrid", "--devices", "4", "--mesh", "data=2,expert=2",
                      "--model", "moe"],
    "mixing": ["--strategy", "decentralized", "--workers", "4", "--model", "mlp"],
}  # fmt: skip


@pytest.mark.parametrize("bug", [pytest.param(b, marks=pytest.mark.slow) for b in BUGS])
def test_a_planted_bug_fails_the_comparison(bug, capsys):
    """refdl validate exits 1 and names the first failing step and the parameter that
    differs most."""
    code = VM.main(["--framework", "torch", *BUGS[bug], "--steps", "3", "--plant-bug", bug,
                    "--json"])  # fmt: skip
    assert code == 1
    r = json.loads(capsys.readouterr().out)
    assert not r["passed"] and r["first_failing_step"] is not None
    assert r["param_rel_l2_diff"] > 1e-3  # 10^8 past fp32's tolerance of the twin's
    assert r["worst_tensor"]


def test_bad_twin_options_are_one_line(capsys):
    for flags, words in [
        (["--strategy", "hybrid", "--mesh", "data=2,pipe=2", "--devices", "4"],
         "composes data, fsdp, model and expert axes; --mesh has pipe"),
        (["--strategy", "fsdp", "--plant-bug", "nonsense"], "--plant-bug nonsense: choose"),
        (["--framework", "mxnet", "--precision", "fp64"], "--precision fp64 compares"),
    ]:  # fmt: skip
        assert VM.main([*flags, "--steps", "1"]) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and words in lines[0], err
