"""Validate a framework's own training log (``--results FILE``) as users have it.

Which comparison is made follows from what the log declares (the report says
which and why):

- **exact**, when its configuration carries ``"start"``: the fingerprint of
  refdl's exported start (``refdl validate --export-start DIR``) for the same
  configuration. Both sides then began from the same weights and saw the same
  batches, so per-step losses (and, with ``final_params``, the final weights)
  are compared at fp32 tolerances;
- **statistical** otherwise (``refdl.validate.statistical``): refdl reruns the
  configuration over ``--seeds`` seeds, from the log's declared initialisation,
  and places the framework's curve and final accuracy in that spread.

The configuration names what changes results (``CONFIG_VALUES``): the data set
and its preprocessing, initialisation, optimizer details, loss reduction, dtype.
Keys a log leaves out are listed as the assumptions refdl made; keys it does not
know are warnings. Throughput is put in context: the framework's samples/s, refdl's
on this machine, and the performance model's prediction for the declared profile.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from refdl import hw as hwmod
from refdl.assemble import resolve
from refdl.config.files import check_regular
from refdl.config.spec import RunSpec
from refdl.data import DATASETS
from refdl.errors import UsageError
from refdl.perf import PredictOptions
from refdl.perf.prediction import predict_steps
from refdl.strategies import traits_of
from refdl.validate import statistical
from refdl.validate.exact import LOSS_RTOL, PARAM_RTOL, compare_params, reference_run
from refdl.validate.export import start_of, start_spec
from refdl.validate.logs import CONFIG_KEYS, INITS, PARAMS_LIMIT, checked_log, params_path
from refdl.validate.request import Request

RATES = Path(__file__).with_name("rates.json")  # written by scripts/bench_validate.py
# Keys that change results: when a log leaves one out, the report names what refdl assumed.
ASSUMED = {
    "dataset": "the model's default data set",
    "preprocessing": "refdl's preprocessing of that data set",
    "split": "the log's own random 80/20 train/test split (refdl's seeds draw theirs at "
    'random too); declare "split": "refdl" for refdl\'s fixed split, "all" if the test rows '
    "were trained on too",
    "init": "refdl's lecun_normal (the log's framework may draw otherwise: PyTorch's and "
    'Keras\' defaults are "torch" and "keras", MXNet\'s bare net.initialize() is '
    '"mxnet"; a different start is the likely cause of a failure)',
    "optimizer": "the model's default optimizer",
    "lr": "the model's default learning rate",
    "momentum": "0.9",
    "weight_decay": "0",
    "lr_schedule": "constant",
    "loss": "cross_entropy",
    "loss_reduction": "mean over the batch",
    "dtype": "float32",
    "batch_size": "64",
}
WARMUP = 0.1  # the first tenth of a log's rows is start-up (compilation, caches), not speed


def declared(config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(assumptions, warnings)``: the result-changing keys the log leaves out (with what
    refdl assumed), and the keys it gives that refdl does not know or cannot honour."""
    # an exported start fixes the split, the initial weights and the data order
    skip = {"split", "init", "data_order"} if config.get("start") else set()
    assumptions = [
        f"{k} not given: assumed {v}"
        for k, v in ASSUMED.items()
        if k not in config and k not in skip
    ]
    framework = str(config.get("framework", "")).lower()
    own = {
        "torch": "torch_default",
        "pytorch": "torch_default",
        "tensorflow": "keras_default",
        "keras": "keras_default",
    }.get(framework)
    if "init" not in config and own and "init" not in skip:
        assumptions = [
            a + f"; a {framework} run starts from its framework's own draws unless "
            f'it loads other weights: declare "init": "{own}"'
            if a.startswith("init ")
            else a
            for a in assumptions
        ]
    warnings = [
        f"unknown configuration key {k!r} (ignored); known: {', '.join(CONFIG_KEYS)}"
        for k in sorted(set(config) - set(CONFIG_KEYS))
    ]
    if config.get("dtype", "float32") != "float32":
        warnings.append(f"dtype {config['dtype']}: refdl's reference runs float32")
    if "momentum" in config and not _takes_momentum(config):
        warnings.append(f"momentum {config['momentum']}: ignored, the optimizer "
                        f"{_optimizer(config)} has no heavy ball")  # fmt: skip
    if config.get("loss_reduction") == "sum":
        warnings.append(
            "loss_reduction sum: refdl runs the mean with lr x batch_size (the same SGD steps)"
        )
    return assumptions, warnings


def _optimizer(config: dict[str, Any]) -> str:
    """The log's optimizer, else its model's (a name refdl knows or not)."""
    from refdl.models import MODELS

    if "optimizer" in config:
        return str(config["optimizer"])
    model = config.get("model")
    return str(MODELS.get(model).defaults.get("optimizer", "sgd")) if model in MODELS else "?"


def _takes_momentum(config: dict[str, Any]) -> bool:
    """Whether the log's optimizer has a heavy ball (a log may record momentum beside Adam)."""
    return _optimizer(config) in ("momentum", "nesterov")


def _spec(config: dict[str, Any], steps: int) -> RunSpec:
    """refdl's single-device run of the log's configuration (for the seeds)."""
    kw: dict[str, Any] = {}
    for key in ("dataset", "lr", "momentum", "weight_decay", "lr_schedule", "loss"):
        if key in config and (key != "momentum" or _takes_momentum(config)):
            kw[key] = config[key]
    if "optimizer" in config:
        nesterov = config.get("nesterov") and config["optimizer"] == "momentum"
        kw["optimizer"] = "nesterov" if nesterov else config["optimizer"]
    if config.get("loss_reduction") == "sum" and "lr" in config:
        kw["lr"] = config["lr"] * int(config.get("batch_size", 64))
    kw["init"] = INITS[config.get("init", "refdl")]
    opts = tuple((str(k), str(v)) for k, v in config.get("data_opts", {}).items())
    if config.get("split") == "all":  # the test rows trained on too: so do refdl's seeds
        opts = (*opts, ("train_on_test", "1"))
    if opts:
        kw["data_opts"] = opts
    # refdl's seeds are 0 .. K-1 whatever the log's seed: the framework's seed draws from
    # its own generator, so it says nothing about refdl's (and a configuration's seeds are
    # computed once, --seed-cache).
    return RunSpec(
        strategy="single",
        model=config["model"],
        steps=steps,
        batch_size=int(config.get("batch_size", 64)),
        progress=False,
        **kw,
    )


def _choose(config: dict[str, Any], steps: int) -> tuple[str, str]:
    """``(comparison, why)`` from what the log declares."""
    start = config.get("start")
    if not start:
        return "statistical", (
            'the log declares no exported start ("start"), so its initial weights and '
            "batches are its own: refdl reruns the configuration with several seeds and "
            "compares the spread"
        )
    mine = start_of(start_spec({**config, "steps": steps}))[3]
    if mine == start:
        return "exact", (
            f"the log's start {start} is refdl's exported start of this "
            "configuration: same weights, same batches, compared step by step"
        )
    return "statistical", (
        f"the log declares start {start}, but refdl's export of this configuration is "
        f"{mine} (model, data set, seed, batch size or steps differ): compared statistically"
    )


def rate_kind(rows: list[dict], batch_size: int) -> str:
    """Whether a log's samples_per_s are ``cumulative`` (samples so far / time so far) or
    ``per_step``, where its configuration does not say: the time each row implies,
    ``(step + 1) x batch / rate``, never falls in a cumulative log, and falls after a
    per-step log's slow first step. (A per-step log without one reads the same either
    way: its rate is constant.)"""
    per = [r for r in rows if r.get("samples_per_s")]
    implied = [(r["step"] + 1) * batch_size / r["samples_per_s"] for r in per]
    rising = all(b >= a for a, b in itertools.pairwise(implied))
    return "cumulative" if len(implied) >= 3 and rising else "per_step"


def steady_rate(rows: list[dict], batch_size: int, kind: str) -> tuple[float | None, str]:
    """The log's steady-state samples/s and how it was read: the rows after the first
    tenth (start-up: compilation, caches), per-step figures by their median, cumulative
    ones (samples so far / time so far) and wall times by samples over time between the
    first and last steady row. ``kind`` ``auto``: ``rate_kind`` decides."""
    guessed = ""
    if kind == "auto":
        kind = rate_kind(rows, batch_size)
        guessed = f"; read as {kind.replace('_', '-')} figures (set throughput= to say)"
    rate, how = _steady_rate(rows, batch_size, kind)
    return rate, how + guessed if rate is not None else how


def _steady_rate(rows: list[dict], batch_size: int, kind: str) -> tuple[float | None, str]:
    warm = max(1, int(len(rows) * WARMUP)) if len(rows) > 2 else 0
    steady = rows[warm:]
    first = f"steps {steady[0]['step']}-{steady[-1]['step']}" if steady else ""
    per = [r for r in steady if "samples_per_s" in r]
    if per and kind == "per_step":
        return float(statistics.median(r["samples_per_s"] for r in per)), (
            f"median of the log's per-step samples_per_s over {first} (the first {warm} rows "
            "dropped as start-up)"
        )
    if len(per) >= 2:  # cumulative: elapsed = samples so far / rate so far
        elapsed = [(r["step"] + 1) * batch_size / r["samples_per_s"] for r in per]
        rates = [(b["step"] - a["step"]) * batch_size / (eb - ea)
                 for a, b, ea, eb in zip(per, per[1:], elapsed, elapsed[1:], strict=False)
                 if eb > ea]  # fmt: skip
        if rates:  # the median of the intervals' rates: one slow row moves it little
            return float(statistics.median(rates)), (
                f"cumulative samples_per_s turned into samples over time, the median of the "
                f"intervals between steps {per[0]['step']} and {per[-1]['step']} (start-up "
                "excluded)"
            )
    timed = [r for r in steady if "wall_time" in r]
    if len(timed) >= 2 and timed[-1]["wall_time"] > timed[0]["wall_time"]:
        a, b = timed[0], timed[-1]
        return (b["step"] - a["step"]) * batch_size / (b["wall_time"] - a["wall_time"]), (
            f"batch size x steps over the wall time between steps {a['step']} and {b['step']} "
            "(the logged times; start-up excluded)"
        )
    return None, "the log gives no samples/s and no times"


def _throughput(
    rows: list[dict],
    config: dict[str, Any],
    args: Request,
    refdl_sps: float,
    spec: RunSpec,
) -> dict[str, Any]:
    """The framework's steady-state samples/s beside refdl's here and the prediction."""
    hw_name = config.get("hw", args.hw)
    profile = hwmod.load(hw_name)
    devices = int(config.get("devices", 1))
    # A logged strategy refdl knows that only splits the batch over devices is predicted as
    # itself; any other (a framework's own word, a mesh, workers) as one device's steps.
    strategy = config.get("strategy", "single")
    splits_batch = traits_of(strategy).axes == ("data",)
    opts = PredictOptions(microbatches=spec.microbatches or 1, schedule=spec.schedule)
    name = strategy if splits_batch else "single"
    pred = predict_steps(
        hw_name,
        name,
        traits_of(name),
        spec.model,
        spec.batch_size,
        [devices],
        "strong",
        opts,
    )[0]
    theirs, how = steady_rate(rows, spec.batch_size, config.get("throughput", "auto"))
    if theirs is None:
        note = "The log gives no samples/s and no times."
    else:
        to_pred, to_here = theirs / pred["throughput"], theirs / refdl_sps
        if hw_name == "local":
            note = (
                f"The framework ran at {to_here:.2f}x refdl's speed on this machine and "
                f"{to_pred:.2f}x the prediction for it; "
            )
            note += (
                "plausible for one machine."
                if 0.25 <= to_here <= 4
                else "far from refdl's here: was it measured on other hardware than declared?"
            )
        else:
            # the prediction's own uncertainty: its stated 80 % step-time interval, as
            # samples/s (refdl.perf.intervals); faster than the bound is never plausible
            low = max(pred["step_time_low_s"] or 0.0, pred["bound_step_time_s"])
            fast = spec.batch_size / low
            slow = spec.batch_size / (pred["step_time_high_s"] or pred["step_time_s"])
            note = (
                f"The framework ran at {to_pred:.2f}x the prediction for {profile.name} "
                f"(its 80 % interval: {slow / pred['throughput']:.2f}-"
                f"{fast / pred['throughput']:.2f}x); "
            )
            note += (
                "within what the profile's own uncertainty allows."
                if slow <= theirs <= fast
                else "faster than the prediction allows: the declared profile may be wrong."
                if theirs > fast
                else "below what the prediction allows: an input pipeline or "
                "synchronisation may bound it, or the hardware differs."
            )
    return {
        "framework": theirs,
        "how": how,
        "refdl_here": refdl_sps,
        "predicted": pred["throughput"],
        "predicted_hw": profile.name,
        "framework_vs_predicted": (theirs / pred["throughput"]) if theirs else None,
        "note": note,
    }


def measured_rates() -> dict[str, Any]:
    """The statistical rule's error rates as scripts/bench_validate.py measured them, if
    they were measured for the rule in force (same fingerprint); else an empty record."""
    try:
        rates = json.loads(RATES.read_text())
    except (OSError, ValueError):
        return {}
    return rates if rates.get("rule_fingerprint") == statistical.rule_fingerprint() else {}


def results_report(args: Request, checked: tuple[Any, int] | None = None) -> dict[str, Any]:
    """Compare a framework's log with refdl: exactly from an exported start, else over
    seeds (the module docstring); throughput in context; assumptions and warnings.
    ``checked``: what ``checked_log`` already returned for it."""
    log, steps = checked or checked_log(
        args.results,
        getattr(args, "config", None),
        getattr(args, "set", None),
        getattr(args, "scalars", None),
    )
    rows, config = log.rows, log.config
    logged = max(int(r["step"]) for r in rows) + 1
    cut = steps < logged  # --set steps=N: the first N steps only
    rows = [r for r in rows if int(r["step"]) < steps]
    if cut:  # what the log says of its end belongs to its own steps, not to these
        config = {k: v for k, v in config.items()
                  if k not in ("final_test_accuracy", "final_params")}  # fmt: skip
    assumptions, warnings = declared(config)
    if cut:
        warnings.append(f"compared the first {steps} of the log's {logged} steps: its final "
                        "accuracy and parameters are not compared")  # fmt: skip
    comparison, why = _choose(config, steps)
    if comparison == "exact" and config.get("final_params"):  # (checked_log: if it is there)
        check_regular(params_path(args.results, config["final_params"]),
                      f"--results {args.results}: final_params", PARAMS_LIMIT)  # fmt: skip
    theirs = {int(r["step"]): float(r["loss"]) for r in rows}
    accs = [r["test_accuracy"] for r in rows if "test_accuracy" in r]
    final_acc = config.get("final_test_accuracy", accs[-1] if accs else None)
    out: dict[str, Any] = {
        "log": str(args.results),
        "format": log.format,
        "read": log.notes,
        "config": config,
        "comparison": comparison,
        "why": why,
        "assumptions": assumptions,
        "warnings": warnings,
    }
    if comparison == "exact":
        spec = start_spec({**config, "steps": steps})
        ref = reference_run(spec)
        compared = [(t, ref.losses[t], theirs[t]) for t in range(steps) if t in theirs]
        # Relative to the larger of the step's and the first loss: fp32 differences grow
        # with the steps while the loss falls (200 steps of the mlp: 1.5e-5 on a loss of
        # 0.036 at the end, 4e-4 of it, 6e-6 of the first loss).
        scale = abs(ref.losses[0])
        rels = [abs(a - b) / max(abs(a), scale, 1e-12) for _, a, b in compared]
        tol = {"loss_rel": args.loss_rtol or LOSS_RTOL.get(spec.model, 1e-4)}
        failed = [] if rels and max(rels) <= tol["loss_rel"] else ["loss_rel"]
        out.update(
            steps_compared=len(compared),
            loss_max_rel_diff=max(rels) if rels else None,
            loss_max_abs_diff=max((abs(a - b) for _, a, b in compared), default=None),
            loss_rows=[{"step": t, "refdl": a, "framework": b} for t, a, b in compared],
            margin=tol["loss_rel"] - (max(rels) if rels else 0.0),
            p_value=None,
            statistics=[],
            false_alarm_rate=None,
            rates_note="the exact comparison's tolerances are fp32 rounding bounds "
            "(docs/validation.md), not a statistical rule",
        )
        if config.get("final_params"):
            params = _final_params(args.results, config["final_params"])
            d = compare_params(ref.params, params)
            tol["param_rel_l2"] = args.param_rtol or PARAM_RTOL.get(spec.model, 1e-4)
            out["param_rel_l2_diff"] = d["rel_l2"]
            if not d["rel_l2"] <= tol["param_rel_l2"]:
                failed.append("param_rel_l2")
        refdl_sps = spec.batch_size / statistics.median(ref.step_times[1:] or ref.step_times)
        out.update(
            tolerance=tol,
            failed=failed,
            passed=not failed,
            rule="passed when every logged step's |loss difference| is within the "
            "tolerance times the larger of refdl's loss at that step and at the first "
            "(and the final parameters, when given, within theirs)",
        )
    else:
        spec = _spec(config, steps)
        resplit = config.get("split", "own") != "refdl" and _has_split(spec)
        cache = Path(args.seed_cache) if getattr(args, "seed_cache", None) else None
        seeds = statistical.seed_runs(spec, args.seeds, cache, resplit)
        stats = statistical.compare(theirs, final_acc, seeds)
        refdl_sps = seeds.samples_per_s
        out.update(stats)
        out["init"] = spec.init
        out["splits"] = (
            "refdl's seeds each drew a random 80/20 split, as the log's run did"
            + (", and trained on the test rows too" if config.get("split") == "all" else "")
            if resplit
            else "refdl's fixed split"
        )
        window = stats["smoothing_window_steps"]
        smoothed = np.stack([statistical.smooth(c, window) for c in seeds.losses])
        out["seed_curves"] = {
            "mean": smoothed.mean(0).tolist(),
            "lo": smoothed.min(0).tolist(),
            "hi": smoothed.max(0).tolist(),
            "smoothed": window,
        }
        rates = measured_rates()
        out["false_alarm_rate"] = rates.get("false_alarm_rate")
        out["detection_rate"] = rates.get("detection_rate")
        out["rates_note"] = (
            rates.get("note") or "not measured for this rule: run scripts/bench_validate.py"
        )
    out["samples_per_s"] = _throughput(rows, config, args, refdl_sps, spec)
    return out


def _has_split(spec: RunSpec) -> bool:
    """Whether the spec's data set can draw another train/test split (``split`` option)."""
    return "split" in DATASETS.get(resolve(spec).dataset).options


def _final_params(log: str, name: str) -> dict[str, np.ndarray]:
    """The final weights a log points to (an npz in refdl's layout, relative to the log)."""
    path = check_regular(params_path(log, name), f"--results {log}: final_params", PARAMS_LIMIT)
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise UsageError(f"--results {log}: final_params {name}: cannot read it ({e})") from None


def summary_line(r: dict[str, Any]) -> str:
    """One line: which comparison, the verdict and its main figure."""
    verdict = "PASSED" if r["passed"] else "FAILED"
    if r["comparison"] == "exact":
        params = (
            f", final parameters' relative L2 difference {r['param_rel_l2_diff']:.2e} "
            f"(tolerance {r['tolerance']['param_rel_l2']:g})"
            if r.get("param_rel_l2_diff") is not None else ""
        )  # fmt: skip
        return (
            f"{r['log']}: exact comparison, {r['steps_compared']} steps, max relative loss "
            f"difference {r['loss_max_rel_diff']:.2e} (tolerance "
            f"{r['tolerance']['loss_rel']:g}){params}: {verdict}"
        )
    parts = []
    for st in r["statistics"]:
        if not st.get("logged"):
            continue
        mark = " DEPARTS" if st["departs"] else ""
        parts.append(
            f"{st['name']} {st['value']:.4g} (refdl {st['refdl_mean']:.4g}, "
            f"p {st['p_value']:.2g}){mark}"
        )
    why = "" if r["passed"] else f" ({', '.join(r['failed'])})"
    p = r["p_value"]
    return (
        f"{r['log']}: statistical comparison over {r['seeds']} seeds, "
        f"{'; '.join(parts)}; adjusted p {p:.2g}: {verdict}{why}"
        if p is not None
        else f"{r['log']}: statistical comparison over {r['seeds']} seeds: {verdict}{why}"
    )


def write_report(r: dict[str, Any], out: Path) -> None:
    """``report.json``, ``report.md`` and (statistical) ``loss.png`` in ``out``."""
    from refdl.validate.plot import loss_plot

    out.mkdir(parents=True, exist_ok=True)
    picture = r["comparison"] == "statistical"
    if picture:
        loss_plot(r, out / "loss.png")
    (out / "report.json").write_text(json.dumps(r, indent=2) + "\n")
    s = r["samples_per_s"]
    fmt = lambda v: "n/a" if v is None else f"{v:.4g}"  # noqa: E731
    lines = [
        f"# Validation of `{r['log']}`",
        "",
        f"Configuration: `{json.dumps(r['config'])}`",
        "",
        f"Read as {r['format']}" + (": " + "; ".join(r["read"]) if r["read"] else "") + ".",
        "",
        f"**Comparison: {r['comparison']}**, because {r['why']}.",
        "",
        f"**{'PASSED' if r['passed'] else 'FAILED'}** - rule: {r['rule']}."
        + (f" Failed: {', '.join(r['failed'])}." if r["failed"] else ""),
        "",
        summary_line(r),
        "",
    ]
    if picture:
        far = r.get("false_alarm_rate")
        lines += [
            (
                "The rule's measured false-alarm rate: "
                f"{far['rate']:.1%} of {far['n']} healthy runs; "
                if far
                else ""
            )
            + f"{r['rates_note']}.",
            "",
            "![refdl's seeds and the framework's loss](loss.png)",
            "",
        ]
    if r["assumptions"]:
        lines += ["Assumed (the log does not say):", "", *[f"- {a}" for a in r["assumptions"]], ""]
    if r["warnings"]:
        lines += ["Warnings:", "", *[f"- {w}" for w in r["warnings"]], ""]
    lines += [
        "| throughput | samples/s |",
        "|---|---|",
        f"| framework (steady state) | {fmt(s['framework'])} |",
        f"| refdl on this machine | {fmt(s['refdl_here'])} |",
        f"| predicted for `{s['predicted_hw']}` | {fmt(s['predicted'])} |",
        "",
        f"{s['note']} The log's figure: {s['how']}.",
        "",
    ]
    if r["comparison"] == "exact":
        if r.get("param_rel_l2_diff") is not None:
            lines += [
                f"Final parameters: relative L2 difference {r['param_rel_l2_diff']:.3e} "
                f"(tolerance {r['tolerance']['param_rel_l2']:g}).",
                "",
            ]
        lines += [
            "| step | refdl loss | framework loss |",
            "|---:|---:|---:|",
            *[f"| {x['step']} | {x['refdl']:.6f} | {x['framework']:.6f} |" for x in r["loss_rows"]],
        ]
    else:
        lines += [
            f"{r['seeds']} seeds from refdl's `{r['init']}` initialisation; {r['splits']}.",
            "",
            "| statistic | framework | refdl mean | refdl range | interval | p | departs |",
            "|---|---:|---:|---:|---:|---:|---|",
            *[
                f"| {st['name']} | {fmt(st.get('value'))} | {fmt(st.get('refdl_mean'))} | "
                f"{fmt(st.get('refdl_min'))}-{fmt(st.get('refdl_max'))} | "
                + (f"{st['interval'][0]:.4g}-{st['interval'][1]:.4g}" if "interval" in st else "")
                + f" | {fmt(st.get('p_value'))} | {'yes' if st['departs'] else 'no'} |"
                for st in r["statistics"]
            ],
            "",
            f"Adjusted p-value (Bonferroni over {r['statistics_compared']} statistics): "
            f"{fmt(r['p_value'])}; alpha {r['alpha']}.",
            "",
            "Described, not judged: the smoothed curve against the band "
            f"({r['band_rule']}, window {r['smoothing_window_steps']} steps): "
            f"{r['steps_outside_band']} of {r['steps_compared']} logged steps outside"
            + (
                f", first at step {r['first_departure']['step']} ({r['first_departure']['side']})"
                if r["first_departure"]
                else ""
            )
            + ".",
        ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
