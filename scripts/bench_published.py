"""Predict published data-parallel scaling efficiencies from hardware profiles.

The cases are the ones ``shared/REFERENCE.md`` lists: Horovod (Sergeev & Del
Balso 2018: Inception V3 and ResNet-101 90 %, VGG-16 68 % on 512 Pascal GPUs
over 25 Gb/s RoCE), Goyal et al. 2017 (ResNet-50, about 90 % from 8 to 256
P100s, 32 images per GPU) and IBM PowerAI DDL (Cho et al. 2017: ResNet-50,
95 % on 256 P100s). Every prediction is weak scaling with the per-GPU batch of
the publication, ring allreduce of fp32 gradients, and the profile's figures
as they are (specifications, never fitted to these numbers). Each case is
predicted twice: no overlap of communication with compute (an upper bound on
the step time, so a lower bound on efficiency) and full overlap (Horovod,
Goyal et al. and DDL all overlap the allreduce with back-propagation; a lower
bound on the step time).

    .venv/bin/python scripts/bench_published.py --out docs/published

Writes ``published.json``, ``published.md`` (the table) and ``published.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

CASES = [
    {
        "source": "Horovod (Sergeev & Del Balso 2018)",
        "setup": "512 Pascal GPUs, 25 Gb/s RoCE; 64 images/GPU",
        "model": "inception_v3",
        "hw": "p100-pcie-roce25",
        "batch_per_worker": 64,
        "base": 1,
        "workers": 512,
        "published": 0.90,
    },
    {
        "source": "Horovod (Sergeev & Del Balso 2018)",
        "setup": "512 Pascal GPUs, 25 Gb/s RoCE; 64 images/GPU",
        "model": "resnet101",
        "hw": "p100-pcie-roce25",
        "batch_per_worker": 64,
        "base": 1,
        "workers": 512,
        "published": 0.90,
    },
    {
        "source": "Horovod (Sergeev & Del Balso 2018)",
        "setup": "512 Pascal GPUs, 25 Gb/s RoCE; 64 images/GPU",
        "model": "vgg16",
        "hw": "p100-pcie-roce25",
        "batch_per_worker": 64,
        "base": 1,
        "workers": 512,
        "published": 0.68,
    },
    {
        "source": "Goyal et al. 2017 (arXiv 1706.02677)",
        "setup": "8 to 256 P100 (Big Basin, 8 per server, 50 Gb Ethernet); 32 images/GPU",
        "model": "resnet50",
        "hw": "p100-nvlink-50gbe",
        "batch_per_worker": 32,
        "base": 8,
        "workers": 256,
        "published": 0.90,
    },
    {
        "source": "IBM PowerAI DDL (Cho et al. 2017, arXiv 1708.02188)",
        "setup": "256 P100 (64 servers), InfiniBand (EDR profile); 32 images/GPU",
        "model": "resnet50",
        "hw": "p100-nvlink-ib-edr",
        "batch_per_worker": 32,
        "base": 1,
        "workers": 256,
        "published": 0.95,
    },
]


def predict_case(case: dict, overlap: float) -> dict:
    from refdl.perf import PredictOptions
    from refdl.perf.prediction import predict_steps
    from refdl.strategies import traits_of

    workers = sorted({case["base"], *[2**k for k in range(0, 10)], case["workers"]})
    workers = [w for w in workers if case["base"] <= w <= case["workers"]]
    rows = predict_steps(
        case["hw"],
        "data",
        traits_of("data"),
        case["model"],
        case["batch_per_worker"],
        workers,
        scaling="weak",
        opts=PredictOptions(overlap=overlap, optimizer_words=1),
    )
    base = rows[0]
    curve = [
        {
            "workers": r["workers"],
            "efficiency": (r["throughput"] / base["throughput"]) / (r["workers"] / base["workers"]),
            "step_time_s": r["step_time_s"],
            "compute_s": r["compute_s"],
            "comm_s": r["comm_s"],
        }
        for r in rows
    ]
    return {"overlap": overlap, "curve": curve, "efficiency": curve[-1]["efficiency"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/published")
    ap.add_argument("--replot", action="store_true",
                    help="redraw published.png from --out's JSON (no runs)")  # fmt: skip
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        plot(json.loads((out / "published.json").read_text()), out / "published.png")
        return 0
    results = []
    for case in CASES:
        print(f"{case['source']}: {case['model']} on {case['hw']} ...", file=sys.stderr)
        none, full = predict_case(case, 0.0), predict_case(case, 1.0)
        lo, hi = none["efficiency"], full["efficiency"]
        results.append(
            {
                **case,
                "predicted_no_overlap": lo,
                "predicted_full_overlap": hi,
                "published_in_band": lo - 1e-9 <= case["published"] <= hi + 1e-9,
                "curves": {"no_overlap": none["curve"], "full_overlap": full["curve"]},
            }
        )
    (out / "published.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "| publication | setup | model | profile | P (from) | published | predicted, no overlap "
        "| predicted, full overlap | compute / comm per step at P |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        last = r["curves"]["no_overlap"][-1]
        lines.append(
            f"| {r['source']} | {r['setup']} | {r['model']} | {r['hw']} | {r['workers']} "
            f"({r['base']}) | {r['published']:.0%} | {r['predicted_no_overlap']:.0%} | "
            f"{r['predicted_full_overlap']:.0%} | {last['compute_s'] * 1e3:.0f} ms / "
            f"{last['comm_s'] * 1e3:.0f} ms |"
        )
    (out / "published.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "published.png")
    print("\n".join(lines))
    return 0


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{r['model']}\n{textwrap.fill(r['source'].split(' (')[0], 16)}" for r in results]
    xs = range(len(results))
    lo = [r["predicted_no_overlap"] for r in results]
    hi = [r["predicted_full_overlap"] for r in results]
    a.bar(
        xs,
        [h - lo_ for h, lo_ in zip(hi, lo, strict=True)],
        bottom=lo,
        width=0.5,
        color="tab:blue",
        alpha=0.35,
        label="predicted (no overlap .. full overlap)",
    )
    a.scatter(xs, [r["published"] for r in results], color="tab:red", zorder=3, label="published")
    a.set_xticks(list(xs), labels, fontsize=9)
    a.set_ylim(0, 1.05)
    a.set_ylabel("scaling efficiency at the published P")
    a.legend(fontsize=9, loc="lower left")
    a.set_title("Published efficiency inside refdl's band? (band: comm not hidden .. fully\n"
                "hidden behind compute; profiles as specified, nothing fitted to these runs)",
                fontsize=10)  # fmt: skip
    for r in results:
        c = r["curves"]["no_overlap"]
        b.semilogx(
            [p["workers"] for p in c],
            [p["efficiency"] for p in c],
            "o-",
            ms=3,
            label=f"{r['model']} ({r['hw']})",
        )
    b.set_xlabel("GPUs")
    b.set_ylabel("predicted efficiency, no overlap")
    b.set_ylim(0, 1.05)
    b.legend(fontsize=8, loc="lower left")
    b.set_title("Predicted efficiency as the GPUs grow (no overlap); each curve starts\n"
                "at its source's base (Goyal et al.: 8 GPUs, one server)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
