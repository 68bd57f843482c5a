"""A persistent straggler's price (``refdl predict --straggler``): the steady state of
refdl's own arrival simulator (``--simulate``'s timing model) for every ps mode, and
the CLI's checks, as ``refdl train``'s."""

from __future__ import annotations

import json

import pytest

from refdl import hw
from refdl.errors import UsageError
from refdl.perf import PredictOptions
from refdl.perf import costs as K
from refdl.perf.model_cost import ModelCost
from refdl.perf.prediction import predict_steps
from refdl.perf.straggler import groups, straggled
from refdl.predict import main as predict_main
from refdl.strategies import traits_of
from refdl.strategies.ps.ssp import simulate_softsync_trace, simulate_trace

P100 = hw.load("p100-nvlink-ib-edr")


def steady_step(times: list[float], workers: int) -> float:
    """Seconds per ``workers`` arrivals over the middle half of a run (no warm-up, no
    end where the fast workers have finished their clocks)."""
    a, b = len(times) // 4, 3 * len(times) // 4
    return workers * (times[b] - times[a]) / (b - a)


@pytest.mark.parametrize("workers", [4, 8])
@pytest.mark.parametrize("slow", [0, 3])  # the straggler's index: ties go to the lower
def test_the_steady_state_is_the_simulators(workers, slow):
    """async: nobody waits (n = W); SSP with any bound: the straggler's pace (n = 1);
    softsync n: the straggler's W/n - 1 chunk-mates wait with it (n groups)."""
    t, s, steps = 1.0, 0.5, 400
    step_s = [t] * workers
    step_s[slow] += s
    times: list[float] = []
    simulate_trace(workers, 0, steps, float("inf"), step_s, times)
    assert steady_step(times, workers) == pytest.approx(straggled(t, s, workers), rel=0.01)
    for bound in (0, 2, 5):
        times = []
        simulate_trace(workers, 0, steps, bound, step_s, times)
        assert steady_step(times, workers) == pytest.approx(t + s, rel=0.01)
        assert groups("parameter_server", "ssp", None, workers) == 1
    for n in [d for d in range(1, workers + 1) if workers % d == 0]:
        times = []
        simulate_softsync_trace(workers, 0, steps, workers // n, step_s, times)
        assert steady_step(times, workers) == pytest.approx(straggled(t, s, n), rel=0.01)
        assert groups("parameter_server", "softsync", n, workers) == n


def test_straggled_spans_sync_to_async():
    """n = 1 is sync's t + s; n = W async's W / ((W-1)/t + 1/(t+s)), e.g. 4 workers of
    1 s and one of 1.5 s: 4 / (3 + 2/3) = 1.0909 s per 4 gradients."""
    assert straggled(1.0, 0.5, 1) == pytest.approx(1.5)
    assert straggled(1.0, 0.5, 4) == pytest.approx(4 / (3 + 1 / 1.5))
    assert straggled(1.0, 0.0, 4) == 1.0
    assert 1.0 < straggled(1.0, 0.5, 8) < straggled(1.0, 0.5, 2) < 1.5


def toy() -> ModelCost:
    return ModelCost("toy", 1_000_000, 1e9, 0.0, 1e6, 0.0, 4e5, 4e4, layers=10)


def test_each_formula_adds_the_wait_to_its_step():
    m = toy()
    for mode, extra in (("sync", {}), ("hierarchical", {"ps_groups": 2}),
                        ("ssp", {"staleness": 3}), ("async", {}),
                        ("softsync", {"softsync_n": 2})):  # fmt: skip
        plain = K.ps(m, P100, 64, 8, PredictOptions(ps_mode=mode, **extra))
        lag = K.ps(m, P100, 64, 8, PredictOptions(ps_mode=mode, straggler="4:0.2", **extra))
        n = {"async": 8, "softsync": 2}.get(mode, 1)
        assert lag.step_time_s == pytest.approx(straggled(plain.step_time_s, 0.2, n))
        assert plain.wait_s == 0.0 and lag.wait_s > 0.0
    ring = K.decentralized(m, P100, 64, 8, PredictOptions(straggler="7:0.2"))
    assert ring.wait_s == pytest.approx(0.2)
    gossip = K.decentralized(m, P100, 64, 8, PredictOptions(gossip=True))
    plain = K.decentralized(m, P100, 64, 8, PredictOptions())
    assert gossip.comm_bytes == pytest.approx(plain.comm_bytes / 2)  # one partner, not two
    with pytest.raises(UsageError, match=r"not a worker \(workers are ranks 2\.\.9\)"):
        predict_steps("p100-nvlink-ib-edr", "ps", traits_of("ps"), "resnet50", 64, [8],
                      opts=PredictOptions(servers=2, straggler="1:0.2"))  # fmt: skip
    with pytest.raises(UsageError, match="go together"):
        K.ps(m, P100, 64, 8, PredictOptions(ps_mode="softsync", straggler="1:0.2"))
    with pytest.raises(UsageError, match="bound of --ps-mode ssp"):
        K.ps(m, P100, 64, 8, PredictOptions(staleness=2))
    with pytest.raises(UsageError, match="drop one"):
        K.decentralized(m, P100, 64, 8, PredictOptions(gossip=True, compress="topk:0.01"))


def test_predict_cli_prices_a_straggler_and_refuses_what_train_refuses(capsys):
    base = ["--hw", "p100-nvlink", "--model", "resnet50", "--batch-size", "64",
            "--workers", "2,4", "--json"]  # fmt: skip
    assert predict_main([*base, "--strategy", "ps", "--ps-mode", "async"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert predict_main([*base, "--strategy", "ps", "--ps-mode", "async",
                         "--straggler", "1:0.5"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    for p, r in zip(plain, rows, strict=True):
        assert r["step_time_s"] == pytest.approx(straggled(p["step_time_s"], 0.5, r["workers"]))
        assert r["wait_s"] == pytest.approx(r["step_time_s"] - p["step_time_s"])
        assert r["step_time_low_s"] == pytest.approx(
            straggled(p["step_time_low_s"], 0.5, r["workers"]))  # fmt: skip
        assert r["speedup"] < p["speedup"]  # over one undelayed worker
    for argv, says in (
        (["--strategy", "data", "--straggler", "1:0.5"], "--strategy decentralized, ps"),
        (["--strategy", "ps", "--straggler", "0:0.5"], "rank 0 is not a worker (workers are"),
        (["--strategy", "ps", "--straggler", "5:0.5"], "workers are ranks 1..4"),
        (["--strategy", "ps", "--straggler", "1:x"], "RANK:SECONDS"),
        (["--strategy", "ps", "--ps-mode", "softsync"], "--softsync-n N go together"),
        (["--strategy", "ps", "--ps-mode", "softsync", "--softsync-n", "3"], "divisor of"),
        (["--strategy", "data", "--gossip"], "--strategy decentralized"),
    ):
        assert predict_main([*base, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (argv, err)
