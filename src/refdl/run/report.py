"""What a run reports: evaluation, ``metrics.jsonl``, TensorBoard events, ``summary.json``.

Files in the run folder (written by the primary process only):

- ``config.json``: the RunSpec as run;
- ``metrics.jsonl``: one JSON object per logged step (``step``, ``loss``,
  ``loss_avg``, ``lr``, ``epoch``, ``step_time_s``, ``samples_per_second``,
  ``elapsed_s``, what the strategy measured, and ``test_*`` at evaluations);
- ``events.out.tfevents.*``: the same scalars for TensorBoard (tensorboardX);
- ``summary.json``: the run's result (keys in ``SUMMARY_KEYS``; they only grow).
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from refdl.config.files import MiB, loads_json, read_text
from refdl.config.paths import open_append, write_atomic
from refdl.core.layers import param_count
from refdl.core.moe import moe_stats
from refdl.core.state import TrainState
from refdl.errors import UsageError
from refdl.run.build import Run
from refdl.run.events import EventFile

SUMMARY_KEYS = (
    "strategy",
    "model",
    "dataset",
    "steps",
    "global_batch",
    "devices",
    "final_train_loss",
    "test_accuracy",
    "samples_per_second",
    "step_time_median_s",
    "wall_time_s",
    "params_l2_norm",
    "peak_memory_bytes",
)
TRAIN_EVAL_SIZE = 2048  # training examples evaluated for train_accuracy
FINAL_LOSS_WINDOW = 10  # final_train_loss = mean loss of the last 10 steps
# Scalars of a metrics row that TensorBoard shows, under these tags.
TB_TAGS = {
    "loss": "train/loss",
    "loss_avg": "train/loss_avg",
    "lr": "train/lr",
    "test_loss": "test/loss",
    "test_accuracy": "test/accuracy",
    "test_perplexity": "test/perplexity",
    "train_accuracy": "train/accuracy",
    "step_time_s": "speed/step_time_s",
    "samples_per_second": "speed/samples_per_second",
    "comm_bytes": "comm/bytes_per_step",
    "bubble_fraction_measured": "pipeline/bubble_fraction_measured",
    "consensus_distance": "decentralized/consensus_distance",
    "compression_error": "compress/compression_error",
    "staleness_mean": "ps/staleness_mean",
}


def eval_program(run: Run) -> Any:
    """``Task.eval_sums`` jitted with the task's compiler options (the loop compiles it once)."""
    options = run.task.compiler_options(jax.default_backend())
    return jax.jit(run.task.eval_sums, compiler_options=options)


def evaluate(run: Run, host_state: TrainState, eval_fn: Any = None) -> dict[str, float]:
    """Test loss and accuracy (and perplexity for token data) with the full parameters."""
    eval_fn = eval_fn or eval_program(run)
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    for batch in run.dataset.test_batches():
        sums = eval_fn(host_state.params, host_state.model_state, batch)
        for k in totals:
            totals[k] += float(sums[k])
    loss = totals["loss_sum"] / totals["count"]
    out = {"test_loss": loss, "test_accuracy": totals["correct"] / totals["count"]}
    if run.dataset.info.kind == "tokens":
        out["test_perplexity"] = math.exp(min(loss, 700.0))
    # Deep500's TrainingAccuracy: the same sums over the first (at most TRAIN_EVAL_SIZE)
    # training examples, a fixed subset so successive evaluations are comparable.
    n = min(run.dataset.info.train_size, TRAIN_EVAL_SIZE)
    correct = count = 0.0
    for lo in range(0, n, 512):
        batch = run.dataset.train_batch(np.arange(lo, min(lo + 512, n)))
        sums = eval_fn(host_state.params, host_state.model_state, batch)
        correct, count = correct + float(sums["correct"]), count + float(sums["count"])
    out["train_accuracy"] = correct / count if count else None
    return out


def params_l2_norm(params: Any) -> float:
    """The float64 L2 norm over all parameters (the number strategies are compared by)."""
    return float(
        math.sqrt(
            sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(params))
        )
    )


def first_batch(spec: Any) -> int:
    """The run's global batch at step 0 (a growing batch's first size)."""
    if spec.batch_schedule is None:
        return spec.batch_size
    return spec.batch_schedule.size_at(0)


def ranks_by_host(hosts: list[str]) -> dict[str, list[int]]:
    """Each host's ranks, hosts in the order of their first rank (``hosts`` in the summary)."""
    return {h: [r for r, x in enumerate(hosts) if x == h] for h in dict.fromkeys(hosts)}


def peak_memory() -> tuple[int | None, str]:
    """Peak memory in bytes and where it came from (device allocator, else host RSS)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # some backends do not implement memory_stats
        stats = {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "host_max_rss"


def finite(obj: Any) -> Any:
    """Non-finite floats become None, so the JSON stays standard."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


RESERVED = 4096  # bytes summary.json holds from the start: room for its last word


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` as JSON atomically (a fresh temporary, then a rename). When that
    fails (a full disk) and ``path`` already holds enough bytes - ``summary.json``
    reserves ``RESERVED`` when a run starts - it is overwritten in place, which needs no
    new blocks."""
    text = json.dumps(finite(obj), indent=2) + "\n"
    try:
        write_atomic(path, text)
    except OSError:
        if not _in_place(path, text):
            raise


def _in_place(path: Path, text: str) -> bool:
    """Overwrite a regular file (never a link) no shorter than ``text`` with it."""
    try:
        size = os.lstat(path).st_size
        if len(text.encode()) > size:
            return False
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
            os.ftruncate(fd, len(text.encode()))  # frees blocks, needs none
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def reserve_summary(path: Path) -> None:
    """A placeholder ``summary.json`` of ``RESERVED`` bytes, honest while the run runs
    (``started``), so the run's last word fits even when the disk fills meanwhile."""
    text = json.dumps(
        {
            "status": "started",
            "run_dir": str(path.parent),
            "reason": "the run has not finished (running, or killed)",
        },
        indent=2,
    )
    write_atomic(path, text.ljust(RESERVED - 1) + "\n")  # fmt: skip


METRICS_LIMIT = 1024 * MiB  # a million rows of a long run


def read_metrics(path: Path, up_to: int | None = None) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (up to step ``up_to``); a torn last line (a run
    killed mid-write) is dropped, a malformed earlier one is an error naming the line."""
    rows = []
    text = read_text(path, "run file", limit=METRICS_LIMIT)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        try:
            row = loads_json(line, f"{path} line {i + 1}", ValueError)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no integer step")
        except ValueError:
            if i == len(lines) - 1:
                break  # torn by an interruption: the step will be logged again
            raise UsageError(
                f"{path}: line {i + 1} is not a metrics row; the run folder is damaged"
            ) from None
        if up_to is None or row["step"] <= up_to:
            rows.append(row)
    return rows


class Writer:
    """Appends to ``metrics.jsonl`` and TensorBoard's event file and writes JSON files;
    does nothing off the primary process (rank 0 under mpirun)."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None) -> None:
        self.out, self.enabled = out, enabled
        self._f = self._tb = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        path = out / "metrics.jsonl"
        kept = read_metrics(path, resume_step) if resume_step is not None and path.exists() else []
        # Rows past the checkpoint we resume from are dropped: they will be recomputed.
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._f = open_append(path)
        # TensorBoard hides an earlier file's steps from the purge step on: from the first
        # step this run will write again (the resume step's own points stay).
        self._tb = EventFile(out, purge_step=None if resume_step is None else resume_step + 1)
        reserve_summary(out / "summary.json")

    def metric(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            self._f.write(json.dumps(finite(row)) + "\n")
            self._f.flush()
        except OSError as e:
            e.filename = e.filename or str(self.out / "metrics.jsonl")
            raise
        try:
            for key, tag in TB_TAGS.items():
                value = row.get(key)
                scalar = isinstance(value, int | float) and not isinstance(value, bool)
                if scalar and math.isfinite(value):
                    self._tb.scalar(tag, float(value), row["step"], walltime=time.time())
            self._tb.flush()
        except OSError as e:
            e.filename = e.filename or self._tb.path
            raise

    def json(self, name: str, obj: dict[str, Any]) -> None:
        if self.enabled:
            write_json(self.out / name, obj)

    def close(self) -> None:
        """Close both files (each tried); the first write error is raised after."""
        if not self.enabled:
            return
        failed = None
        for f in (self._f, self._tb):
            try:
                if f is not None:
                    f.close()
            except OSError as e:
                failed = failed or e
        self._f = self._tb = None
        if failed is not None:
            raise failed


def summary(
    run: Run,
    host: TrainState,
    history: dict[str, Any],
    last_eval: dict[str, float],
    t_start: float,
    status: str,
    start: int,
) -> dict[str, Any]:
    """``summary.json``'s contents (``SUMMARY_KEYS`` and more; keys only grow)."""
    spec, info = run.spec, run.dataset.info
    losses, times = history.get("loss", []), history.get("step_time_s", [])
    first = history.get("first_step_time_s")
    median = statistics.median(times) if times else first
    peak, source = peak_memory()
    out = {
        "strategy": spec.strategy,
        "model": spec.model,
        "dataset": info.name,
        "steps": int(np.asarray(host.step).reshape(-1)[0]),
        "global_batch": first_batch(spec),
        "batch_schedule": spec.batch_schedule and str(spec.batch_schedule),  # its text
        "global_batch_last": spec.batch_size,
        "compilations": history.get("compilations"),
        "devices": len(run.strategy.devices),
        "final_train_loss": float(np.mean(losses[-FINAL_LOSS_WINDOW:])) if losses else None,
        "test_accuracy": last_eval.get("test_accuracy"),
        "test_loss": last_eval.get("test_loss"),
        "train_accuracy": last_eval.get("train_accuracy"),
        "samples_per_second": spec.batch_size / median if median else None,
        "step_time_median_s": median,
        "compile_step_time_s": first,
        "wall_time_s": time.perf_counter() - t_start,
        "params_l2_norm": params_l2_norm(host.params),
        "param_count": param_count(host.params),
        "peak_memory_bytes": peak,
        "peak_memory_source": source,
        "peak_memory_bytes_per_device": run.strategy.peak_memory_bytes_per_device(history),
        "remat": spec.remat,
        "precision": spec.precision,
        "status": status,
        "resumed_from_step": start if spec.resume else None,
        "optimizer": spec.optimizer,
        "lr": spec.lr,
        "seed": spec.seed,
        "hosts": ranks_by_host(run.hosts),
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
    }
    routed = moe_stats(host.model_state)
    if routed:  # a mixture-of-experts model: the logged steps' mean, and the last step's
        logged = history.get("tokens_dropped_fraction") or [routed["tokens_dropped_fraction"]]
        out["tokens_dropped_fraction"] = float(np.mean(logged))
        out["tokens_dropped_fraction_last_step"] = routed["tokens_dropped_fraction"]
        out["router_aux_loss"] = routed["router_aux_loss"]
    if "test_perplexity" in last_eval:
        out["test_perplexity"] = last_eval["test_perplexity"]
    out.update(info.baselines)
    out.update(run.strategy.summary(history))
    return out


def record_drawing(
    summary: dict[str, Any], key: str, draw: Callable[[dict], Any], prog: str
) -> bool:
    """A drawing of the run (``--plot-schedule``: the CLI hands ``refdl.plots``' drawing
    in; the run draws nothing itself) made and named under ``key`` in its
    ``summary.json``; False, with one line, when it cannot be written."""
    try:
        drawn = draw(summary)
        if drawn:
            summary[key] = str(drawn)
            write_json(Path(summary["run_dir"]) / "summary.json", summary)
    except OSError as e:
        print(f"{prog}: error: cannot write {e.filename} ({e.strerror or e}); the run's "
              f"results are in {summary['run_dir']}", file=sys.stderr)  # fmt: skip
        return False
    return True
