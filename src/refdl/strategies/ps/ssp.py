"""The parameter server's algorithm, free of any executor: how parameters are sharded over
servers (``Layout``), when a worker may start a clock (stale-synchronous parallel, Ho et
al. 2013: ``release_allowed``), the arrival order a timing model produces
(``simulate_trace``), and the staleness of each applied gradient (``staleness_of``).
n-softsync (Gupta et al., ICDM'16): the server updates once per ``c = W/n`` gradients,
each scaled by ``1/(c·max(1, σ))``, σ its staleness in updates (``softsync_scale``), and
replies to the update's contributors; a version is then an update, not a gradient. A
contributor waits for its update, so at the end of a run, when no worker outside the
update has a clock left, it closes with fewer (``softsync_closes``).

Staleness is counted in *clocks* - how many clocks the worker ran ahead of the
slowest worker's completed work when it read the parameters (SSP's bound S
applies to it) - and in *updates* - how many updates the server applied between
the read and this one (the async-SGD definition).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from refdl.config.files import load_json
from refdl.errors import UsageError

TRAILER = 2  # each gradient message ends with (loss, clock)


class Layout:
    """Parameter leaves assigned to K servers, balanced by bytes (largest leaf first to
    the least-loaded server), and each server's leaves packed as one flat fp32 vector."""

    def __init__(self, params: Any, servers: int) -> None:
        leaves, self.treedef = jax.tree.flatten(params)
        self.shapes = [np.shape(x) for x in leaves]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        if servers > len(leaves):
            raise UsageError(
                f"--servers {servers}: the model has only {len(leaves)} parameter arrays to "
                f"shard; use --servers <= {len(leaves)}"
            )
        load = [0] * servers
        self.groups: list[list[int]] = [[] for _ in range(servers)]
        for i in sorted(range(len(leaves)), key=lambda i: (-self.sizes[i], i)):
            s = min(range(servers), key=lambda s: (load[s], s))
            self.groups[s].append(i)
            load[s] += self.sizes[i]
        for g in self.groups:
            g.sort()
        self.group_sizes = [sum(self.sizes[i] for i in g) for g in self.groups]

    def split(self, tree: Any) -> list[list[Any]]:
        leaves = jax.tree.leaves(tree)
        return [[leaves[i] for i in g] for g in self.groups]

    def join(self, groups: list[list[Any]]) -> Any:
        leaves: list[Any] = [None] * len(self.sizes)
        for g, vals in zip(self.groups, groups, strict=True):
            for i, v in zip(g, vals, strict=True):
                leaves[i] = v
        return jax.tree.unflatten(self.treedef, leaves)

    def flat(self, leaves: list[Any]) -> jax.Array:
        return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])

    def unflat(self, vec: jax.Array, s: int) -> list[jax.Array]:
        out, off = [], 0
        for i in self.groups[s]:
            out.append(vec[off : off + self.sizes[i]].reshape(self.shapes[i]))
            off += self.sizes[i]
        return out


def release_allowed(clock: int, completed: list[int], steps: int, bound: float) -> bool:
    """May a worker start ``clock``? Always for the end of the run, else only within
    ``bound`` clocks of the slowest worker's completed count (SSP; async: infinite)."""
    return clock >= steps or clock - min(completed) <= bound


def simulate_trace(
    workers: int,
    start: int,
    steps: int,
    bound: float,
    step_s: list[float],
    times: list[float] | None = None,
) -> list[tuple[int, int, int]]:
    """The arrival order of an async/SSP run under a timing model: ``(worker, clock,
    version read)`` per applied gradient. Worker w's gradient takes ``step_s[w]``;
    ties go to the lower worker index. Deterministic. ``times``, where given, receives
    each arrival's time (``refdl.perf.straggler``'s tests read the rate from them)."""
    completed = [start] * workers
    arrive = {w: step_s[w] for w in range(workers)} if start < steps else {}
    read = dict.fromkeys(range(workers), 0)
    waiting: list[int] = []
    trace, version = [], 0
    while arrive:
        w = min(arrive, key=lambda w: (arrive[w], w))
        now = arrive.pop(w)
        trace.append((w, completed[w], read[w]))
        if times is not None:
            times.append(now)
        version += 1
        completed[w] += 1
        if completed[w] < steps:
            waiting.append(w)
        for v in sorted(waiting):
            if release_allowed(completed[v], completed, steps, bound):
                waiting.remove(v)
                read[v] = version
                arrive[v] = now + step_s[v]
    return trace


def staleness_of(
    trace: list[Any], workers: int, start: int, update_of: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """Per applied gradient: (clock staleness, update staleness), from the arrival order;
    ``update_of``: the update each gradient went into (softsync; else one each)."""
    update_of = update_of or list(range(len(trace)))
    completed = [start] * workers
    min_at = [start]  # the slowest worker's completed clocks after v updates
    for i, (w, _, _) in enumerate(trace):
        completed[w] += 1
        if i + 1 == len(trace) or update_of[i + 1] != update_of[i]:
            min_at.append(min(completed))
    clocks = [int(c) - min_at[v] for _, c, v in trace]
    updates = [update_of[i] - int(v) for i, (_, _, v) in enumerate(trace)]
    return clocks, updates


def softsync_closes(chunk: list[int], per_update: int, completed: list[int], steps: int) -> bool:
    """Does the update gathering ``chunk`` (its workers) close? At ``per_update``
    gradients, or sooner when every worker outside it has run all its clocks."""
    return len(chunk) == per_update or all(
        completed[v] >= steps for v in range(len(completed)) if v not in chunk
    )


def softsync_updates(
    trace: list[Any], workers: int, start: int, steps: int, per_update: int
) -> list[int]:
    """The update each gradient of a softsync arrival order went into."""
    completed, chunk, update, out = [start] * workers, [], 0, []
    for w, _, _ in trace:
        completed[w] += 1
        chunk.append(w)
        out.append(update)
        if softsync_closes(chunk, per_update, completed, steps):
            update, chunk = update + 1, []
    return out


def softsync_scale(per_update: int, staleness: int) -> float:
    """n-softsync's weight of one gradient: the mean of ``per_update`` gradients, the rate
    divided by the staleness σ in updates (a fresh gradient, σ = 0, counts as 1)."""
    return 1.0 / (per_update * max(1, staleness))


def simulate_softsync_trace(
    workers: int,
    start: int,
    steps: int,
    per_update: int,
    step_s: list[float],
    times: list[float] | None = None,
) -> list[tuple[int, int, int]]:
    """n-softsync's arrival order under a timing model: ``(worker, clock, update read)``.
    Every ``per_update`` arrivals make an update; its contributors then read it and
    compute again (``step_s[w]`` each; ties to the lower index). Deterministic.
    ``times``, where given, receives each arrival's time."""
    completed = [start] * workers
    arrive = {w: step_s[w] for w in range(workers)} if start < steps else {}
    read = dict.fromkeys(range(workers), 0)
    trace, chunk, version = [], [], 0
    while arrive:
        w = min(arrive, key=lambda w: (arrive[w], w))
        now = arrive.pop(w)
        trace.append((w, completed[w], read[w]))
        if times is not None:
            times.append(now)
        completed[w] += 1
        chunk.append(w)
        if softsync_closes(chunk, per_update, completed, steps):
            version += 1
            for v in chunk:
                read[v] = version
                if completed[v] < steps:
                    arrive[v] = now + step_s[v]
            chunk = []
    return trace


def histogram(values: list[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}


def load_trace(
    path: str | Path, workers: int, steps: int, start: int
) -> list[tuple[int, int, int]]:
    """A recorded arrival order (``ps_trace`` of a run's ``summary.json``), checked against
    ``workers`` and ``steps``: the replay must be of the same run from step 0."""
    path = Path(path)
    data = load_json(path, "--ps-trace", limit=256 << 20)
    trace = data.get("ps_trace") if isinstance(data, dict) else data
    if not trace or not isinstance(trace, list):
        raise UsageError(f"--ps-trace {path}: no ps_trace recorded there (an async/ssp run)")
    recorded = data.get("workers", workers) if isinstance(data, dict) else workers
    if recorded != workers or start != 0:
        raise UsageError(
            f"--ps-trace {path}: recorded with {recorded} workers from step 0; "
            f"replay it with --workers {recorded} and no --resume"
        )
    if len(trace) != workers * steps:
        raise UsageError(
            f"--ps-trace {path}: {len(trace)} updates recorded, but --steps "
            f"{steps} x {workers} workers needs {workers * steps}"
        )
    try:
        out = [tuple(int(v) for v in e) for e in trace]
    except (TypeError, ValueError):
        out = []
    ok = len(out) == len(trace) and all(
        len(e) == 3 and 0 <= e[0] < workers and 0 <= e[1] < steps and 0 <= e[2] <= i
        for i, e in enumerate(out)
    )
    if not ok:
        raise UsageError(
            f"--ps-trace {path}: entries must be [worker, clock, version read] with "
            f"0 <= worker < {workers}, 0 <= clock < {steps} and version <= the entry's index"
        )
    return out
