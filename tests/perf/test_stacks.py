"""Collective stacks by generation (issue 52): a dated stack's figures come from its own
calibration collectives, price the held-out 2017 P100 table close where today's NCCL
figures missed by half, and an unmeasured stack widens the interval and says so."""

from __future__ import annotations

import json
import subprocess
import sys
from statistics import median

import pytest

from conftest import ROOT
from refdl import hw
from refdl.bench import published as P
from refdl.hw import stacks
from refdl.predict import predict_collective

DEEPBENCH_P100_4X_258MB_S = 67.212285e-3  # DeepBench_NV_P100.xlsx, 64500000 floats, 4 cards


def test_dated_stacks_carry_the_fit_of_their_own_calibration_collectives():
    """fit_stacks on the data set gives the figures stacks.toml ships; no held-out point
    is read; the help names every dated stack."""
    points, split = P.load()
    deepbench = [p for p in points if p.stack]
    fits = P.fit_stacks(deepbench)
    assert set(fits) == {
        ("nccl-2.0-mpi", "pcie"),
        ("nccl-2.0-single", "pcie"),
        ("nccl-2.0-mpi", "network"),
        ("baidu-ring", "network"),
    }
    for (name, kind), v in fits.items():
        assert set(v["sources"]) <= set(split["calibration"])
        own = stacks.get(name).links[kind]
        assert own.fraction == pytest.approx(v["fraction"], rel=1e-3)
        assert own.latency_s == pytest.approx(v["latency_s"], rel=1e-3)
        assert own.points == v["points"]
        if own.log_q10 is not None:  # (fewer than 9 residuals bound nothing at 80 %)
            assert own.log_q10 == pytest.approx(v["log_q10"], abs=1e-3)
    # NCCL 2.0 with a process per GPU moved 0.40 of PCIe's line rate, one process 0.61;
    # across servers its flat ring 0.70 of InfiniBand FDR's, Baidu's ring 0.49
    assert fits[("nccl-2.0-mpi", "pcie")]["fraction"] == pytest.approx(0.40, abs=0.01)
    assert fits[("nccl-2.0-single", "pcie")]["fraction"] == pytest.approx(0.61, abs=0.01)
    assert fits[("nccl-2.0-mpi", "network")]["fraction"] == pytest.approx(0.70, abs=0.01)
    assert fits[("baidu-ring", "network")]["fraction"] == pytest.approx(0.49, abs=0.01)
    assert stacks.get("baidu-ring").flat and not stacks.get("nccl").flat
    dated = [n for n, s in stacks.table().items() if not s.current]
    assert dated and all(n in stacks.help_text() for n in dated)


def test_the_held_out_p100_table_with_its_stack_and_with_todays_nccl():
    """DeepBench's 4 x P100 all-reduce of 258 MB (2017, held out): today's NCCL figures
    predict half the time, outside their interval; NCCL 2.0 with MPI within 10 %, inside."""
    today = predict_collective("p100-pcie", "allreduce", "ring", 258e6, [4])[0]
    dated = predict_collective("p100-pcie", "allreduce", "ring", 258e6, [4],
                               library="nccl-2.0-mpi")[0]  # fmt: skip
    assert today["time_s"] / DEEPBENCH_P100_4X_258MB_S - 1 == pytest.approx(-0.52, abs=0.03)
    assert today["time_high_s"] < DEEPBENCH_P100_4X_258MB_S
    assert abs(dated["time_s"] / DEEPBENCH_P100_4X_258MB_S - 1) < 0.10
    assert dated["time_low_s"] <= DEEPBENCH_P100_4X_258MB_S <= dated["time_high_s"]
    assert "its own figures on pcie links" in dated["stack_note"]
    assert today["stack_note"] is None
    # every held-out row of that stack: median |error| under 10 %, today's over 40 %
    points, _ = P.load()
    held = [p for p in points if p.source == "deepbench-2017-p100"]
    assert all(p.year == 2017 and p.part == "heldout" for p in held)
    assert all(2010 <= p.year <= 2026 for p in points if p.year is not None)
    rows = P.evaluate(held)
    s = P.stack_summary(rows, held)["nccl-2.0-mpi"]["heldout"]
    assert s["n"] == 22 and s["median_abs_error"] < 0.10 and s["inside"] >= 17
    assert s["current_median_abs_error"] > 0.40 and s["current_inside"] <= 2
    # the one-process rows are a miss the data shows: the P100 box ran NCCL 2.0 at the
    # Maxwell boxes' speed, half the Pascal boxes' the stack was mostly fitted on
    single = [r for r in rows if r["stack"] == "nccl-2.0-single"]
    assert len(single) == 3 and median(r["error"] for r in single) < -0.4
    # across two servers, Baidu's flat ring: within 25 %, 2 of 3 inside; today's MPI figures
    # in refdl's two levels: over 50 % off
    ring = P.stack_summary(rows, held)["baidu-ring"]["heldout"]
    # (its 9 calibration residuals bound it on both sides since conformal's rounding fix,
    # 2026-11-27: the 16.8 M-float row, 24 % fast, falls under the lower bound)
    assert ring["n"] == 3 and ring["inside"] == 2 and ring["median_abs_error"] < 0.10
    assert ring["current_median_abs_error"] > 0.5


def test_an_unmeasured_stack_widens_the_interval_and_says_so():
    """nccl-1.x (no measurement) and nccl-2.0-mpi on NVLink (measured on PCIe only):
    today's figures, a wider interval, a note; a bad name is one line, exit 2."""
    now = predict_collective("a100-nvlink", "allreduce", "ring", 258e6, [8])[0]
    for name in ("nccl-1.x", "nccl-2.0-mpi"):
        old = predict_collective("a100-nvlink", "allreduce", "ring", 258e6, [8],
                                 library=name)[0]  # fmt: skip
        assert old["time_s"] == now["time_s"]
        assert old["time_low_s"] < now["time_low_s"] and old["time_high_s"] > now["time_high_s"]
        assert "never measured on nvlink links" in old["stack_note"]
    a100 = hw.load("a100-nvlink")
    assert a100.borrowed_link("nccl-1.x", "intra") and not a100.borrowed_link("nccl", "intra")
    assert hw.load("p100-pcie").view("expected", library="nccl-2.0-mpi").links[
        "intra"
    ].achievable == pytest.approx(stacks.get("nccl-2.0-mpi").links["pcie"].fraction)
    proc = subprocess.run([sys.executable, "-m", "refdl.predict", "collective", "--hw",
                           "p100-pcie", "--workers", "4", "--bytes", "1e6", "--library",
                           "nccl-3.0"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "nccl-2.0-mpi" in proc.stderr


def test_a_point_naming_an_unknown_stack_is_refused(tmp_path):
    text = (ROOT / "docs" / "published" / "measurements.toml").read_text()
    bad = tmp_path / "m.toml"
    bad.write_text(text.replace('stack = "nccl-2.0-mpi"', 'stack = "nccl-0.1"', 1))
    proc = subprocess.run([sys.executable, "-m", "refdl.bench", "published", "--data",
                           str(bad)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "stack 'nccl-0.1' is not one of" in proc.stderr
    assert json.dumps(proc.stdout) == '""'


def test_a_step_priced_with_a_dated_stack_says_what_its_links_rest_on():
    from refdl.perf.prediction import predict_steps
    from refdl.strategies import traits_of

    def row(hw_name: str, library: str | None) -> dict:
        return predict_steps(hw_name, "data", traits_of("data"), "resnet50", 256, [4],
                             library=library)[0]  # fmt: skip

    now, old = row("p100-pcie", None), row("p100-pcie", "nccl-2.0-mpi")
    assert old["comm_s"] > now["comm_s"] > 0 and old["compute_s"] == now["compute_s"]
    assert now["stack_note"] is None and "its own figures on pcie" in old["stack_note"]
    far = row("p100-nvlink-ib-edr", "nccl-2.0-mpi")["stack_note"]
    assert "never measured on nvlink" in far and "interval" not in far


def test_a_flat_ring_runs_at_its_slowest_hops_pace():
    """Across servers a dated stack's one ring moves n/p over every hop each step: on
    DeepBench's boxes the network (0.705 of FDR) is slower than PCIe (0.40 of Gen3), so
    the ring is the network's; a node whose links are 10x slower sets the pace instead."""
    import dataclasses

    from refdl.perf.collectives import collective_time
    from refdl.predict import collective_pair

    box = hw.load("deepbench-pcie3")
    n, p = 4 * 6553600, 16
    t = collective_pair(box, "allreduce", "ring", n, p, "nccl-2.0-mpi", nodes=2)[0]
    view = box.view("expected", library="nccl-2.0-mpi")
    net = collective_time("allreduce", "ring", n, p, view.links["inter"].alpha_beta())
    assert t == pytest.approx(net)
    slow = dict(box.links)
    slow["intra"] = dataclasses.replace(box.links["intra"],
                                        bandwidth=box.links["intra"].bandwidth / 10)  # fmt: skip
    slow_box = dataclasses.replace(box, links=slow)
    t_slow = collective_pair(slow_box, "allreduce", "ring", n, p, "nccl-2.0-mpi", nodes=2)[0]
    intra = slow_box.view("expected", library="nccl-2.0-mpi").links["intra"].alpha_beta()
    assert t_slow == pytest.approx(collective_time("allreduce", "ring", n, p, intra))
    assert t_slow > 3 * t


def test_the_network_is_every_fitted_flat_rings_slowest_hop():
    """fit_stacks fits a flat ring's network figures on the network hop alone; that is
    the price collective_pair gives every calibration point of a flat stack (the node's
    hop never the slower one there), so the fit and the prediction agree."""
    from refdl.perf.collectives import collective_time
    from refdl.predict import collective_pair

    points, _ = P.load()
    flat = [p for p in points if p.kind == "collective" and p.stack and p.part == "calibration"
            and stacks.get(p.stack).flat and (p.nodes or 1) > 1]  # fmt: skip
    assert len(flat) >= 20
    for p in flat:
        box = hw.load(p.hw)
        got = collective_pair(box, P.OPS[p.op], "ring", p.bytes, p.workers, p.stack, p.nodes)[0]
        view = box.view("expected", library=p.stack)
        net = collective_time(P.OPS[p.op], "ring", p.bytes, p.workers,
                              view.links["inter"].alpha_beta())  # fmt: skip
        assert got == pytest.approx(net), p.where
