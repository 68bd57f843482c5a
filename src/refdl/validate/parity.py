"""Parity at any scale: is a parallel run the same training as its own 1-D control?

``refdl validate --results TEST --control CONTROL [--control CONTROL2]`` judges two
(or three) loss curves alone - no rerun, so a log of any size or framework. The test
run and the control start from the same seed and take the same data order and global
batch; the control runs the plain (1-D) layout. A healthy parallel run departs from
its control only by the rounding of another reduction order and precision; a
parallelism bug departs by more.

The rule. Both curves are put on their common logged steps; ``d = test - control``.
The noise that explains ``d`` is the difference of two controls where a second is
given (the same seed on another device count, or another seed), else the envelope
refdl measured on its own healthy pairs (``docs/bench/parity/rates.json``,
``envelope_rel``: a difference relative to the loss); either way it is floored at
``FLOOR_REL`` of the loss (a bit-identical rerun explains nothing). The steps are cut
into ``WINDOWS`` windows; in each, ``z = rms(d) / rms(noise)``. The test departs when
some window's ``z`` exceeds ``Z_DEPART``; the report names the first such window and
says how it departs: by its level (the mean of ``d`` relative to the loss), a slope
(``d``'s trend over the run), or spikes (points past ``Z_DEPART`` times the noise
while the window's mean is not). ``Z_DEPART`` and the envelope were chosen on
seeds the measured rates do not use (``scripts/bench_parity.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib import resources
from typing import Any

import numpy as np

from refdl.errors import UsageError

WINDOWS = 10  # windows the common steps are cut into (fewer where there are few points)
MIN_POINTS = 10  # common logged steps a judgement needs
Z_DEPART = 8.0  # a window's rms(d) over rms(noise) past which the test departs
FLOOR_REL = 1e-6  # the least noise, relative to the loss (fp32 rounding of a mean)
SPIKE_SHARE = 0.2  # spikes: the window's mean explains less than this share of its rms
RATES = "parity_rates.json"  # the measured rates and envelope (refdl.validate package data)


def rule_fingerprint() -> str:
    """A hash of the rule's constants: the rates file must belong to the rule in force."""
    text = json.dumps([WINDOWS, MIN_POINTS, Z_DEPART, FLOOR_REL, SPIKE_SHARE])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Curve:
    """A loss curve: logged steps (increasing) and their losses."""

    steps: np.ndarray
    loss: np.ndarray

    @classmethod
    def of(cls, rows: list[dict[str, Any]]) -> Curve:
        """From a log's rows (``step``, ``loss``); a step logged twice keeps its last."""
        by_step = {int(r["step"]): float(r["loss"]) for r in rows}
        steps = np.array(sorted(by_step), dtype=np.int64)
        return cls(steps, np.array([by_step[s] for s in steps], dtype=np.float64))


def measured() -> dict[str, Any] | None:
    """The rates file shipped with refdl (None where none was measured for this rule)."""
    try:
        text = resources.files("refdl.validate").joinpath(RATES).read_text()
    except FileNotFoundError:
        return None
    rates = json.loads(text)
    return rates if rates.get("rule") == rule_fingerprint() else None


def envelope_rel(precision: str = "fp32") -> tuple[float, str]:
    """The relative difference healthy pairs showed at most (the fallback noise), and where
    it comes from."""
    rates = measured()
    if rates is None or precision not in rates.get("envelope_rel", {}):
        return 1e-3, "a default of 1e-3 of the loss (no measured envelope for this rule)"
    value = float(rates["envelope_rel"][precision])
    return value, f"refdl's measured {precision} envelope ({value:.2g} of the loss)"


def judge(
    test: Curve, controls: list[Curve], precision: str = "fp32", envelope: float | None = None
) -> dict[str, Any]:
    """The verdict on ``test`` against ``controls[0]`` (a second control gives the noise;
    else ``envelope``, relative to the loss, by default the measured one): ``passed``, the
    windows' statistics, and the first departing window with how."""
    if not controls:
        raise UsageError("--control: give the 1-D control run's log")
    steps = test.steps
    for c in controls:
        steps = np.intersect1d(steps, c.steps)
    if len(steps) < MIN_POINTS:
        raise UsageError(
            f"--control: the logs share {len(steps)} logged steps; a judgement needs "
            f"{MIN_POINTS} (log the same steps in both runs)"
        )
    pick = lambda c: c.loss[np.searchsorted(c.steps, steps)]  # noqa: E731
    t, c1 = pick(test), pick(controls[0])
    if not (np.all(np.isfinite(c1)) and all(np.all(np.isfinite(pick(c))) for c in controls)):
        raise UsageError("--control: a control's loss is NaN or infinite; it controls nothing")
    scale = np.maximum(np.abs(c1), 1e-12)
    d = np.where(np.isfinite(t), t - c1, np.inf)
    if len(controls) > 1:
        noise = np.abs(pick(controls[1]) - c1)
        source = "the two controls' difference (the run's own noise)"
    else:
        rel, source = envelope_rel(precision)
        if envelope is not None:
            rel, source = envelope, f"an envelope of {envelope:.2g} of the loss"
        noise = rel * scale
    noise = np.maximum(noise, FLOOR_REL * scale)
    k = max(1, min(WINDOWS, len(steps) // 5))
    windows = []
    for idx in np.array_split(np.arange(len(steps)), k):
        dw, nw = d[idx], noise[idx]
        rms_d = float(np.sqrt(np.mean(dw**2))) if np.all(np.isfinite(dw)) else float("inf")
        z = rms_d / float(np.sqrt(np.mean(nw**2)))
        mean_scale = float(np.mean(scale[idx]))
        level = float(np.mean(dw)) / mean_scale if np.isfinite(rms_d) else float("inf")
        spikes = int(np.sum(np.abs(dw) > Z_DEPART * nw))
        windows.append({"first_step": int(steps[idx[0]]), "last_step": int(steps[idx[-1]]),
                        "z": z, "level_rel": level, "rms_rel": rms_d / mean_scale,
                        "spikes": spikes})  # fmt: skip
    departed = [w for w in windows if not w["z"] <= Z_DEPART]
    finite = np.isfinite(d)
    slope = float(np.polyfit(steps[finite], d[finite] / scale[finite], 1)[0]) if (
        finite.sum() > 2) else 0.0  # fmt: skip
    first = departed[0] if departed else None
    how = None
    if first is not None:
        how = _how(first, slope, windows)
    return {
        "comparison": "parity",
        "passed": first is None,
        "rule": f"departs when a window's rms(test - control) exceeds {Z_DEPART:g} x the "
        f"noise's; noise: {source}, at least {FLOOR_REL:g} of the loss",
        "noise": source,
        "common_steps": len(steps),
        "windows": windows,
        "z_max": max(w["z"] for w in windows),
        "slope_rel_per_step": slope,
        "first_departing_window": first,
        "how": how,
        "steps": steps.tolist(),
        "test_loss": [float(x) for x in t],
        "control_loss": [float(x) for x in c1],
        "noise_abs": [float(x) for x in noise],
    }


def _how(w: dict[str, Any], slope: float, windows: list[dict[str, Any]]) -> str:
    """Level, slope or spikes: what the first departing window shows."""
    if not np.isfinite(w["z"]):
        return "the test's loss is NaN or infinite there"
    if abs(w["level_rel"]) < SPIKE_SHARE * w["rms_rel"] and w["spikes"]:
        return f"spikes: {w['spikes']} points past the noise while the mean stays"
    sign = "above" if w["level_rel"] > 0 else "below"
    late = [x["level_rel"] for x in windows if x["first_step"] >= w["first_step"]]
    if len(late) > 2 and abs(late[-1]) > 2 * abs(late[0]) and late[-1] * slope > 0:
        return f"a slope: the test drifts {sign} the control ({slope:+.2g} of the loss a step)"
    return (f"its level: the test's loss is {abs(w['level_rel']):.2g} of the loss {sign} the "
            "control's")  # fmt: skip


def parity_report(
    test: str,
    controls: list[str],
    scalars: str | None = None,
    config_file: str | None = None,
    sets: list[str] | None = None,
) -> dict[str, Any]:
    """``refdl validate --results TEST --control CONTROL [--control CONTROL2]``: the logs
    read as data (any format ``refdl.validate.logs`` reads), judged, with the rule's
    measured rates."""
    from refdl.validate.logs import read_log

    if len(controls) > 2:
        raise UsageError("--control: give one control run's log, or two (the second gives "
                         "the run's own noise)")  # fmt: skip
    logs = [read_log(test, config_file, sets, scalars, rerun=False)]  # its precision
    for path in controls:
        try:
            logs.append(read_log(path, scalars=scalars, rerun=False))
        except UsageError as e:  # the reader names --results; this log is a control
            raise UsageError(str(e).replace("--results ", "--control ", 1)) from None
    precision = str(logs[0].config.get("precision", "fp32"))
    r = judge(Curve.of(logs[0].rows), [Curve.of(log.rows) for log in logs[1:]], precision)
    rates = measured()
    second = ("give a second control, a trusted plain 1-D run from the same seed on "
              "another device count (--control A --control B), whose difference is this "
              "run's own noise (docs/validation.md)")  # fmt: skip
    if len(controls) == 1 and precision != "fp32":
        measured_here = precision in ((rates or {}).get("envelope_rel") or {})
        r["advice"] = (
            f"{precision} with one control: the envelope is the noisiest model's "
            f"{precision} noise refdl measured, wider than a transformer's, so a bug that "
            f"moves a transformer's loss less passes; {second}" if measured_here else
            f"{precision} with one control: refdl measured no {precision} envelope, so the "
            f"noise is a default of 1e-3 of the loss; {second}"
        )  # fmt: skip
    r.update(
        log=test, controls=list(controls), precision=precision,
        read=[f"{p}: {log.format}" + (f" ({'; '.join(log.notes)})" if log.notes else "")
              for p, log in zip((test, *controls), logs, strict=True)],
        rates=rates and {k: rates[k] for k in ("false_alarms", "false_alarms_by_setting",
                                               "detected", "date", "command") if k in rates},
    )  # fmt: skip
    return r


def summary_line(r: dict[str, Any]) -> str:
    """One line: the verdict, where and how a departure shows."""
    if r["passed"]:
        return (f"{r['log']}: the same training as {r['controls'][0]} within the noise "
                f"(largest window z {r['z_max']:.3g} <= {Z_DEPART:g}; {r['noise']}): "
                "PASSED")  # fmt: skip
    w = r["first_departing_window"]
    return (f"{r['log']}: departs from {r['controls'][0]} from steps {w['first_step']}-"
            f"{w['last_step']} (z {w['z']:.3g} > {Z_DEPART:g}): {r['how']}: FAILED")  # fmt: skip


def rates_lines(rates: dict[str, Any], n_controls: int) -> list[str]:
    """The measured rates of the settings judged as this report was (one control: the
    envelope; two: the controls' difference), each on its held-out pairs."""
    by = rates.get("false_alarms_by_setting", {})
    settings = [
        s for s, fa in by.items() if fa.get("n") and (s == "same seed") == (n_controls == 1)
    ]
    lines = []
    for s in settings or [None]:  # an older rates file: every setting together
        fa = by[s] if s else rates["false_alarms"]
        if not fa.get("n"):
            continue
        got = {k: v.get("by_setting", {}).get(s, {"n": 0}) if s else v
               for k, v in rates["detected"].items()}  # fmt: skip
        caught = ", ".join(f"{k} {v['rate']:.0%} of {v['n']}" for k, v in got.items()
                           if v.get("n"))  # fmt: skip
        lines += [f"The rule's measured rates ({s or 'every setting'}; held-out pairs): false "
                  f"alarms {fa['rate']:.1%} of {fa['n']} healthy pairs; detected: {caught} "
                  f"({rates.get('date')}, `{rates.get('command')}`).", ""]  # fmt: skip
    return lines


def write_report(r: dict[str, Any], out: Any) -> None:
    """``report.json``, ``report.md`` and ``loss.png`` (both curves, their difference and
    the noise envelope) in ``out``."""
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _plot(r, out / "loss.png")
    (out / "report.json").write_text(json.dumps(r, indent=2) + "\n")
    rates = r.get("rates")
    lines = [
        f"# Parity of `{r['log']}` with its control `{r['controls'][0]}`", "",
        "Read: " + "; ".join(r["read"]) + ".", "",
        f"**{'PASSED' if r['passed'] else 'FAILED'}** - rule: {r['rule']}.", "",
        summary_line(r), "",
        *([f"Advice: {r['advice']}.", ""] if r.get("advice") else []),
        *(rates_lines(rates, len(r["controls"])) if rates else
          ["No rates were measured for this rule (scripts/bench_parity.py --write-rates).",
           ""]),
        "![the test and its control, their difference and the noise](loss.png)", "",
        "| window (steps) | z | level (of the loss) | spikes |", "|---|---|---|---|",
        *[f"| {w['first_step']}-{w['last_step']} | {w['z']:.3g} | {w['level_rel']:+.2g} | "
          f"{w['spikes']} |" for w in r["windows"]],
        "",
    ]  # fmt: skip
    (out / "report.md").write_text("\n".join(lines))


def _plot(r: dict[str, Any], path: Any) -> None:
    from matplotlib.figure import Figure

    steps = np.asarray(r["steps"])
    t, c = np.asarray(r["test_loss"]), np.asarray(r["control_loss"])
    noise = np.asarray(r["noise_abs"])
    fig = Figure(figsize=(10, 5.5))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    top.plot(steps, c, color="tab:blue", lw=1.5, label=f"control: {r['controls'][0]}")
    top.plot(steps, t, color="black", lw=1.0, ls="--", label=f"test: {r['log']}")
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    bottom.fill_between(steps, -Z_DEPART * noise, Z_DEPART * noise, color="tab:green",
                        alpha=0.25, label=f"{Z_DEPART:g} x noise ({r['noise']})")  # fmt: skip
    bottom.plot(steps, t - c, color="black", lw=1.0, label="test - control")
    w = r["first_departing_window"]
    if w is not None:
        bottom.axvspan(w["first_step"], w["last_step"], color="tab:red", alpha=0.2,
                       label=f"first departing window (z {w['z']:.3g})")  # fmt: skip
    bottom.set_xlabel("step")
    bottom.set_ylabel("difference")
    bottom.legend(fontsize=7, loc="upper left")
    fig.suptitle("PASSED" if r["passed"] else f"FAILED: {r['how']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
