"""Benchmark metrics under Deep500's names (Ben-Nun et al., IPDPS 2019), from a run's files.

A refdl run writes ``summary.json`` and ``metrics.jsonl``; ``from_run`` turns them
into the metrics a recipe can hold thresholds on. ``WallclockTime`` is the whole
run (set-up, compilation and evaluation included, as Deep500's timer around a
training session); ``SamplesPerSecond`` is the global batch over the median step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from refdl.core.compare import deep500_errors, norm_difference

__all__ = ["METRICS", "deep500_errors", "from_run", "norm_difference", "read_run", "speedup"]

# name -> (what it is, unit); the keys recipes use in [acceptable]
METRICS: dict[str, tuple[str, str]] = {
    "WallclockTime": ("wall-clock time of the whole run", "s"),
    "TrainingAccuracy": ("accuracy on the first 2048 training examples at the end", "fraction"),
    "TestAccuracy": ("accuracy on the test set at the end", "fraction"),
    "TestLoss": ("loss on the test set at the end", ""),
    "FinalTrainLoss": ("mean training loss of the last 10 steps", ""),
    "TimeToAccuracy": ("elapsed time when test accuracy first reached the target", "s"),
    "CommunicationVolume": ("bytes sent per step x steps (the strategy's count)", "bytes"),
    "BubbleFraction": ("measured pipeline bubble fraction", "fraction"),
    "PeakMemory": ("peak resident memory of the process", "bytes"),
    "SamplesPerSecond": ("global batch / median step time", "samples/s"),
    "StepTime": ("median step time", "s"),
    "Speedup": ("throughput_n / throughput_1 (Jäger et al.)", "x"),
    "ScalingEfficiency": ("speedup / n", "fraction"),
}


def speedup(throughputs: dict[int, float]) -> dict[int, dict[str, float]]:
    """``Speedup`` = throughput_n / throughput_1 and ``ScalingEfficiency`` = that / n,
    as Jäger et al. define them, for each worker count n (needs n = 1)."""
    if 1 not in throughputs:
        raise ValueError("speedup needs the throughput on 1 worker")
    base = throughputs[1]
    return {
        n: {"Speedup": t / base, "ScalingEfficiency": t / base / n}
        for n, t in sorted(throughputs.items())
    }


def time_to_accuracy(rows: list[dict[str, Any]], target: float) -> float | None:
    """Elapsed seconds at the first logged evaluation with test accuracy >= ``target``."""
    for row in rows:
        acc = row.get("test_accuracy")
        if acc is not None and acc >= target and "elapsed_s" in row:
            return float(row["elapsed_s"])
    return None


def read_run(out: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``summary.json`` and the rows of ``metrics.jsonl`` of a run directory."""
    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return summary, rows


def from_run(
    summary: dict[str, Any], rows: list[dict[str, Any]], target_accuracy: float | None = None
) -> dict[str, float | None]:
    """The Deep500-named metrics of one run (``None`` where the run has no such figure)."""
    comm = summary.get("comm_bytes_per_step")
    return {
        "WallclockTime": summary.get("wall_time_s"),
        "TrainingAccuracy": summary.get("train_accuracy"),
        "TestAccuracy": summary.get("test_accuracy"),
        "TestLoss": summary.get("test_loss"),
        "FinalTrainLoss": summary.get("final_train_loss"),
        "TimeToAccuracy": (
            time_to_accuracy(rows, target_accuracy) if target_accuracy is not None else None
        ),
        "CommunicationVolume": float(comm) * summary["steps"] if comm is not None else None,
        "BubbleFraction": summary.get("bubble_fraction_measured"),
        "PeakMemory": summary.get("peak_memory_bytes"),
        "SamplesPerSecond": summary.get("samples_per_second"),
        "StepTime": summary.get("step_time_median_s"),
    }
