"""The one training loop every strategy runs under: ``fit(spec)``.

``fit`` builds the run (``refdl.run.build``), restores a checkpoint when asked,
and walks the trajectory (``refdl.run.trajectory``). It owns what is common to
all strategies: progress, evaluation, ``metrics.jsonl`` and TensorBoard events,
``summary.json`` (``refdl.run.report``), checkpoints (``refdl.run.checkpoint``),
``--resume``, NaN/Inf detection and clean interruption.

The host waits for the devices only where it must: at the steps it logs,
evaluates or checkpoints (and the first, which includes compilation). There it
reads the losses of every step since the last such step, checks them, and
takes the window's wall time per step as the step time.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from refdl.config.spec import RunSpec
from refdl.core import precision
from refdl.core.moe import moe_stats
from refdl.core.state import TrainState, to_host
from refdl.data.order import epoch_of
from refdl.errors import DivergedError, Interrupted, UsageError, WriteError
from refdl.parallel import processes
from refdl.progress import Progress
from refdl.run import checkpoint
from refdl.run.build import Run, build
from refdl.run.folder import RunFolder
from refdl.run.report import Writer, eval_program, evaluate, summary, write_json
from refdl.run.trajectory import trajectory


class _Compiles:
    """XLA's backend compilations in this process, counted (``summary.json``'s
    ``compilations``: a growing batch compiles once per size, not per step)."""

    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = _Compiles()


def default_out_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _progress(total: int, initial: int, enabled: bool) -> Progress | None:
    """A bar on a terminal, plain lines every 10 s in a log (``--no-progress``: none)."""
    return Progress(total, "refdl.train", initial) if enabled else None


def fit(spec: RunSpec, out: str | Path | None = None) -> dict[str, Any]:
    """Train as ``spec`` says; returns the summary (also written to ``out/summary.json``).

    Raises ``UsageError`` for bad input (before any file is written; the run folder
    is made only then), ``DivergedError`` when the loss turns NaN/Inf (the last good
    checkpoint stays as it was), ``WriteError`` when a file cannot be written, and
    ``Interrupted`` on SIGINT or SIGTERM (after checkpointing the last completed step
    when a step had completed). The whole run happens in its precision's scope
    (``refdl.core.precision``: JAX's 64-bit mode on for fp64, off otherwise).
    """
    with precision.scope(spec.precision):
        return _fit(spec, out)


def _fit(spec: RunSpec, out: str | Path | None) -> dict[str, Any]:
    t_start = time.perf_counter()
    stopper = processes.STOPPER
    installed_here = not stopper.installed
    stopper.install()
    stopper.requested, stopper.signum = False, 0
    try:
        run = build(spec)
        spec, strategy = run.spec, run.strategy
        peers = processes.watch_peers(run.hosts, spec.timeout)  # a lost rank ends every rank
        try:
            out = Path(out or spec.out or default_out_dir())
            primary = processes.launched_rank() == 0
            state, start = _initial_state(run)
            if not strategy.drives_loop:  # a parameter-server worker or secondary server
                _serve(strategy, state, start, spec.timeout)
                return {}
            stopper.armed = True  # from here a signal stops the loop after a step, cleanly
            folder = _open_folder(out, spec, primary)
            stopper.run_dir = str(out.absolute())
            try:
                return _Loop(run, out, primary, state, start, t_start, peers).train()
            finally:
                folder.close()
        finally:
            if peers is not None:
                peers.close()
    finally:
        stopper.run_dir = None
        if installed_here:  # a library call: hand the signals back (a CLI keeps them armed)
            stopper.armed = False
            stopper.uninstall()


def _serve(strategy: Any, state: Any, start: int, timeout: float) -> None:
    """A rank that does not drive the loop: its part until the job ends."""
    watchdog = processes.Watchdog(timeout) if processes.under_mpi() else None
    processes.STOPPER.armed = True  # a signal lets rank 0 checkpoint; mpirun ends this rank
    try:
        strategy.serve(state, start, watchdog)
        strategy.finish()
    finally:
        if watchdog is not None:
            watchdog.close()


def _open_folder(out: Path, spec: RunSpec, primary: bool) -> RunFolder:
    """Rank 0 opens (checks, locks, clears) the run folder; every rank learns whether it
    could, so a refused folder ends every rank with the same line."""
    resumed = Path(spec.resume).resolve() if spec.resume else None
    here = resumed is not None and (out.resolve() == resumed or out.resolve() in resumed.parents)
    folder = RunFolder(out, resume=here, overwrite=spec.overwrite)
    problem = None
    if primary:
        try:
            folder.open()
        except UsageError as e:
            problem = str(e)
    problem = processes.broadcast(problem)
    if problem:
        raise UsageError(problem)
    return folder


def _initial_state(run: Run) -> tuple[TrainState, int]:
    """The state to start from: the newest intact checkpoint ``--resume`` names (of this
    very configuration), or a fresh one."""
    spec, strategy = run.spec, run.strategy
    if not spec.resume:
        return strategy.init_state(spec.seed), 0
    # of this configuration only; with --reshard, the checkpoint its settings named. Each
    # array is read straight into this run's shardings (only the shards a process holds).
    target = checkpoint.abstract(strategy.checkpoint_target(spec.seed))
    try:
        choice = checkpoint.resolve(spec.resume, None if spec.reshard else spec.to_dict(),
                                    like=target)  # fmt: skip
    except UsageError as e:
        if not spec.reshard or "does not match this run's model" not in str(e):
            raise
        raise UsageError(  # e.g. a compressed run's error feedback, which no layout takes
            f"--reshard: {spec.resume} holds a state that {spec.strategy} does not (state "
            "beyond the parameters and optimizer, or another model); it cannot be resharded"
        ) from e
    view = checkpoint.restore(choice, target)
    step = checkpoint.step_of(view)
    if step > spec.steps:
        raise UsageError(
            f"--resume checkpoint is at step {step}, past --steps {spec.steps}; raise --steps"
        )
    if step == spec.steps and _completed(choice.path.parent.parent / "summary.json"):
        raise UsageError(  # it would run nothing, and rewrite the summary without figures
            f"--resume {spec.resume}: the run completed its {step} steps; raise --steps to "
            "continue it"
        )
    if processes.launched_rank() == 0:  # after the checks: bad input stays one line
        print(f"refdl: {choice.report()}", file=sys.stderr, flush=True)
    return strategy.from_checkpoint(view), step


def _completed(summary: Path) -> bool:
    """Whether a run folder's ``summary.json`` says it completed (unreadable: no)."""
    try:
        return json.loads(summary.read_text()).get("status") == "completed"
    except (OSError, ValueError, AttributeError):
        return False


class _Loop:
    """One run of the loop: the trajectory, and what is logged, evaluated and saved."""

    def __init__(self, run, out, primary, state, start, t_start, peers=None) -> None:
        self.run, self.spec, self.strategy = run, run.spec, run.strategy
        self.peers = peers  # the heartbeats (liveness.Monitor) under mpirun
        if peers is not None and primary:
            peers.on_lost = self._lost
        self.out, self.primary, self.state, self.start = out, primary, state, start
        self.stop, self.t_start = processes.STOPPER, t_start
        self.watchdog = processes.Watchdog(run.spec.timeout) if processes.under_mpi() else None
        self.history: dict[str, Any] = {"loss": [], "step_time_s": []}
        self.pending: list[tuple[int, dict[str, Any]]] = []  # steps whose loss is unread
        self.last_eval: dict[str, float] = {}
        self.eval_fn = eval_program(run)
        self.ckpt_dir = out / "checkpoints"
        self.saved = []
        self.saver: checkpoint.Saver | None = None

    def _sync_at(self, done: int) -> bool:
        s = self.spec
        return (
            done == self.start + 1
            or done == s.steps
            or self.stop.poll()
            or any(every and done % every == 0
                   for every in (s.log_every, s.eval_every, s.checkpoint_every))
        )  # fmt: skip

    def train(self) -> dict[str, Any]:
        spec = self.spec
        status, reason, whole = "completed", None, True
        self.stop.armed = True
        try:
            self.writer = Writer(self.out, self.primary, self.start if spec.resume else None)
            self.writer.json("config.json", {**spec.to_dict(), "out": str(self.out)})
            self.bar = _progress(spec.steps, self.start, spec.progress and self.primary)
            compiled = COMPILES.count
            for step in trajectory(self.run, self.state, self.start, spec.steps, self._sync_at):
                self.state = step.state
                if step.run is not None and step.run is not self.run:  # a growing batch
                    self.run, self.strategy = step.run, step.run.strategy
                    self.history.setdefault("batch_sizes", []).append(step.run.spec.batch_size)
                self.history["compilations"] = COMPILES.count - compiled
                self._record(step)
                stop = self.stop.poll()
                if self.strategy.lockstep:  # every rank in the loop stops at the same step
                    stop = processes.agree(stop)
                if stop:
                    status = "interrupted"
                    reason = f"{_signal_name(self.stop.signum)} after step {step.done}"
                    break
            self._save_checkpoint()
            self._wait_for_saves()
        except DivergedError as e:
            status, reason = "diverged", str(e)
            raise
        except Interrupted as e:  # a second signal: the state may be mid-step
            status, reason, whole = "interrupted", f"{_signal_name(e.signum)} mid-step", False
            raise Interrupted(e.signum, self.checkpoint_written) from None
        except OSError as e:
            status, reason, whole = "failed", _write_failure(e, self.ckpt_dir), False
            raise WriteError(reason) from None
        except BaseException as e:
            if self.peers is not None:  # a collective failing because a rank was lost?
                self.peers.settle()  # then the heartbeats end this rank with that line
            status, reason, whole = "failed", f"{type(e).__name__}: {e}", False
            raise
        finally:
            if self.saver is not None and status != "completed":  # commit what was started
                with contextlib.suppress(Exception):
                    self._wait_for_saves()
            if self.watchdog is not None:
                self.watchdog.close()
            if getattr(self, "bar", None) is not None:
                self.bar.close()
            closing = None
            if hasattr(self, "writer"):
                try:
                    self.writer.close()
                except OSError as e:  # the files' last bytes: a failure only if none before
                    if status == "completed":  # (the state is whole: every rank goes on)
                        status, reason = "failed", _write_failure(e, self.ckpt_dir)
                        closing = WriteError(reason)
            result = self._finish(status, reason, whole)
            self.strategy.finish()
            if self.strategy.lockstep and whole:
                processes.barrier()  # no rank exits while rank 0 still writes
        if closing is not None:
            raise closing
        if status == "interrupted":
            raise Interrupted(self.stop.signum, self.checkpoint_written)
        return result

    # -- each step ---------------------------------------------------------------------------

    def _record(self, step) -> None:
        for key, value in step.metrics.items():
            if key == "loss" or isinstance(value, jax.Array):
                continue  # device values are read at synchronised steps
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.history.setdefault(key, []).append(value)
            else:
                self.history[key] = value  # a list or table: only the last is kept
        self.pending.append((step.done, step.metrics))
        if self.bar is not None:
            self.bar.update(1)
        if self.peers is not None:
            self.peers.step = step.done
        if step.seconds is None:
            return
        self._read_pending()
        if self.watchdog is not None:
            self.watchdog.beat()
        if step.done == self.start + 1:
            self.history["first_step_time_s"] = step.seconds
            self.history["first_step_at_unix"] = time.time()  # an elastic restart's cost
        else:
            self.history["step_time_s"].append(step.seconds)
        s, done = self.spec, step.done
        if self.bar is not None:
            sps = f"{self.run.spec.batch_size / step.seconds:.0f}"
            # the last batch's loss, named so (the logged lines show a mean of several)
            self.bar.set_postfix(batch_loss=f"{self.history['loss'][-1]:.4f}", sps=sps,
                                 refresh=False)  # fmt: skip
        evaluated = s.eval_every and (done % s.eval_every == 0 or done == s.steps)
        if evaluated:
            host = self.strategy.gather_state(self.state)  # collective across ranks
            if self.primary:
                self.last_eval = evaluate(self.run, self.strategy.eval_state(host), self.eval_fn)
        if evaluated or (s.log_every and done % s.log_every == 0) or done == s.steps:
            self._log(step, evaluated)
        if s.checkpoint_every and done % s.checkpoint_every == 0:
            self._save_checkpoint()

    def _read_pending(self) -> None:
        """Read the losses of every step since the last read; stop at a NaN/Inf one."""
        if not self.pending:
            return
        values = to_host([m["loss"] for _, m in self.pending])  # all ranks together
        for (done, _), v in zip(self.pending, values, strict=True):
            loss = float(np.mean(v))
            if not math.isfinite(loss):
                last = checkpoint.all_checkpoints(self.ckpt_dir)
                where = f"; the last good checkpoint is {last[-1]}" if last else ""
                raise DivergedError(
                    f"loss is {loss} at step {done}: training diverged "
                    f"(lower --lr or change the optimizer){where}"
                )
            self.history["loss"].append(loss)
        self.last_metrics = self.pending[-1][1]
        self.pending = []

    def _log(self, step, evaluated: bool) -> None:
        s, done = self.spec, step.done
        extra = {k: v for k, v in self.last_metrics.items() if k != "loss"}
        logged_only = self.strategy.extra_metrics(self.state)
        logged_only.update(moe_stats(self.state, to_host))
        extra.update(logged_only)
        window = self.history["loss"][-(s.log_every or 1) :]
        row = {
            "step": done,
            "loss": self.history["loss"][-1],
            "loss_avg": float(np.mean(window)),
            "lr": self.run.lr(done - 1),
            "epoch": self._epoch(done - 1),
            "step_time_s": step.seconds,
            "samples_per_second": self.run.spec.batch_size / step.seconds,
            "elapsed_s": time.perf_counter() - self.t_start,
        }
        for key, value in extra.items():
            if isinstance(value, jax.Array) or np.isscalar(value):
                row[key] = float(np.mean(to_host(value)))
                if isinstance(value, jax.Array) or key in logged_only:  # not yet in history
                    self.history.setdefault(key, []).append(row[key])
        if evaluated:
            row.update(self.last_eval)
        self.writer.metric(row)
        if self.bar is not None and evaluated and "test_accuracy" in self.last_eval:
            self.bar.write(
                f"step {done}: loss {row['loss_avg']:.4f}, "
                f"test accuracy {self.last_eval['test_accuracy']:.4f}",
                file=sys.stderr,
            )

    def _epoch(self, step: int) -> int:
        """The epoch in which ``step``'s global batch starts (a growing batch's too)."""
        s, n = self.spec, self.run.dataset.info.train_size
        if s.batch_schedule is None:
            return epoch_of(step, s.batch_size, n)
        return s.batch_schedule.start_at(step) // n

    # -- checkpoints and the summary --------------------------------------------------------

    checkpoint_written: Path | None = None
    saved: list[tuple[Path, float]]  # (checkpoint, when) this run saved, for ``_lost``

    def _save_checkpoint(self) -> None:
        """Start saving the state (``refdl.run.checkpoint``): under ``jax.distributed`` every
        process writes its own shards; otherwise rank 0 writes the gathered state."""
        self._read_pending()  # never save a state whose losses were not checked
        view = self.strategy.checkpoint_view(self.state)  # collective across ranks
        if not (self.primary or jax.process_count() > 1):
            return
        if self.saver is None:
            self.saver = checkpoint.Saver(self.ckpt_dir, keep=self.spec.keep_checkpoints)
        path = self.saver.save(view, {"spec": self.spec.to_dict()})
        if self.primary:
            self.checkpoint_written = path
            self.saved.append((path, time.monotonic()))

    def _wait_for_saves(self) -> None:
        """Let the saves in flight commit (their errors raised) and release orbax's threads."""
        if self.saver is not None:
            saver, self.saver = self.saver, None
            saver.close()

    def _lost(self, line: str, since: float) -> str:
        """A rank was lost (called from ``liveness`` on rank 0, the main thread waiting in
        a collective): the failure is written to ``summary.json`` and the line every rank
        prints is returned with the last good checkpoint. Where every step needs every
        rank (``lockstep``), a saved step was completed by all, the lost one included;
        elsewhere (a parameter server goes on with the workers it hears from) the
        checkpoints saved after the lost rank was last heard from are set aside as
        ``untrusted_step_N``, which ``--resume`` never takes."""
        for path, saved in self.saved:
            if not self.strategy.lockstep and saved > since and path.is_dir():
                with contextlib.suppress(OSError):
                    path.rename(path.with_name(f"untrusted_{path.name}"))
        last = _last_checkpoint(self.ckpt_dir)
        line += f"; the last good checkpoint is {last}" if last else "; no checkpoint was written"
        if hasattr(self, "writer"):
            record = {"status": "failed", "reason": line, "run_dir": str(self.out),
                      "last_step_done": self.peers.step if self.peers is not None else None,
                      "lost_at_unix": time.time(),
                      "first_step_at_unix": self.history.get("first_step_at_unix")}  # fmt: skip
            self.writer.json("summary.json", {**record, "last_checkpoint": last})
        return line

    def _finish(self, status: str, reason: str | None, whole: bool) -> dict[str, Any]:
        """Write ``summary.json``: evaluated and complete when the state is whole, else only
        the status and its reason. A write that fails here is reported, not raised (the
        run's own error, if any, is the one to see)."""
        try:
            return self._summary(status, reason, whole)
        except OSError as e:
            if status == "completed":
                raise WriteError(_write_failure(e, self.ckpt_dir)) from None
            return {}

    def _summary(self, status: str, reason: str | None, whole: bool) -> dict[str, Any]:
        if not whole:
            result = {"status": status, "reason": reason, "run_dir": str(self.out),
                      "last_checkpoint": _last_checkpoint(self.ckpt_dir)}  # fmt: skip
            if self.primary and hasattr(self, "writer"):
                self.writer.json("summary.json", result)
            return result
        host = self.strategy.gather_state(self.state)  # collective across ranks
        if not self.primary:
            return {}
        host = self.strategy.eval_state(host)
        if status != "diverged" and (not self.last_eval or status != "completed"):
            self.last_eval = evaluate(self.run, host, self.eval_fn)
        result = summary(self.run, host, self.history, self.last_eval, self.t_start, status,
                         self.start)  # fmt: skip
        if reason:
            result["reason"] = reason
        result["run_dir"] = str(self.out)
        result["first_step_at_unix"] = self.history.get("first_step_at_unix")
        timeline = self.history.get("timeline")
        if timeline:
            write_json(self.out / "timeline.json", {"stages": result.get("stages"),
                                                    "timeline": timeline})  # fmt: skip
        self.writer.json("summary.json", result)
        return result


def _signal_name(signum: int) -> str:
    return signal.Signals(signum).name if signum else "a signal"


def _last_checkpoint(ckpt_dir: Path) -> str | None:
    found = checkpoint.all_checkpoints(ckpt_dir)
    return str(found[-1]) if found else None


def _write_failure(e: OSError, ckpt_dir: Path) -> str:
    """One line for a failed write: what could not be written, why, and the last good
    checkpoint."""
    last = _last_checkpoint(ckpt_dir)
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
    return f"cannot write {e.filename or 'a run file'} ({e.strerror or e}); {where}"
