"""refdl's Muon against ``torch.optim.Muon`` (issue 51): how ``refdl validate --optimizer
muon`` judges PyTorch's bf16 Newton-Schulz, measured.

PyTorch runs Muon's Newton-Schulz in bf16, so its run departs from refdl's by bf16's
effect. ``refdl validate`` runs refdl twice (as is, and with the iteration rounded as
PyTorch's, ``newton_schulz_bf16``) and tolerates, per check, ``MUON_BF16_FACTOR`` times the
distance that rounding alone moves refdl's run. This script measures, per check, PyTorch's
distance over that envelope, on a tuning half (which set the factors) and a held-out half
(other seeds, and the pipeline layout, which measures the rule):

- healthy pairs (single, DDP, FSDP2, and held out the 1F1B pipeline; mlp and the
  transformer; several seeds): the ratio a factor must clear (no false alarm);
- torch.optim.Muon configured unlike refdl's (momentum 0.9, Nesterov off, Moonlight's
  RMS-matched scale): the ratio a factor must stay under, to catch them;
- ``--torch-muon-ns native`` in float64 (PyTorch's iteration without its bf16 cast): the
  algorithm's own difference, which should be rounding (~1e-15).

Writes ``docs/bench/muon/torch.json`` and ``torch.png``.

    .venv/bin/python scripts/bench_torch_muon.py      # ~13 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "bench" / "muon"
LAYOUTS = {"single": [], "data": ["--strategy", "data", "--devices", "2"],
           "fsdp": ["--strategy", "fsdp", "--zero", "3", "--devices", "2"],
           "pipeline": ["--strategy", "pipeline", "--devices", "2"]}  # fmt: skip
TUNING = {"layouts": ("single", "data", "fsdp"), "seeds": (0, 1, 2), "plant_seeds": (0, 1)}
HELD_OUT = {"layouts": ("single", "data", "pipeline"), "seeds": (3, 4, 5),
            "plant_seeds": (2, 3)}  # fmt: skip
PLANTS = ("muon-momentum", "muon-nesterov", "muon-scale")
NATIVE = ("single", "data", "fsdp", "model")


def run(flags: list[str]) -> dict:
    """One ``refdl validate --framework torch`` comparison; what this benchmark reads."""
    from refdl.validate import __main__ as VM
    from refdl.validate.exact import MUON_BF16_CHECKS, validate
    from refdl.validate.request import Request

    t = time.perf_counter()
    args = VM.build_parser().parse_args(["--framework", "torch", "--optimizer", "muon", *flags])
    r = validate(Request.of(vars(args)))
    env = r["muon_bf16_envelope"]
    ratios = {k: r["checks"][k] / env[k] for k in MUON_BF16_CHECKS} if env else None
    return {"flags": flags, "passed": r["passed"], "failed": r["failed"], "checks": r["checks"],
            "envelope": env, "ratio": ratios, "worst_ratio": max(ratios.values()) if env else None,
            "to_rounded_run": r["muon_bf16_run_distance"], "tolerance": r["tolerance"],
            "seconds": time.perf_counter() - t}  # fmt: skip


def half(name: str, cases: dict, steps: list[str]) -> dict[str, list]:
    """The healthy pairs and the plants of one half (tuning or held out)."""
    rows: dict[str, list] = {"healthy": [], "planted": []}
    for seed in cases["seeds"]:
        for model in ("mlp", "transformer"):
            for lay in cases["layouts"]:
                if model == "transformer" and lay in ("fsdp", "pipeline"):
                    continue  # the transformer's fsdp and pipeline twins: not in ~13 min
                r = run([*LAYOUTS[lay], "--model", model, "--seed", str(seed), *steps])
                rows["healthy"].append({"layout": lay, "model": model, "seed": seed, **r})
                print(f"{name} healthy {lay} {model} seed {seed}: worst ratio "
                      f"{r['worst_ratio']:.2f} passed {r['passed']} ({r['seconds']:.0f} s)",
                      flush=True)  # fmt: skip
    for seed in cases["plant_seeds"]:
        for plant in PLANTS:
            for model in ("mlp", "transformer"):
                r = run(["--model", model, "--seed", str(seed), "--plant-bug", plant, *steps])
                rows["planted"].append({"plant": plant, "model": model, "seed": seed, **r})
                print(f"{name} planted {plant} {model} seed {seed}: worst ratio "
                      f"{r['worst_ratio']:.2f} passed {r['passed']}", flush=True)  # fmt: skip
    return rows


def rates(rows: dict[str, list]) -> dict:
    """The rule's false alarms and detections on one half, and the ratios per check."""
    from refdl.validate.exact import MUON_BF16_CHECKS

    return {
        "false_alarms": sum(not r["passed"] for r in rows["healthy"]),
        "healthy": len(rows["healthy"]),
        "detected": sum(not r["passed"] for r in rows["planted"]),
        "planted": len(rows["planted"]),
        "healthy_ratio_max": {k: max(r["ratio"][k] for r in rows["healthy"])
                              for k in MUON_BF16_CHECKS},
        "planted_worst_ratio_min": min(r["worst_ratio"] for r in rows["planted"]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    from refdl.validate.exact import MUON_BF16_FACTOR

    steps = ["--steps", str(a.steps)]
    tuning, held_out = half("tuning", TUNING, steps), half("held-out", HELD_OUT, steps)
    native = []
    for lay in NATIVE:
        flags = LAYOUTS.get(lay, ["--strategy", lay, "--devices", "2"])
        r = run([*flags, "--model", "mlp", "--precision", "fp64", "--torch-muon-ns", "native",
                 *steps])  # fmt: skip
        native.append({"layout": lay, "model": "mlp", **r})
        print(f"native fp64 {lay}: parameters {r['checks']['param_rel_l2']:.1e} passed "
              f"{r['passed']}", flush=True)  # fmt: skip
    summary = {
        "factor": MUON_BF16_FACTOR,
        "tuning": rates(tuning),
        "held_out": rates(held_out),
        "native_fp64_param_rel_l2_max": max(r["checks"]["param_rel_l2"] for r in native),
    }
    doc = {"command": " ".join(["python", "scripts/bench_torch_muon.py", *(argv or sys.argv[1:])]),
           "date": datetime.date.today().isoformat(), "steps": a.steps, "summary": summary,
           "tuning": tuning, "held_out": held_out, "native_fp64": native}  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "torch.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, a.out / "torch.png")
    print(json.dumps(summary, indent=1))
    return 0


TITLES = {"first_update_param_rel_l2": "first update: parameters' relative L2 distance",
          "param_rel_l2": "last step: parameters' relative L2 distance",
          "loss_rel": "loss: relative difference"}  # fmt: skip


def plot(doc: dict, path: Path) -> None:
    """Each comparison's ratio per check over the bf16 envelope, healthy pairs and plants
    of both halves, and each check's factor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factors = doc["summary"]["factor"]
    fig, axes = plt.subplots(1, len(factors), figsize=(11, 3.8), sharey=True)
    for ax, (check, factor) in zip(axes, factors.items(), strict=True):
        x = 0
        for part, marker in (("tuning", "o"), ("held_out", "^")):
            for kind, color in (("healthy", "tab:blue"), ("planted", "tab:red")):
                ys = [r["ratio"][check] for r in doc[part][kind]]
                ax.scatter(range(x, x + len(ys)), ys, color=color, marker=marker, s=18,
                           label=f"{kind}, {part.replace('_', ' ')}")  # fmt: skip
                x += len(ys)
        ax.axhline(factor, color="black", ls="--", lw=1, label="tolerance (factor)")
        ax.set_yscale("log")
        ax.set_xticks([])
        ax.set_xlabel("cases: tuning (o), then held out (^)", fontsize=8)
        ax.set_title(TITLES.get(check, check.replace("_", " ")), fontsize=9)
    axes[0].set_ylabel("PyTorch's distance / bf16's effect on refdl")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"refdl validate --optimizer muon vs torch.optim.Muon, {doc['steps']} steps "
                 f"({doc['date']}); a case fails where any of its checks is above the line",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
