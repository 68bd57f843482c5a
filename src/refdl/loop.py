"""The one training loop every strategy runs under.

``fit(spec)`` builds the data set, the model, the task and the strategy from a
validated ``RunSpec``, then for each step asks the data order for the global
batch and the strategy for one step. It owns what is common to all strategies:
progress, evaluation, ``metrics.jsonl``, ``summary.json``, checkpoints,
``--resume``, NaN/Inf detection and clean interruption.

Files in the run folder (written by the primary process only):

- ``config.json``: the RunSpec as run;
- ``metrics.jsonl``: one JSON object per logged step (``step``, ``loss``,
  ``loss_avg``, ``lr``, ``epoch``, ``step_time_s``, ``samples_per_second``,
  and ``test_*`` at evaluation steps);
- ``summary.json``: the run's result (keys in ``SUMMARY_KEYS``; they only grow);
- ``checkpoints/step_N``: see ``refdl.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from refdl import checkpoint
from refdl.core.state import TrainState, to_host
from refdl.core.task import Task
from refdl.data import Dataset, load_dataset
from refdl.data.order import epoch_of, global_batch_indices
from refdl.errors import DivergedError, UsageError
from refdl.models import MODELS
from refdl.spec import TRAJECTORY_KEYS, RunSpec
from refdl.strategies import STRATEGIES, Strategy

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


@dataclasses.dataclass
class Run:
    """Everything built from a spec: data set, task (model, loss, optimizer), strategy."""

    spec: RunSpec
    dataset: Dataset
    task: Task
    strategy: Strategy
    schedule: Any


def build(spec: RunSpec) -> Run:
    """Build the pieces of a run; raises UsageError for anything that does not fit."""
    spec = spec.with_model_defaults().validate()
    _join_ranks(spec)
    dataset = load_dataset(spec.dataset, spec.data_dir, dict(spec.data_opts))
    info = dataset.info
    if spec.batch_size > info.train_size:
        raise UsageError(
            f"--batch-size {spec.batch_size} is larger than the {info.train_size} training "
            f"examples of {info.name!r}; use a smaller batch"
        )
    model = MODELS.get(spec.model).make(info, dict(spec.model_opts))
    optimizer, schedule = spec.make_optimizer()
    sample = dataset.train_batch(np.arange(1))["x"]
    axes = model.logical_axes(jnp.asarray(sample))
    task = Task(model, spec.loss, optimizer, sample, axes)
    available = jax.devices()
    from refdl import dist

    if dist.under_mpi() and STRATEGIES.get(spec.strategy).multiprocess == "mpi":
        available = jax.local_devices()[:1]  # one runtime per rank; ranks are the workers
    elif len(available) < spec.devices:
        raise UsageError(
            f"--devices {spec.devices} asked for more devices than JAX sees ({len(available)}); "
            "on a CPU host python -m refdl.train simulates them, in a library set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={spec.devices} before importing jax"
        )
    strategy = STRATEGIES.get(spec.strategy)(task, spec, available[: spec.devices])
    run = Run(spec, dataset, task, strategy, schedule)
    strategy.batch_of = lambda step: global_batch(run, step)
    return run


def _join_ranks(spec: RunSpec) -> None:
    """Under mpirun: check the strategy runs across ranks, and join them if it is SPMD."""
    from refdl import dist

    if not dist.under_mpi():
        return
    mode = STRATEGIES.get(spec.strategy).multiprocess
    if mode is None:
        raise UsageError(
            f"--strategy {spec.strategy} runs in one process; launch it without mpirun, or use "
            "data, model, hybrid, ps or decentralized across ranks"
        )
    if spec.simulate:
        raise UsageError("--simulate runs every worker in one process; launch it without mpirun")
    size = dist.launched_size()
    if spec.devices not in (1, size):
        raise UsageError(
            f"under mpirun --devices is the number of ranks ({size}), not {spec.devices}; "
            "drop --devices"
        )
    if mode == "spmd":
        dist.init_spmd(spec.timeout)


def global_batch(run: Run, step: int) -> dict[str, np.ndarray]:
    """The global batch of ``step`` in the shared deterministic order."""
    idx = global_batch_indices(
        run.spec.seed, step, run.spec.batch_size, run.dataset.info.train_size
    )
    return run.dataset.train_batch(idx)


def evaluate(run: Run, host_state: TrainState, eval_fn=None) -> dict[str, float]:
    """Test loss and accuracy (and perplexity for token data) with the full parameters."""
    eval_fn = eval_fn or jax.jit(run.task.eval_sums)
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


def peak_memory() -> tuple[int | None, str]:
    """Peak memory in bytes and where it came from (device allocator, else host RSS)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # some backends do not implement memory_stats
        stats = {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "host_max_rss"


def default_out_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class _Writer:
    """Appends to metrics.jsonl and writes JSON files; does nothing off the primary process."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None) -> None:
        self.out, self.enabled = out, enabled
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out / "metrics.jsonl"
        if resume_step is not None and self.metrics_path.exists():
            # Drop rows past the checkpoint we resume from: they will be recomputed.
            rows = [ln for ln in self.metrics_path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in rows if json.loads(ln).get("step", 0) <= resume_step]
            self.metrics_path.write_text("".join(ln + "\n" for ln in kept))
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        self._f = open(self.metrics_path, "a")  # noqa: SIM115  (closed in close())

    def metric(self, row: dict[str, Any]) -> None:
        if self.enabled:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()

    def json(self, name: str, obj: dict[str, Any]) -> None:
        if self.enabled:
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(json.dumps(_finite(obj), indent=2) + "\n")
            os.replace(tmp, self.out / name)

    def close(self) -> None:
        if self.enabled:
            self._f.close()


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="step",
        dynamic_ncols=True,
        mininterval=0.5,
        file=sys.stderr,
        disable=None,
    )


def fit(spec: RunSpec, out: str | Path | None = None) -> dict[str, Any]:
    """Train as ``spec`` says; returns the summary (also written to ``out/summary.json``).

    Raises ``UsageError`` for bad input, ``DivergedError`` when the loss turns
    NaN/Inf (the last good checkpoint stays as it was), and re-raises
    ``KeyboardInterrupt`` after checkpointing the last completed step.
    """
    t_start = time.perf_counter()
    run = build(spec)
    spec, strategy = run.spec, run.strategy
    out = Path(out or spec.out or default_out_dir())
    ckpt_dir = out / "checkpoints"

    resume_step = None
    if spec.resume:
        path = checkpoint.resolve(spec.resume)
        host = checkpoint.restore(path, strategy.host_template(spec.seed))
        resume_step = int(np.asarray(host.step).reshape(-1)[0])
        state = strategy.place_state(host)
    else:
        state = strategy.init_state(spec.seed)
    start = resume_step or 0
    if start > spec.steps:
        raise UsageError(
            f"--resume checkpoint is at step {start}, past --steps {spec.steps}; raise --steps"
        )

    writer = _Writer(out, strategy.primary, resume_step)
    writer.json("config.json", {**spec.to_dict(), "out": str(out)})
    meta = {"spec": spec.to_dict()}
    eval_fn = jax.jit(run.task.eval_sums)
    n_train = run.dataset.info.train_size
    bar = _progress(spec.steps, start, spec.progress and strategy.primary)
    losses: list[float] = []
    times: list[float] = []
    last_eval: dict[str, float] = {}
    status = "completed"
    stop = _GracefulStop()
    from refdl import dist

    watchdog = dist.Watchdog(spec.timeout) if dist.under_mpi() else None
    if not strategy.drives_loop:  # a parameter-server worker or secondary server
        try:
            strategy.serve(state, start, watchdog)
            strategy.finish()
        finally:
            stop.restore()
            if watchdog is not None:
                watchdog.close()
        return {}

    def save_checkpoint(s: TrainState) -> None:
        host = strategy.gather_state(s)
        if strategy.primary:
            checkpoint.save(ckpt_dir, host, meta, keep=spec.keep_checkpoints)

    try:
        for step in range(start, spec.steps):
            batch = global_batch(run, step)
            t0 = time.perf_counter()
            # The old state may be donated to the step: from here the new one is the state.
            state, metrics = strategy.train_step(state, batch)
            loss = float(np.mean(to_host(metrics["loss"])))  # waits; shard losses averaged
            dt = time.perf_counter() - t0
            if watchdog is not None:
                watchdog.beat()
            if not math.isfinite(loss):
                last = checkpoint.all_checkpoints(ckpt_dir)
                where = f"; the last good checkpoint is {last[-1]}" if last else ""
                raise DivergedError(
                    f"loss is {loss} at step {step + 1}: training diverged "
                    f"(lower --lr or change the optimizer){where}"
                )
            losses.append(loss)
            times.append(dt)
            done = step + 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    loss=f"{loss:.4f}", sps=f"{spec.batch_size / dt:.0f}", refresh=False
                )
            evaluated = spec.eval_every and (done % spec.eval_every == 0 or done == spec.steps)
            if evaluated:
                host = strategy.gather_state(state)  # collective across ranks
                if strategy.primary:
                    last_eval = evaluate(run, strategy.eval_state(host), eval_fn)
            if evaluated or (spec.log_every and done % spec.log_every == 0) or done == spec.steps:
                metrics = {**metrics, **strategy.extra_metrics(state)}
                window = losses[-(spec.log_every or 1) :]
                row = {
                    "step": done,
                    "loss": loss,
                    "loss_avg": float(np.mean(window)),
                    "lr": float(run.schedule(step)),
                    "epoch": epoch_of(step, spec.batch_size, n_train),
                    "step_time_s": dt,
                    "samples_per_second": spec.batch_size / dt,
                    "elapsed_s": time.perf_counter() - t_start,
                }
                row.update({k: _jsonable(v) for k, v in metrics.items() if k != "loss"})
                if evaluated:
                    row.update(last_eval)
                writer.metric(row)
                if bar is not None and evaluated and "test_accuracy" in last_eval:
                    bar.write(
                        f"step {done}: loss {row['loss_avg']:.4f}, "
                        f"test accuracy {last_eval['test_accuracy']:.4f}",
                        file=sys.stderr,
                    )
            if spec.checkpoint_every and done % spec.checkpoint_every == 0:
                save_checkpoint(state)
            if stop.requested:  # Ctrl-C: the step just finished is the last one
                status = "interrupted"
                break
        save_checkpoint(state)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now; the state may be mid-step
        status = "aborted"
        raise
    except DivergedError:
        status = "diverged"
        raise
    finally:
        stop.restore()
        if watchdog is not None:
            watchdog.close()
        if bar is not None:
            bar.close()
        if status != "aborted":  # an aborted state may be mid-step: write nothing from it
            summary = _write_summary(
                run,
                strategy,
                state,
                writer,
                out,
                losses,
                times,
                last_eval,
                eval_fn,
                t_start,
                status,
                start,
            )
        writer.close()
        strategy.finish()
    if status == "interrupted":
        raise KeyboardInterrupt
    return summary


def _write_summary(
    run, strategy, state, writer, out, losses, times, last_eval, eval_fn, t_start, status, start
) -> dict[str, Any]:
    """Evaluate if needed, build ``summary.json`` (and the schedule plot), write it."""
    spec = run.spec
    host = strategy.gather_state(state)  # collective across ranks
    if not strategy.primary:
        return {}
    host = strategy.eval_state(host)
    if not last_eval or status != "completed":
        last_eval = evaluate(run, host, eval_fn) if status != "diverged" else last_eval
    summary = _summary(run, host, losses, times, last_eval, t_start, status, start)
    summary["run_dir"] = str(out)
    if spec.plot_schedule and strategy.primary and strategy.timeline():
        from refdl.bench.plots import gantt

        title = f"{spec.schedule}, {summary.get('stages')} stages, {spec.microbatches} mb"
        summary["schedule_plot"] = str(
            gantt(strategy.timeline(), len(strategy.devices), spec.plot_schedule, title)
        )
    writer.json("summary.json", summary)
    return summary


class _GracefulStop:
    """The first Ctrl-C asks the loop to stop after the step in flight (so the state is
    whole: a step's input state may already be donated); a second one stops at once."""

    def __init__(self) -> None:
        self.requested = False
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("refdl: stopping after this step (Ctrl-C again to abort)", file=sys.stderr)

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def _finite(obj: Any) -> Any:
    """Non-finite floats become None, so the JSON stays standard."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _jsonable(v: Any) -> Any:
    a = np.asarray(v)
    return a.item() if a.ndim == 0 else a.tolist()


def _summary(
    run: Run,
    host: TrainState,
    losses: list[float],
    times: list[float],
    last_eval: dict[str, float],
    t_start: float,
    status: str,
    start: int,
) -> dict[str, Any]:
    spec, info = run.spec, run.dataset.info
    median = statistics.median(times[1:] or times) if times else None
    peak, source = peak_memory()
    from refdl.core.layers import param_count

    summary = {
        "strategy": spec.strategy,
        "model": spec.model,
        "dataset": info.name,
        "steps": int(host.step),
        "global_batch": spec.batch_size,
        "devices": len(run.strategy.devices),
        "final_train_loss": float(np.mean(losses[-FINAL_LOSS_WINDOW:])) if losses else None,
        "test_accuracy": last_eval.get("test_accuracy"),
        "test_loss": last_eval.get("test_loss"),
        "train_accuracy": last_eval.get("train_accuracy"),
        "samples_per_second": spec.batch_size / median if median else None,
        "step_time_median_s": median,
        "compile_step_time_s": times[0] if times else None,
        "wall_time_s": time.perf_counter() - t_start,
        "params_l2_norm": params_l2_norm(host.params),
        "param_count": param_count(host.params),
        "peak_memory_bytes": peak,
        "peak_memory_source": source,
        "status": status,
        "resumed_from_step": start if spec.resume else None,
        "optimizer": spec.optimizer,
        "lr": spec.lr,
        "seed": spec.seed,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
    }
    if "test_perplexity" in last_eval:
        summary["test_perplexity"] = last_eval["test_perplexity"]
    summary.update(info.baselines)
    summary.update(run.strategy.summary())
    return summary


def check_resume_compatible(saved: dict[str, Any], explicit: dict[str, Any]) -> None:
    """Refuse explicit flags that would change a resumed run's trajectory."""
    for key in TRAJECTORY_KEYS:
        if key in explicit and key in saved and _norm(explicit[key]) != _norm(saved[key]):
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"{flag} {explicit[key]!r} differs from the checkpoint's {saved[key]!r}; "
                f"drop {flag} to resume the same run (or start a new run without --resume)"
            )


def _norm(v: Any) -> Any:
    return [list(p) for p in v] if isinstance(v, (list, tuple)) else v
