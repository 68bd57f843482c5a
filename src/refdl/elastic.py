"""``refdl launch --elastic --hosts h1:2,h2:2 train ...``: a run that carries on without a
person when a host is lost.

The run is started across the hosts as ``refdl launch`` would. When it ends because
ranks were lost (``refdl.parallel.liveness``: rank 0 writes ``summary.json`` with the
lost ranks' hosts, the last step done and the last good checkpoint, and every rank
exits 3), the launcher drops the hosts named there (and any host that does not answer
its launch agent within 10 s; when none is named and every host answers, processes died
rather than a host, and the same hosts are used again), and, while at least
``--min-hosts`` remain, starts the run again on them: ``--resume OUT --reshard`` from
the newest intact checkpoint, with one rank per remaining slot. The global batch stays
``--batch-size``: each rank takes a larger share of it (``data``'s batch is global), so
a step's batch - a function of the seed, the step and the global batch only - is the
one the uninterrupted run took, and the run ends where it would have ended. Checkpoints
are asynchronous orbax saves, so ``--elastic`` saves every step unless
``--checkpoint-every`` is given: a loss redoes at most the step whose save had not
committed.

A lost host that comes back is taken in again (unless ``--no-rejoin``): while the run
goes on without it, the launcher asks it through the launch agent every ``REJOIN_EVERY_S``
whether it answers; once it does, the ranks stop after the step in flight (rank 0
checkpoints it, as for a signal) and the run starts again on the larger set, from that
checkpoint, with the same global batch.

Every restart is listed in the final ``summary.json`` (``restarts``): when, which hosts
were lost or came back, the ranks before and after, the step reached and the
checkpoint's, the steps redone, and the seconds from the loss (or the return) to the
first step of the next launch.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from refdl.config.files import load_json
from refdl.errors import UsageError
from refdl.parallel.hosts import Host
from refdl.parallel.liveness import EXIT_LOST
from refdl.parallel.processes import PAUSED, launch

MAX_RESTARTS = 8
PROBE_S = 10.0
REJOIN_EVERY_S = 5.0  # how often a lost host is asked whether it answers again


def _value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _without(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def prepare(args: list[str]) -> tuple[list[str], Path]:
    """The train arguments an elastic run needs: an ``--out`` (one is named when none is
    given, so a restart knows where to resume), and a checkpoint every step unless
    ``--checkpoint-every`` says otherwise; a resume of another run is refused."""
    if _value(args, "--resume") is not None:
        raise UsageError("--elastic starts a run; to continue one, resume it without --elastic")
    out = _value(args, "--out")
    if out is None:
        out = str(Path("runs") / time.strftime("elastic-%Y%m%d-%H%M%S"))
        args = [*args, "--out", out]
    if _value(args, "--checkpoint-every") is None:
        args = [*args, "--checkpoint-every", "1"]
    return args, Path(out)


def _newest(out: Path) -> str | None:
    """The newest checkpoint folder of the run (when rank 0 could not name it)."""
    from refdl.run.checkpoint import all_checkpoints

    found = all_checkpoints(out / "checkpoints")
    return str(found[-1]) if found else None


def _step_of(checkpoint: Any) -> int:
    """The step of a checkpoint folder (``step_0000020``)."""
    return int(Path(str(checkpoint)).name.removeprefix("step_"))


def _summary(out: Path) -> dict[str, Any]:
    try:
        found = load_json(out / "summary.json", "summary.json")
    except UsageError:
        return {}
    return found if isinstance(found, dict) else {}


def _answers(host: Host, agent: list[str] | None) -> bool:
    """Whether ``host`` runs a command through the launch agent (ssh) within PROBE_S."""
    cmd = [*agent, host.name, "true"] if agent else ["ssh", host.name, "true"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=PROBE_S).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Returns:
    """The lost ``hosts``, asked in a thread every ``REJOIN_EVERY_S`` whether they answer
    the launch agent again, while a launch runs without them; ``back`` lists those that
    did (``came_back`` is the launch's pause)."""

    def __init__(self, hosts: list[Host], agent: list[str] | None) -> None:
        self.back: list[Host] = []
        self._done, self._found = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._ask, args=(hosts, agent), daemon=True)
        if hosts:
            self._thread.start()

    def _ask(self, hosts: list[Host], agent: list[str] | None) -> None:
        while not self._done.wait(REJOIN_EVERY_S):
            back = [h for h in hosts if _answers(h, agent)]
            if back and not self._done.is_set():
                self.back = back
                self._found.set()
                return

    def came_back(self) -> bool:
        return self._found.is_set()

    def close(self) -> None:
        self._done.set()


def _lost_hosts(hosts: list[Host], summary: dict[str, Any], agent: list[str] | None
                ) -> list[Host]:  # fmt: skip
    reason = str(summary.get("reason", ""))
    return [h for h in hosts if f" on {h.name} " in f"{reason} " or not _answers(h, agent)]


def elastic(hosts: list[Host], agent: list[str] | None, args: list[str], min_hosts: int,
            rejoin: bool = True) -> int:  # fmt: skip
    """Run ``refdl train ARGS`` on ``hosts``, restarting on the survivors of each lost host
    and, with ``rejoin``, on the larger set when a lost host answers again (see the
    module's docstring); the exit status of the last run."""
    args, out = prepare(args)
    current, restarts = list(hosts), []
    run_args = args
    resumed = [*_without(args, "--devices"), "--resume", str(out), "--reshard"]  # restarts
    while True:
        missing = [h for h in hosts if h not in current] if rejoin else []
        returns = Returns(missing, agent)
        try:
            status = launch(sum(h.slots for h in current), ["-m", "refdl.train", *run_args],
                            current, agent, say_lost=False, pause=returns.came_back)  # fmt: skip
        finally:
            returns.close()
        summary = _summary(out)
        if restarts and restarts[-1]["seconds_lost"] is None:
            first = summary.get("first_step_at_unix")
            if isinstance(first, int | float):
                restarts[-1]["seconds_lost"] = round(first - restarts[-1]["lost_at_unix"], 3)
        if status in (0, PAUSED) and summary.get("status") == "completed":
            break
        if status == PAUSED and len(restarts) < MAX_RESTARTS:
            current = _take_back(hosts, current, returns.back, summary, out, restarts)
            run_args = resumed
            continue
        if status == PAUSED:  # (the ranks stopped and checkpointed; nothing is lost)
            print(f"refdl.launch: error: {MAX_RESTARTS} restarts already; resume by hand",
                  file=sys.stderr, flush=True)  # fmt: skip
            return EXIT_LOST
        if status != EXIT_LOST:
            return status
        lost = _lost_hosts(current, summary, agent)
        # no host named and every host answers: processes died, not a host (or mpirun
        # ended rank 0 before it could say which): the same hosts again
        alive = [h for h in current if h not in lost]
        last = summary.get("last_checkpoint") or _newest(out)
        why = None
        if len(alive) < min_hosts:
            why = (f"{len(alive)} host(s) remain, fewer than --min-hosts {min_hosts}; resume "
                   "by hand when hosts are back")  # fmt: skip
        elif not last:
            why = "no checkpoint was written before the loss; start the run again"
        elif len(restarts) >= MAX_RESTARTS:
            why = f"{MAX_RESTARTS} restarts already; resume by hand"
        if why:
            print(f"refdl.launch: error: {summary.get('reason', 'ranks were lost')}; {why}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return EXIT_LOST
        step = _step_of(last)
        done = summary.get("last_step_done")
        lost_at = summary.get("lost_at_unix")
        lost_at = lost_at if isinstance(lost_at, int | float) else time.time()
        restarts.append(_restart(lost_at, lost, [], current, alive, done, step))
        print(f"refdl.launch: {', '.join(h.name for h in lost) or 'ranks'} lost after step "
              f"{done if done is not None else '?'}; carrying on on "
              f"{','.join(f'{h.name}:{h.slots}' for h in alive)} from {last} "
              f"({restarts[-1]['ranks'][1]} ranks, the same global batch)", file=sys.stderr,
              flush=True)  # fmt: skip
        current, run_args = alive, resumed
    if restarts:
        _record(out, summary, restarts, hosts, current, rejoin)
    return 0


def _restart(at: float, lost: list[Host], back: list[Host], before: list[Host],
             after: list[Host], done: Any, step: int) -> dict[str, Any]:  # fmt: skip
    """A restart as the summary lists it (``seconds_lost`` filled in once the next launch
    has stepped)."""
    return {
        "at": datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat(),
        "lost_hosts": [h.name for h in lost],
        "returned_hosts": [h.name for h in back],
        "hosts_after": {h.name: h.slots for h in after},
        "ranks": [sum(h.slots for h in before), sum(h.slots for h in after)],
        "step_reached": done if isinstance(done, int) else None,
        "checkpoint_step": step,
        "steps_redone": max(0, done - step) if isinstance(done, int) else None,
        "lost_at_unix": at,
        "seconds_lost": None,
    }


def _take_back(hosts: list[Host], current: list[Host], back: list[Host],
               summary: dict[str, Any], out: Path, restarts: list[dict[str, Any]]
               ) -> list[Host]:  # fmt: skip
    """The hosts of the next launch once ``back`` answered again (in the order given at
    the start), the restart listed in ``restarts`` and said in one line."""
    larger = [h for h in hosts if h in current or h in back]
    last = summary.get("last_checkpoint") or _newest(out)
    step = _step_of(last) if last else 0
    done = summary.get("last_step_done", summary.get("steps"))
    restarts.append(_restart(time.time(), [], back, current, larger, done, step))
    print(f"refdl.launch: {', '.join(h.name for h in back)} answers again; stopped after "
          f"step {done if done is not None else '?'} and carrying on on "
          f"{','.join(f'{h.name}:{h.slots}' for h in larger)} from {last} "
          f"({restarts[-1]['ranks'][1]} ranks, the same global batch)",
          file=sys.stderr, flush=True)  # fmt: skip
    return larger


def _record(out: Path, summary: dict[str, Any], restarts: list[dict[str, Any]],
            started: list[Host], ended: list[Host], rejoin: bool) -> None:  # fmt: skip
    """The restarts into the final ``summary.json`` (rank 0 wrote the rest)."""
    batch = summary.get("global_batch")
    per_rank = None
    if isinstance(batch, int):  # at the start, then after each restart
        ranks = [restarts[0]["ranks"][0]] + [r["ranks"][1] for r in restarts]
        per_rank = [batch / r for r in ranks]
    summary["restarts"] = restarts
    summary["elastic"] = {
        "hosts_at_start": {h.name: h.slots for h in started},
        "hosts_at_end": {h.name: h.slots for h in ended},
        "global_batch": batch,
        "per_rank_batch": per_rank,
        "kept_by": "a larger per-rank batch (the global batch split over fewer ranks)",
        "rejoin": rejoin,
    }
    tmp = out / ".summary.json.elastic"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")
