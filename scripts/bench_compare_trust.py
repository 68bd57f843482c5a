"""Does ``bench compare``'s trust check tell a busy machine from an idle one?

Runs ``refdl bench compare --json`` three times on the machine as it is (meant: idle),
then once with every core taken by a spinning process, and writes what each run
recorded - the ratio, its range over the rounds, the other processes' load, the
spreads, ``trusted`` - and whether each idle ratio lies within the other idle runs'
spread of ratios.

    .venv/bin/python scripts/bench_compare_trust.py --out docs/bench/compare/trust.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ARGS = ["--model", "lenet5", "--strategy", "single", "--devices", "1", "--steps", "25",
        "--warmup", "5", "--rounds", "3", "--json"]  # fmt: skip


def compare() -> dict:
    proc = subprocess.run([sys.executable, "-m", "refdl.bench", "compare", *ARGS],
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"bench compare failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    out["warned"] = "warning: the ratio cannot be trusted" in proc.stderr
    return out


def row(r: dict, label: str) -> dict:
    x = r["rows"][0]
    return {"run": label, "ratio": x["refdl_vs_torch"], "range": x["refdl_vs_torch_range"],
            "others_load_cores": r["others_load_cores"], "spread": r["spread"],
            "trusted": r["trusted"], "warned": r["warned"], "doubts": r["doubts"]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/bench/compare/trust.json")
    args = ap.parse_args()
    idle = [row(compare(), f"idle {i + 1}") for i in range(3)]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]  # fmt: skip
    try:
        time.sleep(1.0)
        busy = row(compare(), "busy")
    finally:
        for h in hogs:
            h.kill()
    ratios = [r["ratio"] for r in idle]
    lo, hi = min(min(r["range"]) for r in idle), max(max(r["range"]) for r in idle)
    result = {
        "command": "refdl bench compare " + " ".join(ARGS),
        "date": time.strftime("%Y-%m-%d"),
        "cores": os.cpu_count(),
        "runs": [*idle, busy],
        "idle_ratios": ratios,
        "idle_rounds_range": [lo, hi],
        "each_idle_ratio_within_the_rounds_range": all(lo <= v <= hi for v in ratios),
        "idle_ratios_spread": (max(ratios) - min(ratios)) / sorted(ratios)[1],
        "busy_warned": busy["warned"],
        "idle_warned": [r["warned"] for r in idle],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in result["runs"]:
        print(f"{r['run']:7s} ratio {r['ratio']:.2f} (rounds {r['range'][0]:.2f}-"
              f"{r['range'][1]:.2f}), others {r['others_load_cores']['during']:.2f} cores, "
              f"trusted {r['trusted']}")  # fmt: skip
    within = result["each_idle_ratio_within_the_rounds_range"]
    print(f"idle ratios within the rounds' range: {within}; busy run warned: "
          f"{busy['warned']}; wrote {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
