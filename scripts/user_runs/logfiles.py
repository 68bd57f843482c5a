"""What the two user scripts share: the documented configuration a log declares, and the
log files as users write them (JSON lines; a CSV with a header plus a TOML file of the
configuration). Each script writes its TensorBoard events with its own framework."""

import csv
import json
from pathlib import Path

BATCH, LR, MOMENTUM = 64, 0.05, 0.9
ORDERS = {"shuffle": "reshuffled epochs", "replacement": "random with replacement"}


def declared(framework: str, version: str, model: str, init: str, sampler: str, steps: int,
             seed: int) -> dict:  # fmt: skip
    """The configuration a run's log declares: the documented settings (a buggy run's log
    declares them too: that is what makes the bug a bug)."""
    return {
        "framework": framework, "framework_version": version, "model": model,
        "dataset": "digits", "preprocessing": "pixels / 16", "init": init,
        "data_order": ORDERS[sampler], "optimizer": "momentum", "momentum": MOMENTUM,
        "nesterov": False, "weight_decay": 0.0, "lr": LR, "lr_schedule": "constant",
        "loss": "cross_entropy", "loss_reduction": "mean", "dtype": "float32",
        "batch_size": BATCH, "steps": steps, "hw": "local", "seed": seed,
    }  # fmt: skip


def write(out: Path, name: str, config: dict, rows: list[dict], formats: list[str]) -> None:
    """``NAME.jsonl`` and/or ``NAME.csv`` + ``NAME.toml`` (the TOML also for ``tb``)."""
    if "jsonl" in formats:
        with open(out / f"{name}.jsonl", "w") as f:
            f.write(json.dumps({"config": config}) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if "csv" in formats or "tb" in formats:
        toml = "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else json.dumps(v)}\n"
                       for k, v in config.items())  # fmt: skip
        (out / f"{name}.toml").write_text(toml)
    if "csv" in formats:
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["step", "loss", "samples_per_s", "test_accuracy"])
            w.writeheader()
            w.writerows(rows)
