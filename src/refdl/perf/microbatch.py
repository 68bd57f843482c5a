"""Micro-batch selection for convolutions (μ-cuDNN, Oyama et al., 2018).

A convolution over a batch of ``B`` may run as micro-batches that sum to ``B``, each by
any implementation, under a limit on the workspace one micro-batch needs. Given each
``(implementation, size)``'s measured time and workspace:

- ``best_split`` (μ-cuDNN's per-layer mode): dynamic programming over the batch,
  ``T[n] = min over (impl, b) with workspace <= limit of T[n - b] + t(impl, b)``, with
  ``b`` a power of two (``powers``) or any size (``all``);
- ``shared_limit`` (its workspace-division mode): each layer's candidate splits (the
  fastest under each of its distinct workspaces), one per layer chosen by a 0-1 integer
  program (``scipy.optimize.milp``) so that the layers' workspaces together fit the
  limit and their times sum to the least.

Workspace here is the memory an implementation needs beyond its input and output: the
gathered patches of ``im2col`` (``b·Ho·Wo·kh·kw·C`` fp32 values), none for XLA's own
convolution (cuDNN's algorithms each state theirs; XLA:CPU's emitter needs none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from refdl.errors import UsageError

Choice = tuple[str, int]  # (implementation, micro-batch size)


def workspace_bytes(sig: tuple, impl: str, b: int) -> int:
    """Bytes of workspace one micro-batch of ``b`` needs (``sig``: x shape, kernel shape,
    strides, padding, as ``core.conv`` records them)."""
    if impl != "im2col":
        return 0
    (_, h, w, c), (kh, kw, _, _), (sh, sw), padding = sig
    if padding == "SAME":
        ho, wo = -(-h // sh), -(-w // sw)
    else:
        ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
    return 4 * b * ho * wo * kh * kw * c


def sizes(batch: int, policy: str) -> list[int]:
    """Micro-batch sizes a policy tries: powers of two up to the batch (and the batch
    itself), or every size from 1."""
    if policy == "all":
        return list(range(1, batch + 1))
    if policy != "powers":
        raise UsageError(f"--policy {policy!r}: choose powers or all")
    out = [1 << i for i in range(batch.bit_length()) if 1 << i <= batch]
    return sorted({*out, batch})


def best_split(
    batch: int, times: Mapping[Choice, float], work: Mapping[Choice, int], limit: float
) -> tuple[float, list[Choice]]:
    """The fastest micro-batches covering ``batch`` whose workspace fits ``limit``: total
    time and the choices, largest first. Raises when nothing fits."""
    best = [0.0] + [math.inf] * batch
    how: list[Choice | None] = [None] * (batch + 1)
    allowed = [(c, t) for c, t in times.items() if work[c] <= limit]
    for n in range(1, batch + 1):
        for (impl, b), t in allowed:
            if b <= n and best[n - b] + t < best[n]:
                best[n], how[n] = best[n - b] + t, (impl, b)
    if math.isinf(best[batch]):
        raise UsageError(f"no micro-batch fits a workspace of {limit:.0f} bytes")
    out, n = [], batch
    while n:
        out.append(how[n])
        n -= how[n][1]
    return best[batch], sorted(out, key=lambda c: (-c[1], c[0]))


def candidates(
    batch: int, times: Mapping[Choice, float], work: Mapping[Choice, int]
) -> list[tuple[float, int, list[Choice]]]:
    """A layer's Pareto front: for each distinct workspace, the fastest split that needs
    no more; ``(time, workspace, split)``, no candidate slower and larger than another."""
    out: list[tuple[float, int, list[Choice]]] = []
    for limit in sorted(set(work.values())):
        try:
            t, split = best_split(batch, times, work, limit)
        except UsageError:
            continue
        need = max(work[c] for c in split)
        if not out or t < out[-1][0]:
            out.append((t, need, split))
    return out


def shared_limit(
    layers: Sequence[list[tuple[float, int, list[Choice]]]], limit: float
) -> list[int]:
    """One candidate per layer (indices) whose workspaces sum to at most ``limit`` with the
    least total time: a 0-1 integer program solved by HiGHS through ``scipy.optimize.milp``."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    cost = np.array([t for cands in layers for t, _, _ in cands])
    work = np.array([w for cands in layers for _, w, _ in cands], float)
    pick = np.zeros((len(layers), len(cost)))
    first = 0
    for i, cands in enumerate(layers):
        pick[i, first : first + len(cands)] = 1
        first += len(cands)
    result = milp(
        cost,
        constraints=[LinearConstraint(pick, 1, 1), LinearConstraint(work[None], 0, limit)],
        integrality=np.ones_like(cost),
        bounds=Bounds(0, 1),
    )
    if not result.success:
        raise UsageError(f"the layers' smallest workspaces do not fit together in {limit:.0f} "
                         "bytes")  # fmt: skip
    chosen, first = [], 0
    for cands in layers:
        x = result.x[first : first + len(cands)]
        chosen.append(int(np.argmax(x)))
        first += len(cands)
    return chosen
