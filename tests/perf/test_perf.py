"""Alpha-beta formulas against hand-computed values; hardware profiles; predict collective."""

from __future__ import annotations

import json
import tomllib
from importlib import resources

import pytest

from refdl import hw
from refdl.errors import UsageError
from refdl.perf import collectives as C
from refdl.perf.collectives import Link, bandwidths, collective_time

L = Link(alpha=1e-6, beta=1e-9, gamma=1e-10)


def test_formulas_hand_computed():
    n, p = 1e6, 4
    # ring: 2*3*1us + 2*1e6*3/4*1ns + 1e6*3/4*0.1ns = 6e-6 + 1.5e-3 + 7.5e-5
    assert C.allreduce_ring(n, p, L) == pytest.approx(6e-6 + 1.5e-3 + 7.5e-5)
    # recursive doubling: 2*1us + 1e6*2*1ns + 1e6*2*0.1ns
    assert C.allreduce_recursive_doubling(n, p, L) == pytest.approx(2e-6 + 2e-3 + 2e-4)
    # Rabenseifner: 4*1us + 1.5e-3 + 7.5e-5
    assert C.allreduce_rabenseifner(n, p, L) == pytest.approx(4e-6 + 1.5e-3 + 7.5e-5)
    # tree: 2*2*(1us + 1ms) + 2*1e6*0.1ns
    assert C.allreduce_tree(n, p, L) == pytest.approx(4 * (1e-6 + 1e-3) + 2e-4)
    assert C.reduce_scatter_ring(n, p, L) == pytest.approx(3e-6 + 0.75e6 * 1.1e-9)
    assert C.allgather_ring(n, p, L) == pytest.approx(3e-6 + 0.75e-3)
    assert C.broadcast_scatter_allgather(n, p, L) == pytest.approx(4e-6 + 1.5e-3)
    assert C.ps_push_pull(n, p, L) == pytest.approx(2 * (1e-6 + 4e-3))
    assert C.ps_push_pull(n, 8, L, servers=2) == pytest.approx(4e-6 + 2e-3 * 4)
    assert C.neighbour_exchange(n, 2, L) == pytest.approx(1e-6 + 1e-3)
    assert C.neighbour_exchange(n, 2, L, concurrent=False) == pytest.approx(2 * (1e-6 + 1e-3))


@pytest.mark.parametrize("op,algos", list(C.OPS.items()))
def test_one_worker_costs_nothing_and_costs_grow(op, algos):
    for algo in algos:
        assert collective_time(op, algo, 1e6, 1, L) == 0.0
        for p in (2, 4, 8, 16):  # more bytes never cost less; more workers never cost less
            assert collective_time(op, algo, 2e6, p, L) > collective_time(op, algo, 1e6, p, L)
            assert collective_time(op, algo, 1e6, 2 * p, L) >= collective_time(op, algo, 1e6, p, L)
    assert C.ps_push_pull(1e6, 1, L) == 0.0


def test_nccl_bandwidth_conventions():
    algbw, busbw = bandwidths("allreduce", 8e9, 4, 1.0)
    assert (algbw, busbw) == (8e9, 8e9 * 2 * 3 / 4)
    assert bandwidths("allgather", 8e9, 4, 2.0) == (4e9, 3e9)
    assert bandwidths("broadcast", 8e9, 4, 2.0) == (4e9, 4e9)


@pytest.mark.parametrize("name", hw.names())
def test_profiles_load_and_round_trip(name):
    prof = hw.load(name)
    if prof.device is None:  # a network described alone: collectives, never a step
        with pytest.raises(UsageError, match=r"has no \[device\] \(it describes a network"):
            prof.peak_flops  # noqa: B018
    else:
        assert prof.peak_flops > 1e11 and prof.memory_bandwidth > 1e10
    assert all(lk.source and 0 < lk.achievable <= 1 for lk in prof.links.values())
    again = hw.parse(tomllib.loads(hw.dumps(prof)), "round-trip")
    assert again == prof


def test_shipped_profiles_cover_the_seed_hardware():
    for name in (
        "k80-pcie",
        "p100-nvlink",
        "p100-pcie",
        "v100-nvlink",
        "a100-nvlink",
        "h100-nvlink",
        "knl-omnipath",
        "xeon-e5-2680v2-fdr",
        "p100-nvlink-ib-fdr",
        "p100-nvlink-ib-edr",
        "a100-nvlink-ib-hdr",
        "h100-nvlink-ib-ndr",
        "p100-nvlink-roce25",
        "k80-pcie-10gbe",
        "piz-daint",
    ):
        assert name in hw.names()


def test_piz_daint_is_one_p100_a_node_on_aries():
    """The profile states CSCS's measured GPU-to-GPU osu_bw (8765.65 MB/s) as the
    achievable share of the Aries NIC's 10.2 GB/s, and a 64-node allreduce crosses it."""
    prof = hw.load("piz-daint")
    assert prof.devices_per_node == 1 and "intra" not in prof.links
    inter = prof.links["inter"]
    assert inter.bandwidth == 10.2e9
    assert inter.achievable == pytest.approx(8765.65e6 / 10.2e9, abs=0.01)
    assert prof.link(2) is inter and "osu" in inter.source


def test_multi_node_profiles_switch_links_past_a_node():
    prof = hw.load("p100-nvlink-ib-edr")
    assert prof.link(8) is prof.links["intra"] and prof.link(16) is prof.links["inter"]
    t8 = collective_time("allreduce", "ring", 1e8, 8, prof.link(8).alpha_beta())
    t16 = collective_time("allreduce", "ring", 1e8, 16, prof.link(16).alpha_beta())
    assert t16 > 5 * t8  # 12.5 GB/s InfiniBand against 80 GB/s NVLink


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda t: t.replace("memory_bandwidth = 732e9", "memory_bandwidth = -1"),
            "key device.memory_bandwidth must be a positive number",
        ),
        (
            lambda t: t.replace("achievable = 0.9", "achievable = 1.5"),
            "key links.intra.achievable must be <= 1",
        ),
        (lambda t: t.replace("latency_s = 3.4e-6\n", ""), "key links.intra.latency_s is missing"),
        (lambda t: t.replace("[device]", "[devise]"), "key devise is not one of name, "),
        (lambda t: t + "\n[[broken", "not valid TOML"),
    ],
)
def test_broken_profile_names_the_key(tmp_path, edit, message):
    text = (resources.files("refdl.hw") / "profiles" / "p100-nvlink.toml").read_text()
    path = tmp_path / "bad.toml"
    path.write_text(edit(text))
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        hw.load(path)
    with pytest.raises(UsageError, match="unknown hardware profile 'tpu-v9'"):
        hw.load("tpu-v9")


def test_predict_collective_cli(capsys):
    from refdl.predict import main

    assert (
        main(
            [
                "collective",
                "--op",
                "allreduce",
                "--algo",
                "ring",
                "--hw",
                "p100-nvlink",
                "--workers",
                "4",
                "--bytes",
                "67108864",
                "--json",
            ]
        )
        == 0
    )
    row = json.loads(capsys.readouterr().out)
    # expected: the achieved NCCL figures ([achieved.nccl.intra]); bound: line rate, the
    # (p-1)/p of the vector each device must send (the 1.4 ms was the old bound)
    prof = hw.load("p100-nvlink")
    got = prof.achieved.links["nccl"]["intra"]
    link = C.Link(got.latency_s, 1 / (prof.links["intra"].bandwidth * got.fraction))
    assert row["time_s"] == pytest.approx(C.allreduce_ring(67108864, 4, link))
    line = prof.links["intra"]
    assert row["bound_time_s"] == pytest.approx(line.latency_s + 67108864 * 3 / 4 / line.bandwidth)
    assert row["time_s"] > 1.4e-3 > row["bound_time_s"]
    assert row["busbw"] == pytest.approx(row["algbw"] * 1.5)
    assert (
        main(
            [
                "collective",
                "--op",
                "allreduce",
                "--algo",
                "bogus",
                "--hw",
                "p100-nvlink",
                "--workers",
                "4",
                "--bytes",
                "1",
            ]
        )
        == 2
    )


def test_fit_alpha_beta_recovers_a_line():
    from refdl.hw.calibrate.links import fit_alpha_beta

    sizes = [4096, 65536, 1 << 20, 4 << 20]
    alpha, beta = fit_alpha_beta(sizes, [2 * 5e-6 + n * 2e-10 for n in sizes])
    assert alpha == pytest.approx(5e-6) and beta == pytest.approx(2e-10)


@pytest.mark.mpi
@pytest.mark.slow  # ~2 min: the operation-level microbenchmarks and generic training steps
def test_calibrate_writes_a_valid_profile(tmp_path):
    """Real measurement: simulated devices and 2 MPI ranks under mpirun (bounded)."""
    import subprocess
    import sys

    out = tmp_path / "local.toml"
    proc = subprocess.run(
        [sys.executable, "-m", "refdl.hw", "calibrate", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    prof = hw.load(out)
    steps = prof.device.in_step
    assert steps is not None and "generic training steps" in steps.source
    assert "jax.profiler" in steps.source and "leave-one-out" in steps.source
    # measured in-step factors and hand-off within what a CPU can do: an operation inside a
    # step at 1/5 to 20x its isolated time, a hand-off of 1 us to 1 ms
    assert all(0.2 < f < 20 for f in (steps.dot, steps.convolution, steps.memory))
    assert 1e-6 < steps.handoff_s < 1e-3
    assert prof.name == "local"
    assert 1e9 < prof.peak_flops < 1e13  # a 2-core CPU: tens to hundreds of GFLOP/s
    assert 1e8 < prof.memory_bandwidth < 1e12
    assert "intra" in prof.links and "inter" in prof.links  # simulated devices, MPI ranks
    assert {"dot", "convolution", "elementwise", "dispatch"} <= prof.device.ops.keys()
    assert all(0 < lk.latency_s < 1 for lk in prof.links.values())


# ----------------------------------------------------------------- operation-level model


def _compiled_text(fn, *args) -> tuple[str, float]:
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    from refdl.perf import xla_cost

    return compiled.as_text(), xla_cost(compiled)[0]


def test_hlo_parser_counts_dot_and_convolution_flops_by_hand():
    import jax.numpy as jnp
    from jax import lax

    from refdl.perf.ops import by_kind, parse_hlo

    text, xla = _compiled_text(lambda a, b: a @ b, jnp.ones((32, 48)), jnp.ones((48, 24)))
    dots = [o for o in parse_hlo(text) if o.kind == "dot"]
    assert len(dots) == 1 and dots[0].flops == 2 * 32 * 24 * 48 == xla
    assert dots[0].bytes == 4 * (32 * 48 + 48 * 24 + 32 * 24)

    def conv(x, w):  # VALID: no padding products, so XLA's count equals the hand count
        return lax.conv_general_dilated(x, w, (1, 1), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip

    text, xla = _compiled_text(conv, jnp.ones((4, 10, 10, 3)), jnp.ones((5, 5, 3, 8)))
    convs = [o for o in parse_hlo(text) if o.kind == "convolution"]
    hand = 2 * (4 * 6 * 6 * 8) * (5 * 5 * 3)
    assert len(convs) == 1 and convs[0].flops == hand
    assert xla == pytest.approx(hand, rel=0.01)
    kinds = by_kind(parse_hlo(text))
    assert kinds["convolution"] == (1, hand)


TRIP = 'backend_config={"known_trip_count":{"n":"3"}}'


def test_hlo_parser_kinds_fusions_while_loops_and_skips_plumbing():
    from refdl.perf.ops import parse_hlo

    text = (
        """HloModule m

%fused_dot (p0: f32[8,4], p1: f32[4,2]) -> f32[8,2] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = f32[4,2]{1,0} parameter(1)
  ROOT %d = f32[8,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0: f32[8,2]) -> f32[8,2] {
  %p0 = f32[8,2]{1,0} parameter(0)
  ROOT %a = f32[8,2]{1,0} add(%p0, %p0)
}

%body (t: (s32[], f32[8,2])) -> (s32[], f32[8,2]) {
  %t = (s32[], f32[8,2]{1,0}) parameter(0)
  %x = f32[8,2]{1,0} get-tuple-element(%t), index=1
  %y = f32[8,2]{1,0} fusion(%x), kind=kLoop, calls=%fused_add
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[8,2]{1,0}) tuple(%i, %y)
}

ENTRY %main (a: f32[8,4], b: f32[4,2]) -> f32[8,2] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = f32[4,2]{1,0} parameter(1)
  %c = f32[] constant(0)
  %f = f32[8,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %t = (s32[], f32[8,2]{1,0}) tuple(%c, %f)
  %w = (s32[], f32[8,2]{1,0}) while(%t), condition=%cond, body=%body, """
        + TRIP
        + """
  %g = f32[8,2]{1,0} get-tuple-element(%w), index=1
  %s = f32[8,2]{1,0} all-reduce(%g), replica_groups={}, to_apply=%add
  ROOT %z = f32[8,2]{1,0} some-new-op(%s)
}
"""
    )
    ops = parse_hlo(text)
    assert [o.kind for o in ops] == ["dot", "elementwise", "elementwise", "elementwise",
                                     "collective", "other"]  # fmt: skip
    assert ops[0].flops == 2 * 8 * 2 * 4 and ops[0].size == ops[0].flops
    assert ops[1].size == ops[1].bytes == 2 * 4 * 16  # one read, one write of 8x2 fp32


def test_hockney_fit_recovers_hand_values():
    from refdl.perf.ops import OpRate, fit_hockney

    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    t0, rate = fit_hockney(sizes, [5e-6 + n / 2e9 for n in sizes])
    assert t0 == pytest.approx(5e-6) and rate == pytest.approx(2e9)
    assert OpRate(t0, rate).time(4e9, count=3) == pytest.approx(1.5e-5 + 2.0)
    t0, rate = fit_hockney([1e3, 1e6], [1e-6, 1e-3])  # a pure rate: no start-up
    assert t0 == pytest.approx(0.0, abs=1e-12) and rate == pytest.approx(1e9)


def test_op_rates_round_trip_and_a_bad_table_names_the_key(tmp_path):
    from refdl.perf.ops import OpRate

    local = hw.load("local")
    assert "dot" in local.device.ops and "dispatch" in local.device.ops
    text = hw.dumps(local)
    assert "[device.ops.dot]" in text and "[device.in_step]" in text
    again = hw.parse(tomllib.loads(text), "round-trip")
    assert again == local and isinstance(again.device.ops["dot"], OpRate)
    assert again.device.in_step.handoff_s > 0 and again.device.in_step.source
    bad = tmp_path / "bad.toml"
    for edit, message in [
        (lambda t: t.replace("[device.ops.dot]", "[device.ops.matmul]"), "key device.ops.matmul"),
        (lambda t: t.replace("[device.ops.dot]\nt0_s = ", "[device.ops.dot]\nt0_s = -"),
         "key device.ops.dot.t0_s must be a number >= 0"),
        (lambda t: t.replace("[device.ops.dot]\nt0_s", "[device.ops.dot]\nxx"),
         "key device.ops.dot.xx is not one of t0_s, rate, source"),
        (lambda t: t.replace("[device.in_step]\ndot = ", "[device.in_step]\ndot = -"),
         "key device.in_step.dot must be a number >= 0"),
        (lambda t: t.replace("[device.in_step]\ndot", "[device.in_step]\nmatmul"),
         "key device.in_step.matmul is not one of dot, convolution, memory, handoff_s"),
    ]:  # fmt: skip
        bad.write_text(edit(text))
        with pytest.raises(UsageError, match=message.replace(".", r"\.")):
            hw.load(bad)


def test_gpu_profiles_have_no_op_rates_and_keep_the_roofline():
    from refdl.perf import compute_time, roofline_time
    from refdl.perf.ops import OpWork

    p100 = hw.load("p100-nvlink")
    assert p100.device.ops == {}
    work = OpWork({"dot": (10, 1e12)})
    assert compute_time(1e9, 1e6, p100, work=work) == pytest.approx(roofline_time(1e9, 1e6, p100))


def test_op_time_sums_hockney_terms_and_falls_back():
    import dataclasses

    from refdl.perf.ops import OpRate, OpWork, op_time

    local = hw.load("local")
    rates = {"dot": OpRate(1e-6, 1e10), "other": OpRate(2e-6, 1e9)}
    work = OpWork({"dot": (4, 1e8), "reduce": (2, 1e6), "convolution": (1, 1e9)})
    dev = dataclasses.replace(local.device, op_overhead_s=1e-6)
    prof = dataclasses.replace(local, device=dev)
    expect = (4e-6 + 1e-2) + (4e-6 + 1e-3) + (1e9 / prof.peak_flops + 1e-6)
    assert op_time(work, rates, prof) == pytest.approx(expect)
    assert work.scaled(share=0.5, repeat=2).kinds["dot"] == (8, 5e7)


def test_in_step_scales_each_group_and_charges_the_handoff():
    from refdl.perf.ops import InStep, OpRate, OpWork, op_time

    local = hw.load("local")
    rates = {"dot": OpRate(1e-6, 1e10), "convolution": OpRate(0.0, 1e9), "other": OpRate(0, 1e9)}
    work = OpWork({"dot": (4, 1e8), "convolution": (1, 1e6), "reduce": (2, 1e6)})
    steps = InStep(dot=2.0, convolution=3.0, memory=0.5, handoff_s=1e-5)
    expect = 2 * (4e-6 + 1e-2) + 3 * 1e-3 + 0.5 * 1e-3 + 7 * 1e-5
    assert op_time(work, rates, local, steps) == pytest.approx(expect)
    assert op_time(work, rates, local, InStep()) == pytest.approx(op_time(work, rates, local))


def test_fit_in_step_measures_each_figure_from_the_profile():
    from refdl.hw.calibrate.in_step import StepSample, fit_error, fit_in_step, in_step_predict

    factors, handoff = (1.5, 0.8, 2.0), 2e-5  # dot, convolution, memory; hand-off

    def sample(alone, ops, gap, unseen=(0.0, 0.0, 0.0)):
        """A step whose operations run ``factors`` x their isolated time, with ``gap`` per
        operation between them; ``unseen`` is isolated time of operations the trace missed."""
        measured = tuple(f * a for f, a in zip(factors, alone, strict=True))
        alone_all = tuple(a + u for a, u in zip(alone, unseen, strict=True))
        device = sum(f * a for f, a in zip(factors, alone_all, strict=True)) + gap * ops
        return StepSample(measured, tuple(alone), alone_all, ops, device)

    samples = [sample((1e-3, 0, 2e-4), 30, 2e-5), sample((4e-3, 0, 1e-3), 40, 2e-5),
               sample((0, 2e-3, 5e-4), 55, 2e-5),
               sample((2e-4, 1e-3, 1e-4), 50, 9e-5, unseen=(0, 0, 1e-4)),
               sample((1e-2, 0, 3e-3), 45, 1e-5)]  # fmt: skip
    fit = fit_in_step(samples)
    # pooled ratios reproduce the factors exactly; the hand-off is the median gap (the
    # missed operations' time counts in their step's gap)
    assert [fit["dot"], fit["convolution"], fit["memory"]] == pytest.approx(factors, rel=1e-12)
    assert fit["handoff_s"] == pytest.approx(handoff, rel=1e-12)
    # the prediction charges every operation's isolated time, seen or not, and each hand-off
    expect = 1.5 * 2e-4 + 0.8 * 1e-3 + 2.0 * (1e-4 + 1e-4) + 50 * 2e-5
    assert in_step_predict(samples[3], fit) == pytest.approx(expect, rel=1e-12)
    # leave-one-out: the others' median gap is 2e-5 whichever step is left out, so three
    # steps are exact, and the step with 9e-5 between its operations is the farthest off
    assert (
        fit_error(samples)
        == f"leave-one-out error median 0%, max {1 - expect / samples[3].device_s:.0%}"
    )
    mlp_only = [s for s in samples if s.alone[1] == 0]  # no convolutions: factor 1
    assert fit_in_step(mlp_only)["convolution"] == 1.0
    negative = [sample((1e-3, 0, 2e-4), 30, -5e-6)]  # the gap can read negative: clipped
    assert fit_in_step(negative)["handoff_s"] == 0.0


@pytest.mark.slow  # ~30 s: every configuration compiled and run once
def test_predict_vs_measure_reports_each_configuration():
    from refdl.bench import predict_vs_measure as pvm

    result = pvm.run(rounds=1, steps=3, with_mpi=False)
    assert len(result["rows"]) == len(pvm.MODELS) * len(pvm.SPMD)
    for row in result["rows"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
        expect = (row["predicted_s"] - row["measured_s"]) / row["measured_s"]
        assert row["error"] == pytest.approx(expect)  # one round: its own error
        parts = row["predicted_compute_s"] + row["predicted_comm_s"] + row["predicted_bubble_s"]
        assert parts == pytest.approx(row["predicted_s"])
        assert row["speed"] == [1.0] and row["error_drift_corrected"] == row["error"]
    errors = sorted(abs(r["error"]) for r in result["rows"])
    assert result["median_abs_error"] == pytest.approx((errors[4] + errors[5]) / 2)
    assert result["drift_corrected"] is None  # no --calibrate: nothing to correct against


def test_library_ops_names_the_fusions_xla_hands_to_a_kernel_library():
    from refdl.bench.op_profile import library_ops

    ynn = 'backend_config={"fusion_config":{"kind":"__ynn_fusion"}}'
    text = "\n".join([
        "ENTRY %main (p: f32[4,4]) -> f32[4,4] {",
        f"  %ynn_fusion.2 = f32[4,4]{{1,0}} fusion(%p, %p), kind=kCustom, calls=%c, {ynn}",
        "  %dot.1 = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
        f"  ROOT %ynn_fusion = f32[4,4]{{1,0}} fusion(%dot.1), kind=kCustom, calls=%d, {ynn}",
        "  %add_fusion = f32[4,4]{1,0} fusion(%p), kind=kLoop, calls=%e",
        "}",
    ])  # fmt: skip
    assert library_ops(text) == {"ynn_fusion.2", "ynn_fusion"}


def test_op_profile_times_each_operation_and_predicts_it_by_hand():
    """mlp's real step under jax.profiler (3 steps, ~8 s): every parsed operation is
    listed once, the profiler saw them, and each group's prediction is the hand formula
    ``factor x (count x t0 + n / r)`` of the local profile; the hand-offs, set beside the
    gap between operations, are ``operations x hand-off``."""
    from refdl.bench import op_profile

    r = op_profile.run("mlp", steps=3)
    assert r["operations"] == len(r["ops"]) == sum(g["count"] for g in r["groups"].values())
    assert r["unseen"] <= r["operations"] // 10  # XLA:CPU records (nearly) every operation
    seen = [op["measured_s"] for op in r["ops"] if op["measured_s"] is not None]
    assert min(seen) > 0 and r["measured_ops_s"] == pytest.approx(sum(seen))
    assert {"dot", "elementwise"} <= {g.split(" ")[0] for g in r["groups"]}
    dev = hw.load("local").device
    for name, g in r["groups"].items():
        kind = name.split(" ")[0]
        rate = dev.ops.get(kind) or dev.ops["other"]
        hand = dev.in_step.factor(kind) * (g["count"] * rate.t0_s + g["size"] / rate.rate)
        assert g["predicted_s"] == pytest.approx(hand, rel=1e-9), name
    assert r["predicted_handoff_s"] == pytest.approx(r["operations"] * dev.in_step.handoff_s)
    gap = r["wall_s"] - r["measured_ops_s"] - r["predicted_host_s"]
    assert r["gap_s"] == pytest.approx(gap)
    assert r["gap_per_op_s"] == pytest.approx(gap / r["operations"])


def test_op_profile_bad_input_is_one_line_and_exit_2(capsys):
    from refdl.bench import op_profile

    assert op_profile.main(["--model", "nope"]) == 2
    assert op_profile.main(["--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown model 'nope'" in err[0] and "--steps 0" in err[1]


def test_sparse_allreduce_is_priced_round_by_round(capsys):
    """SparCML's recursive doubling: per round alpha + its message's bytes beta; the sets
    double until the dense vector is cheaper (here from the third round)."""
    from refdl.predict import main

    link = Link(2e-6, 1e-10, 1e-11)
    n = 4e6  # 1 M fp32 values; 1 % kept: 10,000 pairs, 80 kB, then 160 kB, 320 kB ...
    t = C.allreduce_sparse(n, 8, link, 0.01)
    assert t == pytest.approx(3 * 2e-6 + (80_000 + 160_000 + 320_000) * 1e-10)
    t = C.allreduce_sparse(n, 64, link, 0.1)  # 0.8, 1.6, 3.2 MB; then dense 4 MB x 3
    assert t == pytest.approx(6 * 2e-6 + (5.6e6 + 3 * 4e6) * 1e-10 + 3 * 4e6 * 1e-11)
    assert C.allreduce_sparse(n, 8, link, 0.01, 4) < t  # q4: 4.5 bytes a pair
    for bad, says in (((n, 6, link, 0.01), "power-of-two"), ((n, 8, link, 0.0), "density"),
                      ((n, 8, link, 0.01, 16), "value-bits")):  # fmt: skip
        with pytest.raises(UsageError, match=says):
            C.allreduce_sparse(*bad)
    args = ["collective", "--algo", "sparse", "--hw", "v100-nvlink-ib-edr", "--workers", "8",
            "--bytes", "1e8", "--density", "0.001", "--json"]  # fmt: skip
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["speedup_over_dense"] == pytest.approx(row["dense_ring_time_s"] / row["time_s"])
    assert row["speedup_over_dense"] > 10  # 25,000 pairs of 25 M values inside a node
    assert main([*args[:-3], "--json"]) == 2  # sparse needs a density
    assert "needs one" in capsys.readouterr().err


def test_split_allgather_is_priced_phase_by_phase(capsys):
    """SparCML's split-allgather: per phase p - 1 messages; once both phases are dense it
    is the dense ring (reduce-scatter + all-gather), where recursive doubling costs more."""
    from refdl.predict import main

    link = Link(2e-6, 1e-10, 1e-11)
    n = 4e6  # 1 M values in 8 partitions of 125,000; 1 %: 10,000 pairs
    t = C.allreduce_sparse(n, 8, link, 0.01, algorithm="split-allgather")
    # all-to-all of 80 kB messages; then 80,000 pairs (640 kB) >= 500 kB: dense all-gather
    assert t == pytest.approx(14 * 2e-6 + 7 * (80_000 + 500_000) * 1e-10)
    dense = C.allreduce_sparse(n, 64, link, 0.1, algorithm="split-allgather")
    assert dense == pytest.approx(C.allreduce_ring(n, 64, link))
    assert dense < C.allreduce_sparse(n, 64, link, 0.1)  # recursive doubling's dense rounds
    assert C.allreduce_sparse(n, 6, link, 0.01, algorithm="split-allgather") > 0  # any p
    args = ["collective", "--algo", "sparse-split", "--hw", "piz-daint", "--library", "mpi",
            "--workers", "6", "--bytes", "1e8", "--density", "0.001", "--json"]  # fmt: skip
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["algo"] == "sparse-split" and row["speedup_over_dense"] > 1


@pytest.mark.slow  # slow since 2026-11-26 (the default suite's 15 min)
def test_hierarchical_ps_is_priced_in_two_levels():
    """W/G learners share each aggregator's link, then G aggregators the server's: on 64
    workers in 8 groups that is 2 x 8 serialized transfers where one server had 64."""
    from refdl.perf import PredictOptions
    from refdl.perf.prediction import predict_steps
    from refdl.strategies import traits_of

    def row(**kw):
        return predict_steps("p100-nvlink-ib-edr", "ps", traits_of("ps"), "resnet50", 2048, [64],
                             opts=PredictOptions(**kw))[0]  # fmt: skip

    flat, tree = row(ps_mode="sync"), row(ps_mode="hierarchical", ps_groups=8)
    assert tree["comm_s"] == pytest.approx(flat["comm_s"] * (8 + 8) / 64, rel=0.01)
    with pytest.raises(UsageError, match="equal groups"):
        row(ps_mode="hierarchical", ps_groups=5)


def test_sufficient_factors_are_priced_as_the_strategy_chooses_them():
    """mlp 64-256-256-10, 4 workers of 16 rows: auto factors the two hidden layers and
    all-reduces the 10-way head, as ``refdl train --sfb auto`` does (test_sfb.py); each
    factored layer is an all-gather of ``4 x 4 x 16 x (in + out)`` bytes."""
    from refdl.perf import PredictOptions
    from refdl.perf.costs import sufficient_factors
    from refdl.perf.model_cost import model_cost

    m = model_cost("mlp")
    assert m.dense_layers == ((1, 64, 256, 16640), (1, 256, 256, 65792), (1, 256, 10, 2570))
    link = Link(0.0, 1e-9)

    def ring(n):
        return C.allreduce_ring(n, 4, link)

    auto = sufficient_factors(m, 16, 4, PredictOptions(sfb="auto"), ring, link)
    gather = [C.allgather_ring(4 * 4 * 16 * (i + o), 4, link) for i, o in ((64, 256), (256, 256))]
    assert auto == pytest.approx(ring(m.param_bytes - 4 * (16640 + 65792)) + sum(gather))
    assert auto < ring(m.param_bytes)  # bandwidth alone: fewer bytes, less time
    every = sufficient_factors(m, 16, 4, PredictOptions(sfb="all"), ring, link)
    assert every > auto  # the head's factors (256 + 10 per row) outweigh its 2,570 values
