"""Communication graphs for decentralized training and their mixing matrices.

A topology is an undirected, connected graph over n workers. Its mixing matrix
``W`` is doubly stochastic with Metropolis-Hastings weights
(Xiao & Boyd, "Fast linear iterations for distributed averaging", 2004):
``W_ij = 1 / (1 + max(d_i, d_j))`` for each edge, ``W_ii = 1 - sum_j W_ij``.
Neighbour exchange is written as cyclic shifts: for shift s, worker j sends to
``(j + s) mod n`` when that pair is an edge, which maps onto one ``ppermute``
(one process) or one send/receive pair per rank (MPI).
"""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path

import numpy as np

from refdl.config.choices import TOPOLOGIES
from refdl.config.files import read_text
from refdl.errors import UsageError


def adjacency(name: str, n: int) -> np.ndarray:
    """The boolean adjacency matrix of topology ``name`` (or an adjacency file) on n workers."""
    if n < 1:
        raise UsageError(f"a topology needs at least 1 worker (got {n})")
    a = np.zeros((n, n), bool)
    if name == "ring":
        for i in range(n):
            a[i, (i + 1) % n] = a[(i + 1) % n, i] = True
    elif name == "torus":
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        cols = n // rows
        if rows < 2:
            raise UsageError(
                f"--topology torus needs a worker count that factors as rows x cols with both "
                f">= 2 (got {n}); use 4, 6, 8, 9, ... workers or --topology ring"
            )
        for i in range(n):
            r, c = divmod(i, cols)
            for j in ((r + 1) % rows * cols + c, r * cols + (c + 1) % cols):
                a[i, j] = a[j, i] = True
    elif name == "exp2":  # Assran et al. (SGP) / Lian et al.: neighbours at distance 2^k
        k = 1
        while k < n:
            for i in range(n):
                a[i, (i + k) % n] = a[(i + k) % n, i] = True
            k *= 2
    elif name == "complete":
        a[:] = True
    else:
        a = _read_adjacency(name, n)
    np.fill_diagonal(a, False)
    if n > 1 and not _connected(a):
        raise UsageError(f"--topology {name}: the graph is not connected, so replicas never agree")
    return a


def _read_adjacency(path: str, n: int) -> np.ndarray:
    """An adjacency file: n lines of n 0/1 numbers (symmetric)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(
            f"unknown --topology {path!r}: choose one of {', '.join(TOPOLOGIES)} or give an "
            "adjacency file (n lines of n 0/1 numbers)"
        )
    text = read_text(p, "--topology", limit=64 << 20)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty file: refused below, in one line
            m = np.loadtxt(io.StringIO(text), ndmin=2)
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise UsageError(f"--topology {path}: not a matrix of 0/1 numbers ({e})") from None
    if m.shape != (n, n):
        raise UsageError(
            f"--topology {path}: the matrix is {m.shape[0]}x{m.shape[1]} but there are {n} "
            "workers; give an n x n matrix"
        )
    if not np.isin(m, (0, 1)).all() or not (m == m.T).all():
        raise UsageError(f"--topology {path}: entries must be 0/1 and the matrix symmetric")
    return m.astype(bool)


def _connected(a: np.ndarray) -> bool:
    seen, todo = {0}, [0]
    while todo:
        i = todo.pop()
        for j in np.flatnonzero(a[i]):
            if j not in seen:
                seen.add(int(j))
                todo.append(int(j))
    return len(seen) == len(a)


def metropolis(a: np.ndarray) -> np.ndarray:
    """Metropolis-Hastings weights: symmetric, doubly stochastic, positive diagonal."""
    deg = a.sum(1)
    w = np.where(a, 1.0 / (1.0 + np.maximum(deg[:, None], deg[None, :])), 0.0)
    np.fill_diagonal(w, 1.0 - w.sum(1))
    return w


def spectral_gap(w: np.ndarray) -> float:
    """``1 - |lambda_2|`` of W: the consensus contraction per step (larger mixes faster)."""
    if len(w) == 1:
        return 1.0
    ev = np.sort(np.abs(np.linalg.eigvalsh(w)))[::-1]
    return float(1.0 - ev[1])


def shifts(a: np.ndarray) -> list[int]:
    """The cyclic shifts s for which some edge ``(j, j+s)`` exists, ascending."""
    n = len(a)
    return [s for s in range(1, n) if any(a[j, (j + s) % n] for j in range(n))]


def matchings(a: np.ndarray) -> list[list[int]]:
    """A cover of the edges by matchings (greedy edge colouring), each as ``partner[i]``
    (``-1``: unmatched). Randomized gossip averages over one matching per step."""
    n = len(a)
    out: list[list[int]] = []
    for i in range(n):
        for j in range(i + 1, n):
            if not a[i, j]:
                continue
            for m in out:
                if m[i] < 0 and m[j] < 0:
                    m[i], m[j] = j, i
                    break
            else:
                m = [-1] * n
                m[i], m[j] = j, i
                out.append(m)
    return out or [[-1] * n]


def gossip_matching(seed: int, step: int, count: int) -> int:
    """Which matching randomized gossip uses at ``step`` (the same on every rank)."""
    return int(np.random.default_rng([seed, step, 7]).integers(count))
