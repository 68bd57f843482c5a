"""What one persistent straggler costs a step (``refdl predict --straggler RANK:SECONDS``).

``refdl train --straggler RANK:SECONDS`` delays one worker by ``s`` before each of its
steps. With every other worker's step taking ``t``, the steady state of a run is that of
``n`` groups which advance independently, the straggler's group at ``t + s``: the server
receives ``W`` gradients (a step's worth) every ``n / ((n - 1) / t + 1 / (t + s))``
seconds (``straggled``). What ``n`` is (``groups``):

- 1 where every worker waits for the slowest each step: ps ``sync`` and ``hierarchical``
  (the server, or an aggregator, waits for every gradient); ps ``ssp`` with any finite
  staleness once the fast workers are that many clocks ahead (SSP absorbs a delay of up
  to S clocks, not a persistent one); decentralized, whose step all-reduces the loss
  (a neighbour exchange alone would also hold the slowest's pace on a connected graph).
- ``W`` for ps ``async``: no one waits, the straggler only contributes fewer gradients.
- ``n`` for ps ``softsync --softsync-n n``: an update takes ``W / n`` gradients and its
  contributors wait for it, so the straggler's ``W / n - 1`` chunk-mates wait with it.

The tests hold these against refdl's own arrival simulator (``--simulate``'s timing
model, ``refdl.strategies.ps.ssp``); ``scripts/bench_straggler.py`` against real mpirun
runs.
"""

from __future__ import annotations

from refdl.errors import UsageError


def straggled(step_s: float, seconds: float, groups: int) -> float:
    """The time of a step's worth of gradients when one worker of ``groups`` independent
    groups takes ``step_s + seconds`` and the others ``step_s`` (see the module)."""
    if seconds <= 0 or step_s <= 0:
        return step_s + max(seconds, 0.0)
    return groups / ((groups - 1) / step_s + 1 / (step_s + seconds))


def groups(cost: str, ps_mode: str, softsync_n: int | None, workers: int) -> int:
    """How many groups advance independently around a straggler (see the module): the
    ``cost`` formula's name (``parameter_server``, ``gossip``) and its mode."""
    if cost != "parameter_server" or ps_mode in ("sync", "hierarchical", "ssp"):
        return 1
    if ps_mode == "async":
        return workers
    if ps_mode == "softsync":
        if softsync_n is None:
            raise UsageError("--ps-mode softsync and --softsync-n N go together (the server "
                             "updates after every W/N gradients)")  # fmt: skip
        if softsync_n > workers or workers % softsync_n:
            raise UsageError(f"--softsync-n {softsync_n}: the {workers} workers do not "
                             f"split into {softsync_n} equal updates; use a divisor of "
                             f"{workers}")  # fmt: skip
        return softsync_n
    raise UsageError(f"unknown --ps-mode {ps_mode!r}")
