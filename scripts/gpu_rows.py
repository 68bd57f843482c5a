"""The measured-here rows of the published data set, made from ``bench_gpu.py`` results.

A lent accelerator's step times become ``[[point]]`` rows of
``docs/published/measurements.toml`` (calibration part, one source per results
file). Copying them by hand invites typos in the very numbers the fit reads, so
this script writes them and the tests check that every measured-here row equals
its results file.

    python scripts/gpu_rows.py docs/bench/gpu/gpu_steps-2026-12-01.json        # print new rows
    python scripts/gpu_rows.py docs/bench/gpu/gpu_steps-2026-12-01.json --write

Which cases become rows: the shape-only paper models and the GPT-2-small-shaped
transformer (the only GPT size ``refdl predict`` knows), each timed without error.
Left out, with the reason: the LSTM LM (launch-bound, not a FLOP-rate point), GPT
rows timed with the pre-cuDNN attention (run 1), and refdl's own small models
(launch-bound at batch 64). A row already in the data set is not written again.
After ``--write``, rerun ``python scripts/fit_achieved.py`` so the profiles take them in.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from refdl.bench.published import DATA  # noqa: E402  (the data set bench published reads)

# device_kind as jax reports it -> the card's profile.
PROFILES = {"H100": ("h100", "h100-nvlink"), "A100": ("a100", "a100-nvlink")}
LEFT_OUT = {"lstm_lm_medium": "launch-bound (35 sequential steps at batch 20)"}


def profile_of(device: str) -> tuple[str, str]:
    """(short card name, refdl profile) of a jax ``device_kind``; exits if refdl has none."""
    for key, value in PROFILES.items():
        if key in device:
            return value
    raise SystemExit(f"gpu_rows: no refdl profile for device {device!r}; add one to PROFILES")


def source_id(doc: dict) -> str:
    """``refdl-<card>-<date>``: one source per results file."""
    return f"refdl-{profile_of(doc['device'])[0]}-{doc['date']}"


def usable(case: dict) -> str:
    """Why a case is not a row ("" when it is one)."""
    if "error" in case or not case.get("step_time_s"):
        return "no time (" + case.get("error", "not timed")[:60] + ")"
    if case["group"] == "own":
        return "refdl's own small model: launch-bound"
    if case["group"] in ("sweep", "microbatch"):
        return "a shape of its own (scripts/bench_microbatch.py sets it beside predict)"
    if case["group"] == "gpt":
        if case["model"] != "gpt2-small":
            return "no shape-only model of this GPT size"
        if "before" in case.get("attention", ""):
            return "pre-cuDNN attention (kept as 'before')"
    return LEFT_OUT.get(case["model"], "")


def rows(doc: dict, rel: str) -> list[dict]:
    """The ``[[point]]`` rows of one results file, in its case order."""
    hw = profile_of(doc["device"])[1]
    if doc.get("quick"):
        raise SystemExit(f"gpu_rows: {rel} is a --quick dry run (tiny shapes), not a measurement")
    out = []
    for case in doc["cases"]:
        if usable(case):
            continue
        gpt = case["group"] == "gpt"
        run = f"run {case['run']}, " if "run" in case else ""
        what = "refdl transformer at GPT-2 small shape (12 x 768, untied output layer), "
        what += "cuDNN attention" if gpt else ""
        out.append(
            {
                "source": source_id(doc),
                "kind": "step",
                "where": f"{rel}, {run}{case['group']} {case['model']} {case['dtype']} "
                f"batch {case['batch']}",
                "quote": f"step_time_s {case['step_time_s']:.6g} (median of "
                f"{case['steps_timed']} steps)",
                "hw": hw,
                "library": "jax",
                "model": "gpt2" if gpt else case["model"],
                "precision": case["dtype"],
                "batch_per_worker": case["batch"],
                "workers": 1,
                "nodes": 1,
                "metric": "time_s",
                "value": float(f"{case['step_time_s']:.6g}"),
                "note": f"memory plan {case['memory_plan_bytes'] / 2**30:.2f} GiB; "
                + (what if gpt else "shape-only paper model (refdl.perf.zoo)"),
            }
        )
    return out


def as_toml(row: dict) -> str:
    """One ``[[point]]`` table."""
    lines = ["[[point]]"]
    for k, v in row.items():
        lines.append(f"{k} = {json.dumps(v) if isinstance(v, str) else v}")
    return "\n".join(lines) + "\n"


def source_block(doc: dict, rel: str) -> str:
    """The ``[[source]]`` table of one results file."""
    return (
        "[[source]]\n"
        f'id = "{source_id(doc)}"\n'
        f"citation = \"Measured here: refdl's single-device training step (forward, backward, "
        f"SGD update) on a lent {doc['device']}, jax {doc['jax']}, {doc['date']}; "
        f'scripts/bench_gpu.py, results in {rel} (commands there)"\n'
        'url = ""\n'
        'part = "calibration"\n'
        'note = "measured-here rows, written by scripts/gpu_rows.py; synthetic inputs on the '
        "device; fp32 means JAX's default precision (TF32 matrix units on NVIDIA); "
        'bf16 = fp32 master weights, bf16 compute"\n'
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="gpu_steps*.json files from bench_gpu.py")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--write", action="store_true", help="append the new rows to --data")
    args = ap.parse_args(argv)
    data = Path(args.data)
    text = data.read_text(encoding="utf-8")
    raw = tomllib.loads(text)
    have = {(p["source"], p.get("where")) for p in raw.get("point", [])}
    sources = {s["id"] for s in raw.get("source", [])}
    blocks = []
    for name in args.results:
        path = Path(name).resolve()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        doc = json.loads(path.read_text(encoding="utf-8"))
        sid = source_id(doc)
        new = [r for r in rows(doc, rel) if (r["source"], r["where"]) not in have]
        for case in doc["cases"]:
            if why := usable(case):
                print(f"# {sid}: {case['group']} {case['model']} {case['dtype']}: {why}",
                      file=sys.stderr)  # fmt: skip
        if sid not in sources and new:
            blocks.append(source_block(doc, rel))
            sources.add(sid)
            text = re.sub(r'^(calibration = \[.*)\]$', rf'\1, "{sid}"]', text, count=1,
                          flags=re.M)  # fmt: skip
        blocks += [as_toml(r) for r in new]
        print(f"# {sid}: {len(new)} new rows", file=sys.stderr)
    if args.write and blocks:
        data.write_text(text.rstrip("\n") + "\n\n" + "\n".join(blocks), encoding="utf-8")
        print(f"wrote {len(blocks)} tables to {data}; now run scripts/fit_achieved.py",
              file=sys.stderr)  # fmt: skip
    elif blocks:
        print("\n".join(blocks), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
