"""Measure `refdl validate --results`' error rates on runs it was not tuned on.

Healthy logs: the documented settings (mlp and lenet5 on the digits, momentum 0.9, lr
0.05, batch 64, 200 steps) trained by plain PyTorch and Keras scripts
(scripts/user_runs/), each with its own initialisation, its own random split and two
batch samplers (reshuffled epochs; random batches with replacement). Buggy logs: the same
scripts with one planted mistake each, the log still declaring the documented
configuration: gradients never zeroed, learning rate x10 and x0.1, 20 % of labels
replaced at random, data sorted by class and read in order, weights initialised at 10x
the scale, momentum dropped. Every log is validated with the default rule and seeds; the
table gives the share of healthy logs passed (the false-alarm rate is the rest) and the
share of each bug failed, with the statistics that caught it.

    .venv/bin/python scripts/bench_validate.py --quick            # a few seeds, < 10 min
    .venv/bin/python scripts/bench_validate.py --out docs/bench/validate --write-rates

Framework seeds start at --first-seed (default 100): the rule's margins and the
random-split reference were chosen looking at seeds 1-6 of the same scripts, so the
default seeds are held out. Writes OUT/bench_validate.json and OUT/bench_validate.md (the
logs and refdl's seed cache go to --work, a temporary folder by default);
--write-rates also writes the measured rates into src/refdl/validate/rates.json, which
every report quotes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from refdl.validate import statistical  # noqa: E402
from refdl.validate.results import RATES, results_report  # noqa: E402

SCRIPTS = {
    "torch": ROOT / "scripts/user_runs/torch_digits.py",
    "keras": ROOT / "scripts/user_runs/keras_digits.py",
}
BUGS = ("no-zero-grad", "lr-x10", "lr-x0.1", "label-noise", "sorted", "init-x10", "no-momentum")
SAMPLERS = ("shuffle", "replacement")


def work_dir() -> Path:
    """A fresh temporary folder for the logs and the seed cache."""
    return Path(tempfile.mkdtemp(prefix="refdl-bench-validate-"))


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cells(args: argparse.Namespace) -> list[dict]:
    """Every (framework, model, sampler or bug) cell with its seeds."""
    out = []
    first = args.first_seed
    for fw in args.frameworks.split(","):
        for model in args.models.split(","):
            for sampler in SAMPLERS:
                seeds = list(range(first, first + args.healthy_seeds))
                out.append(
                    {"fw": fw, "model": model, "sampler": sampler, "bug": None, "seeds": seeds}
                )
            for i, bug in enumerate(BUGS):
                lo = first + 1000 + i * 100
                seeds = list(range(lo, lo + args.bug_seeds))
                # half the buggy runs with each sampler
                out.append(
                    {
                        "fw": fw,
                        "model": model,
                        "sampler": SAMPLERS[i % 2],
                        "bug": bug,
                        "seeds": seeds,
                    }
                )
    return out


def train(cell: dict, logs: Path) -> list[Path]:
    """Run one cell's script (one process, all its seeds); its logs."""
    cmd = [
        sys.executable,
        str(SCRIPTS[cell["fw"]]),
        "--out",
        str(logs),
        "--model",
        cell["model"],
        "--sampler",
        cell["sampler"],
        "--seeds",
        ",".join(map(str, cell["seeds"])),
    ] + (["--bug", cell["bug"]] if cell["bug"] else [])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench_validate: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    name = f"{cell['fw']}-{cell['model']}-{cell['sampler']}-{cell['bug'] or 'healthy'}"
    return [logs / f"{name}-s{s}.jsonl" for s in cell["seeds"]]


def validate(log: Path, cache: Path, seeds: int) -> dict:
    args = Namespace(
        results=str(log),
        hw="local",
        seeds=seeds,
        seed_cache=str(cache),
        config=None,
        set=None,
        scalars=None,
        loss_rtol=None,
        param_rtol=None,
    )
    r = results_report(args)
    return {
        "log": log.name,
        "passed": r["passed"],
        "failed": r["failed"],
        "p_value": r["p_value"],
        "statistics": {
            s["name"]: {
                "value": s.get("value"),
                "refdl_mean": s.get("refdl_mean"),
                "p_value": s.get("p_value"),
                "departs": s["departs"],
            }
            for s in r["statistics"]
        },
    }


def rate(ok: int, n: int) -> dict:
    return {"rate": round(ok / n, 6) if n else None, "k": ok, "n": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 healthy seeds a cell, 1 per bug")
    ap.add_argument("--out", help="the table (default docs/bench/validate; --quick: --work)")
    ap.add_argument("--work", help="the logs and refdl's seed cache (default: a new temp folder)")
    ap.add_argument("--frameworks", default="torch,keras")
    ap.add_argument("--models", default="mlp,lenet5")
    ap.add_argument("--healthy-seeds", type=int, default=20, help="per framework, model, sampler")
    ap.add_argument("--bug-seeds", type=int, default=5, help="per framework, model and bug")
    ap.add_argument("--first-seed", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=10, help="refdl's seeds (validate's default)")
    ap.add_argument(
        "--write-rates",
        action="store_true",
        help="write the measured rates into src/refdl/validate/rates.json",
    )
    args = ap.parse_args()
    if args.quick:
        args.healthy_seeds, args.bug_seeds = 2, 1
    work = Path(args.work) if args.work else work_dir()
    out = Path(args.out or (work if args.quick else ROOT / "docs/bench/validate"))
    out.mkdir(parents=True, exist_ok=True)
    logs, cache = work / "logs", work / "seed-cache"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    todo = cells(args)
    n_logs = sum(len(c["seeds"]) for c in todo)
    say(f"training {n_logs} logs in {len(todo)} cells (PyTorch and Keras scripts, 2 at a time)")
    paths: dict[str, list[Path]] = {}
    with ThreadPoolExecutor(2) as pool:
        futures = {pool.submit(train, c, logs): c for c in todo}
        for i, (fut, c) in enumerate(futures.items(), 1):
            key = f"{c['fw']}-{c['model']}-{c['sampler']}-{c['bug'] or 'healthy'}"
            paths[key] = fut.result()
            say(f"  {i}/{len(todo)} {key}: {len(c['seeds'])} logs")
    say(f"validating {n_logs} logs against {args.seeds} refdl seeds per configuration")
    results: dict[str, list[dict]] = {}
    done = 0
    for key, ps in paths.items():
        results[key] = [validate(p, cache, args.seeds) for p in ps]
        done += len(ps)
        passed = sum(r["passed"] for r in results[key])
        say(f"  {done}/{n_logs} {key}: {passed}/{len(ps)} passed")
    healthy = [r for k, rs in results.items() if k.endswith("-healthy") for r in rs]
    by_bug: dict[str, list[dict]] = defaultdict(list)
    for k, rs in results.items():
        for bug in BUGS:
            if k.endswith("-" + bug):
                by_bug[bug].extend(rs)
    table = {
        "healthy_passed": rate(sum(r["passed"] for r in healthy), len(healthy)),
        "healthy_by_cell": {
            k: rate(sum(r["passed"] for r in rs), len(rs))
            for k, rs in results.items()
            if k.endswith("-healthy")
        },
        "bugs_failed": {
            b: {
                **rate(sum(not r["passed"] for r in rs), len(rs)),
                "caught_by": dict(Counter(f for r in rs for f in r["failed"])),
            }
            for b, rs in by_bug.items()
        },
    }
    fa = 1 - table["healthy_passed"]["rate"]
    date = datetime.date.today().isoformat()
    command = "python scripts/bench_validate.py " + " ".join(sys.argv[1:])
    record = {
        "command": command,
        "date": date,
        "seconds": round(time.time() - t0),
        "rule": statistical.RULE,
        "rule_fingerprint": statistical.rule_fingerprint(),
        "refdl_seeds": args.seeds,
        "first_seed": args.first_seed,
        **table,
        "results": results,
    }
    (out / "bench_validate.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"`{command}` ({date}, {record['seconds']} s, refdl seeds {args.seeds})",
        "",
        "| logs | runs | verdict as wanted | rate | caught by |",
        "|---|---:|---:|---:|---|",
        f"| healthy (PyTorch, Keras; mlp, lenet5; 2 samplers) | "
        f"{table['healthy_passed']['n']} | passed {table['healthy_passed']['k']} | "
        f"{table['healthy_passed']['rate']:.1%} | - |",
    ]
    for b, v in table["bugs_failed"].items():
        caught = ", ".join(f"{k} {n}" for k, n in sorted(v["caught_by"].items()))
        lines.append(f"| {b} | {v['n']} | failed {v['k']} | {v['rate']:.1%} | {caught} |")
    lines += [
        "",
        "Healthy logs passed, by cell:",
        "",
        *[f"- {k}: {v['k']}/{v['n']}" for k, v in table["healthy_by_cell"].items()],
    ]
    (out / "bench_validate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.write_rates:
        n_bugs = sum(v["n"] for v in table["bugs_failed"].values())
        k_bugs = sum(v["k"] for v in table["bugs_failed"].values())
        RATES.write_text(
            json.dumps(
                {
                    "rule_fingerprint": statistical.rule_fingerprint(),
                    "false_alarm_rate": {"rate": round(fa, 6), "n": table["healthy_passed"]["n"]},
                    "detection_rate": {
                        "rate": round(k_bugs / n_bugs, 6),
                        "n": n_bugs,
                        "by_bug": {b: v["rate"] for b, v in table["bugs_failed"].items()},
                    },
                    "refdl_seeds": args.seeds,
                    "note": f"measured by `{command}` on {date} with {args.seeds} refdl seeds "
                    "on PyTorch and Keras runs of mlp and lenet5 on the digits "
                    "(docs/validation.md)",
                },
                indent=2,
            )
            + "\n"
        )
        say(f"rates written to {RATES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
