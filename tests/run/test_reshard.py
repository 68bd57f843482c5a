"""``--resume RUN --reshard``: a checkpoint of one synchronous strategy and mesh continues
under another strategy, mesh or device count, on the trajectory one device would take.

A hybrid data=2 x model=2 run of 20 steps on 4 devices, resumed as ZeRO-3 on 2 devices
and as ``single`` for 20 more, ends where 40 uninterrupted single-device steps end, its
optimizer state with it; the data order continues (it depends on the seed, the step and
the global batch only). With momentum, parameters and velocity to rtol 1e-5, atol 1e-6.
With Adam (lr 3e-3), to rtol 1e-5, atol 5e-5 and a relative L2 error below 1e-5: Adam
turns fp32 summation noise in a near-zero gradient into lr-sized steps, and the
uninterrupted hybrid run itself differs from ``single`` by 1.47e-5 in the same weights
(relative L2 1.7e-6; the resharded run 1.7e-6 too; 2026-11-26).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli, stderr_lines
from refdl.run.checkpoint import load_leaves

OPTIMIZERS = {
    "adam": (("--optimizer", "adam", "--lr", "0.003"), dict(rtol=1e-5, atol=5e-5)),
    "momentum": (("--optimizer", "momentum", "--lr", "0.05"), dict(rtol=1e-5, atol=1e-6)),
}
BASE = ("--model", "mlp", "--eval-every", "0", "--no-progress")


def ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


def state_of(out) -> dict[str, np.ndarray]:
    """Parameters and optimizer state of a run's newest checkpoint, by tree path."""
    return {k: v for k, v in load_leaves(out).items() if k.startswith((".params", ".opt_state"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(optimizer)``: the folder holding its hybrid run of 20 steps and its
    uninterrupted single run of 40 (made once)."""
    made = {}

    def get(optimizer: str):
        if optimizer not in made:
            d = tmp_path_factory.mktemp(optimizer)
            opt = OPTIMIZERS[optimizer][0]
            ok(run_cli("--strategy", "hybrid", "--devices", "4", "--mesh", "data=2,model=2",
                       *BASE, *opt, "--steps", "20", "--out", str(d / "hybrid")))  # fmt: skip
            ok(run_cli("--strategy", "single", *BASE, *opt, "--steps", "40",
                       "--out", str(d / "single")))  # fmt: skip
            made[optimizer] = d
        return made[optimizer]

    return get


@pytest.mark.slow  # 24 s: slow since 2026-11-26 (the default suite's time); refusals stay
@pytest.mark.parametrize("optimizer", ["adam", pytest.param("momentum", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            ("--strategy", "fsdp", "--zero", "3", "--devices", "2"), marks=pytest.mark.slow
        ),
        ("--strategy", "single"),
    ],  # fsdp: slow since 2026-11-26 (the default suite's 15 min)
    ids=["fsdp-zero3-2", "single"],
)
def test_a_resharded_run_continues_the_single_trajectory(runs, tmp_path, layout, optimizer):
    d, tol = runs(optimizer), OPTIMIZERS[optimizer][1]
    out = tmp_path / "continued"
    ok(run_cli("--resume", str(d / "hybrid"), "--reshard", *layout, "--steps", "40",
               "--out", str(out), "--no-progress"))  # fmt: skip
    got, want = state_of(out), state_of(d / "single")
    assert got.keys() == want.keys() and any(k.startswith(".opt_state") for k in got)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], err_msg=k, **tol)
    diff = sum(float(((got[k] - want[k]) ** 2).sum()) for k in want if k.startswith(".params"))
    norm = sum(float((want[k] ** 2).sum()) for k in want if k.startswith(".params"))
    assert (diff / norm) ** 0.5 < 1e-5
    s = json.loads((out / "summary.json").read_text())
    assert s["resumed_from_step"] == 20 and s["steps"] == 40 and s["strategy"] == layout[1]


@pytest.fixture(scope="module")
def hybrid_2(tmp_path_factory):
    """A hybrid data=2 x model=2 run of 2 steps: what the refusals resume."""
    out = tmp_path_factory.mktemp("refusals") / "hybrid"
    ok(run_cli("--strategy", "hybrid", "--devices", "4", "--mesh", "data=2,model=2", *BASE,
               *OPTIMIZERS["adam"][0], "--steps", "2", "--out", str(out)))  # fmt: skip
    return out


@pytest.mark.parametrize(
    "args, says",
    [
        (["--strategy", "single"], "add --reshard to continue on this layout"),
        (["--reshard", "--strategy", "ps", "--simulate"], "the new strategy ps does not hold one"),
        (["--reshard", "--lr", "0.5"], "--reshard changes only where the state lives"),
    ],
    ids=["layout-without-reshard", "to-ps", "other-lr"],
)
def test_resharding_refusals_are_one_line(hybrid_2, tmp_path, args, says):
    out = tmp_path / "refused"
    proc = run_cli("--resume", str(hybrid_2), *args, "--steps", "40",
                   "--out", str(out))  # fmt: skip
    lines = stderr_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not out.exists()
