"""Checkpoints on disk with orbax: atomic, self-describing, strategy-independent.

A checkpoint is ``DIR/checkpoints/step_0000100/`` holding the full host
``TrainState`` (whatever strategy wrote it) and a JSON ``meta`` (the RunSpec,
the step, the state's tree structure). Orbax writes into a temporary folder
and renames it when complete, so a folder named ``step_N`` with orbax's
commit marker is always a whole checkpoint; an interrupted write leaves only a
temporary folder, which ``latest`` ignores.

Leaves are stored flat (``leaf_00000`` ...) in ``jax.tree.leaves`` order and
restored into the structure of a freshly initialised state, with the recorded
key paths checked first: a checkpoint from another model or optimizer is a
clear error, never a silent mis-assignment.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from refdl.core.state import TrainState
from refdl.errors import UsageError

_STEP_DIR = re.compile(r"^step_(\d+)$")
_MARKER = "_CHECKPOINT_METADATA"


def _checkpointer(writing: bool = False):
    """Orbax's checkpointer. Across processes (jax.distributed) only rank 0 writes, with no
    barrier; every rank reads (``restore`` is called by all of them together)."""
    if writing and jax.process_count() > 1:  # only rank 0 writes, without barriers
        mp = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
        handler = ocp.CompositeCheckpointHandler(
            composite_options=ocp.CompositeOptions(multiprocessing_options=mp),
            state=ocp.StandardCheckpointHandler(multiprocessing_options=mp),
            meta=ocp.JsonCheckpointHandler(multiprocessing_options=mp),
        )
        return ocp, ocp.Checkpointer(handler, multiprocessing_options=mp)
    return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _paths(state: TrainState) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def save(ckpt_dir: str | Path, state: TrainState, meta: dict[str, Any], keep: int = 3) -> Path:
    """Write the host ``state`` as ``ckpt_dir/step_N`` (N = its step); keep the newest ``keep``."""
    ocp, ck = _checkpointer(writing=True)
    ckpt_dir = Path(ckpt_dir).absolute()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = int(np.asarray(state.step).reshape(-1)[0])  # replicated strategies stack it
    path = ckpt_dir / f"step_{step:07d}"
    if path.exists():  # re-saving the same step (e.g. final == periodic): keep the first
        return path
    leaves = {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))}
    meta = {**meta, "step": step, "tree_paths": _paths(state)}
    ck.save(
        path,
        args=ocp.args.Composite(state=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)),
    )
    for old in all_checkpoints(ckpt_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def all_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The complete checkpoints under ``ckpt_dir``, oldest first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / _MARKER).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def resolve(path: str | Path) -> Path:
    """A checkpoint folder from ``path``: a checkpoint itself, a run dir or its checkpoints dir."""
    p = Path(path)
    if _STEP_DIR.match(p.name) and (p / _MARKER).is_file():
        return p
    for d in (p / "checkpoints", p):
        found = all_checkpoints(d)
        if found:
            return found[-1]
    raise UsageError(
        f"--resume {path}: no checkpoint there (expected a run folder with checkpoints/step_N, "
        "or a step_N folder)"
    )


def read_meta(path: str | Path) -> dict[str, Any]:
    """The JSON metadata of the checkpoint at ``path``."""
    plain = Path(path) / "meta" / "metadata"  # JsonSave's file: read without starting JAX
    if plain.is_file():
        return json.loads(plain.read_text())
    ocp, ck = _checkpointer()
    return ck.restore(Path(path).absolute(), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
        "meta"
    ]


def restore(path: str | Path, like: TrainState) -> TrainState:
    """The state saved at ``path``, in the structure of ``like`` (a fresh host state)."""
    ocp, ck = _checkpointer()
    path = Path(path).absolute()
    meta = read_meta(path)
    want = _paths(like)
    if meta.get("tree_paths") != want:
        raise UsageError(
            f"--resume {path}: the checkpoint's state does not match this run's model and "
            "optimizer (different parameters or optimizer state); resume with the same settings"
        )
    leaves = jax.tree.leaves(like)
    abstract = {
        f"leaf_{i:05d}": jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
        for i, x in enumerate(leaves)
    }
    restored = ck.restore(path, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))[
        "state"
    ]
    arrays = [np.asarray(restored[f"leaf_{i:05d}"]) for i in range(len(leaves))]
    return jax.tree.unflatten(jax.tree.structure(like), arrays)


def load_leaves(path: str | Path) -> dict[str, np.ndarray]:
    """Every saved array keyed by its tree path (``.params['00_conv']['kernel']``, ...), from a
    checkpoint or run folder: for comparing runs whose state structures differ."""
    ocp, ck = _checkpointer()
    path = resolve(path).absolute()
    names = read_meta(path)["tree_paths"]
    raw = ck.restore(path, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    return {name: np.asarray(raw[f"leaf_{i:05d}"]) for i, name in enumerate(names)}
