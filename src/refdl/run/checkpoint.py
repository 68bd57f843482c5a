"""Checkpoints with orbax: each process writes its own shards, in the background; a
restore places every array straight into the new run's shardings.

``DIR/checkpoints/step_0000100/`` is one orbax checkpoint (``CheckpointManager``,
tensorstore's OCDBT + zarr3 format) with two items:

- ``state/``: the leaves of the strategy's checkpoint view
  (``Strategy.checkpoint_view``: the run's state in the strategy-independent
  ``TrainState`` structure, still sharded on the devices) as ``leaf_00000``,
  ``leaf_00001``, ... Each shard is written by the process whose device holds it
  (``ocdbt.process_K/``); nothing is gathered to rank 0.
- ``meta/metadata``: JSON: format 2, the step, the run's settings (``spec``) and
  their configuration key, and each leaf's tree path, shape, dtype and fingerprint.

A save copies the arrays to host memory and returns; orbax writes them in a
background thread into ``step_N.orbax-checkpoint-tmp-*`` and renames that to
``step_N`` once every process has committed, so a folder named ``step_N`` is
complete. Temporaries a killed writer left are removed when the next run starts.

Restoring checks before use, as format 1 did: the folder holds only regular files
and folders of bounded size (no link, FIFO or device), orbax's own JSON files
parse within bounds, the manifest has its schema, the configuration key matches,
the tree paths match the run's, and each restored array's fingerprint equals the
saved one. The fingerprint is two 32-bit sums of the array's words, each word
weighted by a hash of its position: integer sums modulo 2**32 do not depend on
the order of addition, so it is the same for any sharding and is computed on the
devices without gathering. It detects damage, not forgery. Format-1 checkpoints
(one ``state.npz``, ``refdl.run.checkpoint_npz``) are still read, and will be until
refdl 1.0 and at least until 2027-06-01.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from refdl.config.files import load_json
from refdl.core.state import place
from refdl.errors import UsageError
from refdl.parallel import processes
from refdl.run import checkpoint_npz
from refdl.run.checkpoint_npz import (  # noqa: F401 (part of this module's interface)
    Damaged,
    _int,
    all_checkpoints,
    config_key,
    differing,
    is_checkpoint,
)

FORMAT = 2
STATE, META = "state", "meta"
META_FILE = f"{META}/metadata"
_TMP_DIR = re.compile(r"^step_\d+\.orbax-checkpoint-tmp")
_FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")
_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                     "uint64", "float16", "bfloat16", "float32", "float64"})  # fmt: skip
MANIFEST_LIMIT = checkpoint_npz.MANIFEST_LIMIT
JSON_LIMIT = 64 << 20  # orbax's own metadata files
FILE_LIMIT = 1 << 44
MAX_ENTRIES = 1 << 20  # files and folders in one checkpoint
_ORBAX_JSON = ("_METADATA", "_CHECKPOINT_METADATA", "_sharding")


def _ocp() -> Any:
    import orbax.checkpoint as ocp  # ~1 s to import: only when a checkpoint is touched

    if not getattr(_ocp, "quiet", False):  # orbax logs through absl's Python logger
        logging.getLogger("absl").addFilter(_not_about_format_1)
        _ocp.quiet = True
    return ocp


def _not_about_format_1(record: logging.LogRecord) -> bool:
    """False for orbax's warning that a step folder has no metadata of its own when that
    folder is a format-1 checkpoint (``state.npz``): expected until format 1 goes."""
    text = str(record.getMessage())
    if not text.startswith("Metadata file does not exist: "):
        return True
    return not (Path(text.split(": ", 1)[1]).parent / checkpoint_npz.STATE).exists()


def _keys(n: int) -> list[str]:
    return [f"leaf_{i:05d}" for i in range(n)]


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def step_of(state: Any) -> int:
    """The step a (host or device, replicated or stacked) state is at."""
    x = state.step
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return int(np.asarray(x).reshape(-1)[0])


# -- fingerprints ------------------------------------------------------------------------


def _words(x: jax.Array) -> jax.Array:
    """The array's bytes as uint32 words in its own shape (8-byte types: a last axis of 2;
    narrower types widened), so nothing is reshaped or copied across its sharding."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    as_uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, as_uint).astype(jnp.uint32)


def _position(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position (mod 2**32), from iotas: no flat copy."""
    i = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        i = i + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return i


def _fingerprint(x: jax.Array) -> jax.Array:
    u = _words(x)
    h = _position(u.shape) * jnp.uint32(0x9E3779B1)
    h = (h ^ (h >> 15)) * jnp.uint32(0x85EBCA77)
    a = jnp.sum(u * (h | jnp.uint32(1)), dtype=jnp.uint32)
    v = u ^ h
    b = jnp.sum(((v << 13) | (v >> 19)) * jnp.uint32(0x27D4EB2F), dtype=jnp.uint32)
    return jnp.stack([a ^ jnp.uint32(u.size & 0xFFFFFFFF), b])


_fingerprint_jit = jax.jit(_fingerprint)
_all_fingerprints = jax.jit(lambda leaves: [_fingerprint(x) for x in leaves])
SMALL_LEAF = 16 << 20  # bytes of words: leaves below are fingerprinted together


def fingerprints(leaves: list[Any]) -> list[str]:
    """Each array's fingerprint (16 hex digits), the same for any sharding of it; every
    process holding a part of a sharded array must call this at the same point."""
    if not leaves:
        return []
    # Small leaves in one program (one reduction across processes, not one per leaf); each
    # large one alone, so the words and hashes held at once stay about twice one leaf.
    small = [i for i, x in enumerate(leaves) if np.size(x) * 4 <= SMALL_LEAF]
    groups = [small] if small else []
    groups += [[i] for i in range(len(leaves)) if i not in set(small)]
    found: dict[int, Any] = {}
    for group in groups:
        try:
            found.update(zip(group, _all_fingerprints([leaves[i] for i in group]), strict=True))
        except ValueError:  # leaves on different devices (pipeline stages): one at a time
            found.update((i, _fingerprint_jit(leaves[i])) for i in group)
    local = [found[i] if found[i].is_fully_addressable else found[i].addressable_data(0)
             for i in range(len(leaves))]  # fmt: skip
    table = np.asarray(jax.device_get(local)).reshape(len(leaves), 2)
    return [f"{int(a):08x}{int(b):08x}" for a, b in table]


# -- saving ------------------------------------------------------------------------------


def _dtype_name(x: Any) -> str:
    return np.dtype(x.dtype).name


class Saver:
    """One run's checkpoints under ``ckpt_dir`` (an orbax ``CheckpointManager``): saves
    commit in the background unless ``asynchronous`` is off; the newest ``keep`` stay.
    Under ``jax.distributed`` every process makes one and calls ``save`` together."""

    def __init__(self, ckpt_dir: str | Path, keep: int = 3, asynchronous: bool = True) -> None:
        ocp = _ocp()
        self.dir = Path(ckpt_dir).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=asynchronous,
            step_name_format=ocp.step.standard_name_format(
                step_prefix="step", step_format_fixed_length=7
            ),
            create=True,
            cleanup_tmp_directories=True,
            enable_background_delete=True,  # the oldest step goes while training goes on
        )
        self.manager = ocp.CheckpointManager(self.dir, options=options, item_names=(STATE, META))
        self.steps: set[int] = set()

    def save(self, view: Any, meta: dict[str, Any]) -> Path:
        """Start saving ``view`` (the checkpoint view of the state) with ``meta`` (``spec``:
        the run's settings); the path ``step_N`` will have once committed."""
        ocp = _ocp()
        step = step_of(view)
        path = self.dir / f"step_{step:07d}"
        if step in self.steps:  # the final save of a step a periodic save wrote
            return path
        if self._clear(path, meta):
            self.steps.add(step)
            return path
        leaves = jax.tree.leaves(view)
        spec = meta.get("spec")
        manifest = {
            **meta,
            **({"config": config_key(spec)} if isinstance(spec, dict) else {}),
            "format": FORMAT,
            "step": step,
            "tree_paths": _paths(view),
            "leaves": [
                {"shape": list(np.shape(x)), "dtype": _dtype_name(x), "fingerprint": f}
                for x, f in zip(leaves, fingerprints(leaves), strict=True)
            ],
        }
        state = dict(zip(_keys(len(leaves)), leaves, strict=True))
        self.manager.save(step, args=ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(manifest)}
        ), force=True)  # fmt: skip
        self.steps.add(step)
        return path

    def _clear(self, path: Path, meta: dict[str, Any]) -> bool:
        """Whether ``path`` already holds this run's step (nothing to write); a step
        folder of another configuration, or damaged, is moved aside and removed first."""
        if not path.exists() and not path.is_symlink():
            return False
        same = processes.broadcast(_same_run(path, meta))
        if same:
            return True
        if processes.launched_rank() == 0:
            gone = Path(tempfile.mkdtemp(dir=self.dir, prefix=f".{path.name}.tmp-"))
            os.replace(path, gone / "old")
            shutil.rmtree(gone, ignore_errors=True)
        processes.broadcast(None)  # every process waits until it is gone
        self.manager.reload()
        return False

    def wait(self) -> None:
        """Block until every started save has committed (an error in one is raised)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the saves, then release orbax's threads."""
        try:
            self.wait()
        finally:
            self.manager.close()


def _same_run(path: Path, meta: dict[str, Any]) -> bool:
    return checkpoint_npz._same_run(path, meta, read=read_meta)  # either format's manifest


def save(ckpt_dir: str | Path, state: Any, meta: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` (host or device arrays) as ``ckpt_dir/step_N`` and wait until it is
    committed; keep the newest ``keep``. Returns its path."""
    saver = Saver(ckpt_dir, keep, asynchronous=False)
    try:
        return saver.save(state, meta)
    finally:
        saver.close()


def remove_temporaries(ckpt_dir: str | Path) -> list[Path]:
    """Delete the temporary folders a killed writer left (either format); those removed."""
    d = Path(ckpt_dir)
    gone = checkpoint_npz.remove_temporaries(d)
    extra = [p for p in d.iterdir() if _TMP_DIR.match(p.name)] if d.is_dir() else []
    for p in extra:
        if p.is_symlink():
            p.unlink()
        else:
            shutil.rmtree(p, ignore_errors=True)
    return gone + extra


# -- reading -----------------------------------------------------------------------------


def is_npz(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is in format 1 (one ``state.npz``)."""
    return any(os.path.lexists(path / n) for n in (checkpoint_npz.STATE, checkpoint_npz.META))


def _leaf_ok(e: Any) -> bool:
    if not isinstance(e, dict):
        return False
    shape, dtype, fp = e.get("shape"), e.get("dtype"), e.get("fingerprint")
    return (isinstance(shape, list) and len(shape) <= 32
            and all(_int(d, 0, 1 << 40) for d in shape)
            and isinstance(dtype, str) and dtype in _DTYPES
            and isinstance(fp, str) and _FINGERPRINT.match(fp) is not None)  # fmt: skip


def read_meta(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (either format), held to a strict
    schema: ``Damaged`` if it is not one."""
    path = Path(path)
    if is_npz(path):
        return checkpoint_npz.read_meta(path)
    return checkpoint_npz.load_manifest(path, META_FILE, FORMAT, _leaf_ok, "dtype or fingerprint")


def check_files(path: Path) -> None:
    """Every entry of the checkpoint folder a regular file or folder, bounded in size and
    number, and orbax's own JSON files parse within bounds: ``Damaged`` otherwise."""
    n = 0
    for root, dirs, files in os.walk(path):  # never follows links
        for name in dirs + files:
            n += 1
            p = Path(root) / name
            rel = p.relative_to(path)
            if n > MAX_ENTRIES:
                raise Damaged(f"more than {MAX_ENTRIES} files")
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                raise Damaged(f"{rel} is a link, not a regular file")
            a_file = (name in _ORBAX_JSON or name == "manifest.ocdbt"
                      or rel.parent.name in ("d", "array_metadatas"))  # fmt: skip
            if a_file and stat.S_ISDIR(st.st_mode):
                raise Damaged(f"{rel} is not a regular file (a folder)")
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise Damaged(f"{rel} is not a regular file (a FIFO, socket or device)")
            limit = MANIFEST_LIMIT if name == "manifest.ocdbt" else FILE_LIMIT
            if stat.S_ISREG(st.st_mode) and st.st_size > limit:
                raise Damaged(f"{rel} is larger than {limit} bytes")
            if name in _ORBAX_JSON or rel.parent.name == "array_metadatas":
                try:
                    load_json(p, str(rel), limit=JSON_LIMIT, error=Damaged)
                except Damaged as e:
                    raise Damaged(f"{rel} is unreadable ({str(e).split(': ', 1)[-1]})") from None


def _targets(meta: dict[str, Any], like: list[Any] | None) -> dict[str, Any]:
    """What orbax restores each leaf as: into ``like``'s sharding (a device array or an
    abstract one), or a host array."""
    out = {}
    for key, e, t in zip(_keys(len(meta["leaves"])), meta["leaves"],
                         like or [None] * len(meta["leaves"]), strict=True):  # fmt: skip
        shape, dtype = tuple(e["shape"]), jnp.dtype(e["dtype"])
        sharding = getattr(t, "sharding", None)
        if sharding is None:
            out[key] = np.empty(shape, dtype)
        else:
            out[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return out


def _read(path: Path, meta: dict[str, Any], like: list[Any] | None) -> list[Any]:
    """The checkpoint's arrays (orbax), each checked against its fingerprint."""
    ocp = _ocp()
    problem = None
    leaves: list[Any] = []
    _quiet_closed_loops()  # before: a failed read's stray callbacks fire as orbax closes
    try:
        check_files(path)
        targets = _targets(meta, like)
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as reader:
            # orbax reads absolute paths only: a run named relative to here (--resume
            # runs/mlp) is read where it is
            state = (path / STATE).absolute()
            got = reader.restore(state, args=ocp.args.StandardRestore(targets))
        leaves = [got[k] for k in _keys(len(meta["leaves"]))]
    except Damaged as e:
        problem = str(e)
    except Exception as e:  # tensorstore, orbax: any failure to read means damage
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        problem = f"{STATE}/ is unreadable ({type(e).__name__}{': ' + first if first else ''})"
    problem = _agree(problem)
    if problem:
        raise Damaged(problem)
    for i, (x, want, f) in enumerate(zip(leaves, meta["leaves"], fingerprints(leaves),
                                         strict=True)):  # fmt: skip
        if list(np.shape(x)) != want["shape"] or _dtype_name(x) != want["dtype"]:
            raise Damaged(f"array {i} ({meta['tree_paths'][i]}) has the wrong shape")
        if f != want["fingerprint"]:
            raise Damaged(f"array {i} ({meta['tree_paths'][i]}) does not match its fingerprint")
    return leaves


def _quiet_closed_loops() -> None:
    """After a failed read, tensorstore's reads still in flight finish on their own threads
    and call back into orbax's event loop, closed by then: each callback's RuntimeError
    ("Event loop is closed") would print a traceback, and asyncio would log the abandoned
    reads' errors, breaking the one-line report. Those (and only those) are dropped; every
    other unraisable exception goes to the hook that was there."""
    if getattr(sys.unraisablehook, "refdl_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(args: Any) -> None:
        closed = isinstance(args.exc_value, RuntimeError) and "Event loop is closed" in str(
            args.exc_value
        )
        if not closed:
            previous(args)

    hook.refdl_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    # a callback that fails on tensorstore's own thread may be printed through
    # sys.excepthook instead (PyErr_Print; seen once in 9 suite runs, 2026-11-27)
    before = sys.excepthook

    def excepthook(kind: type, value: BaseException, tb: Any) -> None:
        if not (isinstance(value, RuntimeError) and "Event loop is closed" in str(value)):
            before(kind, value, tb)

    sys.excepthook = excepthook
    # and orbax's other reads, abandoned, are reported by asyncio when collected
    logging.getLogger("asyncio").addFilter(
        lambda record: "exception was never retrieved" not in str(record.msg)
    )


def _agree(problem: str | None) -> str | None:
    """Under ``jax.distributed``, the first process's problem (if any process had one),
    so every process skips the same checkpoint."""
    if jax.process_count() == 1 or not processes.under_mpi():
        return problem
    found = [p for p in processes.comm().allgather(problem) if p]
    return found[0] if found else None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The checkpoint a resume uses, with its verified arrays (in the order of the run's
    state's leaves), and the newer ones it skipped (name, reason)."""

    path: Path
    meta: dict[str, Any]
    leaves: list[Any]
    skipped: tuple[tuple[str, str], ...] = ()

    def report(self) -> str:
        """One line for the log: which checkpoint, and why newer ones were not used."""
        why = "; ".join(f"skipped {name}: {reason}" for name, reason in self.skipped)
        return f"resuming from {self.path}" + (f" ({why})" if why else "")


def _check_like(path: Path, meta: dict[str, Any], like: Any) -> None:
    """A UsageError unless the checkpoint holds ``like``'s leaves (paths and shapes)."""
    shapes = [list(np.shape(x)) for x in jax.tree.leaves(like)]
    if meta["tree_paths"] != _paths(like) or [e["shape"] for e in meta["leaves"]] != shapes:
        raise UsageError(
            f"--resume {path}: the checkpoint's state does not match this run's model "
            "and optimizer (different parameters or optimizer state); resume with the same "
            "settings"
        )


def resolve(
    path: str | Path, config: dict[str, Any] | None = None, like: Any = None, arrays: bool = True
) -> Choice:
    """The newest intact checkpoint ``path`` names (a checkpoint itself, a run folder or
    its ``checkpoints`` folder) of the configuration ``config`` (settings; None: any),
    its arrays read into ``like``'s shardings (a tree of device or abstract arrays with
    the run's state's structure; None: host arrays). One written by other settings or
    damaged is skipped, and said why; a UsageError says why none can be used, or that
    the state is another model's. ``arrays=False`` checks the files and the manifest only
    and reads no array (nor starts JAX's backend): for the settings, before the ranks
    join."""
    p = Path(path)
    if checkpoint_npz._STEP_DIR.match(p.name) and p.is_dir():
        candidates = [p]
    else:
        candidates = all_checkpoints(p / "checkpoints") or all_checkpoints(p)
    if not candidates:
        raise UsageError(
            f"--resume {path}: no checkpoint there (expected a run folder with checkpoints/"
            "step_N, or a step_N folder)"
        )
    skipped = []
    want = config_key(config) if config is not None else None
    for c in reversed(candidates):
        try:
            meta = read_meta(c)
            if want is not None and config_key(meta["spec"]) != want:
                keys = differing(config, meta["spec"])[:4]
                what = ", ".join(f"{k} {meta['spec'][k]!r}, the run's {config[k]!r}" for k in keys)
                raise Damaged(f"written by another configuration ({what or 'other settings'})")
            if like is not None:
                _check_like(c, meta, like)
            like_leaves = None if like is None else jax.tree.leaves(like)
            if is_npz(c):
                leaves = checkpoint_npz.read_leaves(c, meta)
                if like_leaves is not None:
                    leaves = [_place(x, t) for x, t in zip(leaves, like_leaves, strict=True)]
            elif not arrays:
                check_files(c)
                leaves = []
            else:
                leaves = _read(c, meta, like_leaves)
            return Choice(c, meta, leaves, tuple(skipped))
        except Damaged as e:
            skipped.append((c.name, str(e)))
    reasons = "; ".join(f"{n}: {r}" for n, r in skipped)
    raise UsageError(f"--resume {path}: no intact checkpoint of this run ({reasons})")


def _place(x: np.ndarray, like: Any) -> Any:
    """A format-1 host array where ``like`` puts it (each device its own slice)."""
    sharding = getattr(like, "sharding", None)
    return x if sharding is None else place(x, sharding)


def restore(choice: Choice | str | Path, like: Any) -> Any:
    """The checkpoint's state (a ``Choice``, or a path ``resolve`` picks from) in the
    structure of ``like``; a checkpoint of another model or optimizer is a UsageError,
    never a mis-assignment."""
    if not isinstance(choice, Choice):
        choice = resolve(choice, like=like)
    _check_like(choice.path, choice.meta, like)
    return jax.tree.unflatten(jax.tree.structure(like), choice.leaves)


def load_leaves(path: str | Path) -> dict[str, np.ndarray]:
    """Every saved array on the host keyed by its tree path (``.params['00_conv']['kernel']``,
    ...), from a checkpoint or run folder: for comparing runs whose structures differ."""
    choice = resolve(path)
    return dict(zip(choice.meta["tree_paths"], (np.asarray(x) for x in choice.leaves),
                    strict=True))  # fmt: skip


def abstract(tree: Any) -> Any:
    """``tree`` with each device array replaced by its shape, dtype and sharding (host
    arrays kept): a restore target that holds no memory."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(one, tree)
