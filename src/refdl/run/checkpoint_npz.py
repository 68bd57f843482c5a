"""Format-1 checkpoints (one ``state.npz``): still read; written only for tests of the reader.

A checkpoint is ``DIR/checkpoints/step_0000100/`` holding the full host
``TrainState`` (whatever strategy wrote it) as ``state.npz`` - one array per
leaf, in ``jax.tree.leaves`` order, read back without pickle - and
``meta.json``: the run's settings (``spec``), the step, each leaf's tree path,
shape, dtype and SHA-256 digest. It is written into a temporary folder, synced,
and renamed into place, so a folder named ``step_N`` is always complete;
temporaries left by a killed writer are removed when the next run starts.

Reading verifies first: the manifest parses (``read_meta``), every array is present
with its shape, dtype and digest (``read_leaves``). ``refdl.run.checkpoint`` resolves
and restores both formats; format 1 is read until refdl 1.0 and at least until
2027-06-01.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import tokenize
import zipfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from refdl.config.files import check_regular, load_json
from refdl.config.spec import RUN_CONTROL_KEYS, RunSpec
from refdl.core.state import TrainState

FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.step_\d+\.tmp-")
_DTYPE = re.compile(r"^[<>|=]?[biuf][1248]$|^[<>|=]?c(8|16)$")  # numeric arrays only
_SHA = re.compile(r"^[0-9a-f]{64}$")
MANIFEST_LIMIT = 256 << 20  # tree paths and digests of even very large models
STATE, META = "state.npz", "meta.json"


class Damaged(Exception):
    """A checkpoint that cannot be used; the message says what is wrong with it."""


def _paths(state: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is named as one checkpoint (``step_N``) rather than a run folder."""
    return _STEP_DIR.match(Path(path).name) is not None


def digest(a: np.ndarray) -> str:
    """SHA-256 of an array's bytes (C order), its dtype and shape."""
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(ckpt_dir: str | Path, state: TrainState, meta: dict[str, Any], keep: int = 3) -> Path:
    """Write the host ``state`` as ``ckpt_dir/step_N`` (N = its step) atomically; keep the
    newest ``keep``. Returns the checkpoint's path. An OSError (disk full, unwritable)
    propagates, leaving the earlier checkpoints as they were."""
    ckpt_dir = Path(ckpt_dir).absolute()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = int(np.asarray(state.step).reshape(-1)[0])  # replicated strategies stack it
    path = ckpt_dir / f"step_{step:07d}"
    if path.is_symlink():  # planted: never written through, never taken for a checkpoint
        path.unlink()
    if path.exists() and _same_run(path, meta):  # re-saving a step (final == periodic)
        return path
    leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
    tmp = Path(tempfile.mkdtemp(dir=ckpt_dir, prefix=f".step_{step:07d}.tmp-"))
    try:
        tmp.chmod(0o755)
        with open(tmp / STATE, "wb") as f:
            np.savez(f, **{f"leaf_{i:05d}": a for i, a in enumerate(leaves)})
            f.flush()
            os.fsync(f.fileno())
        manifest = {
            **meta,
            **({"config": config_key(meta["spec"])} if isinstance(meta.get("spec"), dict) else {}),
            "format": FORMAT,
            "step": step,
            "tree_paths": _paths(state),
            "leaves": [
                {"shape": list(a.shape), "dtype": a.dtype.str, "sha256": digest(a)} for a in leaves
            ],
        }
        with open(tmp / META, "w") as f:
            f.write(json.dumps(manifest))
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        if path.exists():  # another configuration's (or a damaged) step_N: replaced
            gone = Path(tempfile.mkdtemp(dir=ckpt_dir, prefix=f".step_{step:07d}.tmp-"))
            os.replace(path, gone / "old")
            shutil.rmtree(gone, ignore_errors=True)
        os.replace(tmp, path)
        _fsync(ckpt_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.filename is None:  # e.g. a full disk while writing the arrays
            e.filename = str(path)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in all_checkpoints(ckpt_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _same_run(path: Path, meta: dict[str, Any], read: Any = None) -> bool:
    """Whether the checkpoint at ``path`` is intact-looking and of ``meta``'s settings
    (its manifest read by ``read``: this format's ``read_meta`` unless given)."""
    try:
        saved = (read or read_meta)(path)
    except Damaged:
        return False
    spec = meta.get("spec")
    return not isinstance(spec, dict) or config_key(saved["spec"]) == config_key(spec)


def all_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The checkpoint folders under ``ckpt_dir`` (complete by construction), oldest first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def remove_temporaries(ckpt_dir: str | Path) -> list[Path]:
    """Delete the temporary folders a killed writer left; the ones removed."""
    d = Path(ckpt_dir)
    gone = [p for p in d.iterdir() if _TMP_DIR.match(p.name)] if d.is_dir() else []
    for p in gone:
        if p.is_symlink():  # never followed: only the link goes
            p.unlink()
        else:
            shutil.rmtree(p, ignore_errors=True)
    return gone


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _leaf_ok(e: Any) -> bool:
    """A manifest's leaf entry: a shape of small non-negative ints, a plain numeric dtype,
    a SHA-256 in hex."""
    if not isinstance(e, dict):
        return False
    shape, dtype, sha = e.get("shape"), e.get("dtype"), e.get("sha256")
    return (isinstance(shape, list) and len(shape) <= 32
            and all(_int(d, 0, 1 << 40) for d in shape)
            and isinstance(dtype, str) and _DTYPE.match(dtype) is not None
            and isinstance(sha, str) and _SHA.match(sha) is not None)  # fmt: skip


def read_meta(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, held to a strict schema (types and
    ranges; the step its folder's; the configuration key its settings'): ``Damaged``
    if it is not one."""
    return load_manifest(Path(path), META, FORMAT, _leaf_ok, "numeric dtype or SHA-256")


def load_manifest(path: Path, name: str, fmt: int, leaf_ok: Any, leaf_has: str) -> dict[str, Any]:
    """The manifest ``path/name`` of either format: bounded JSON; format ``fmt``; a step,
    settings, tree paths and one entry per leaf that ``leaf_ok`` accepts (``leaf_has``
    says what one holds); the step its folder's; the configuration key its settings'."""
    f = path / name
    if not os.path.lexists(f):
        raise Damaged(f"{name} is missing")
    try:
        meta = load_json(f, name, limit=MANIFEST_LIMIT, error=Damaged)
    except Damaged as e:
        raise Damaged(f"{name} is unreadable ({str(e).removeprefix(f'{name} {f}: ')})") from None
    ok = isinstance(meta, dict) and _int(meta.get("format"), fmt, fmt)
    ok = ok and _int(meta.get("step"), 0, 10**12) and isinstance(meta.get("spec"), dict)
    ok = ok and isinstance(meta.get("tree_paths"), list) and isinstance(meta.get("leaves"), list)
    ok = ok and len(meta["tree_paths"]) == len(meta["leaves"])
    if not ok:
        raise Damaged(f"{name} lacks the format, step, settings or leaves of a checkpoint")
    if not all(isinstance(t, str) for t in meta["tree_paths"]):
        raise Damaged(f"{name}: a tree path is not text")
    if not all(leaf_ok(e) for e in meta["leaves"]):
        raise Damaged(f"{name}: a leaf lacks a valid shape, {leaf_has}")
    m = _STEP_DIR.match(path.name)
    if m and int(m.group(1)) != meta["step"]:
        raise Damaged(f"{name} says step {meta['step']}, its folder {path.name}")
    if "config" in meta and meta["config"] != config_key(meta["spec"]):
        raise Damaged(f"{name}: its configuration key does not match its settings")
    return meta


def read_leaves(path: str | Path, meta: dict[str, Any]) -> list[np.ndarray]:
    """Every array of the checkpoint, each checked against its shape, dtype and digest."""
    out = []
    try:
        check_regular(Path(path) / STATE, STATE, 1 << 44, error=Damaged)
    except Damaged as e:
        raise Damaged(str(e).replace(f"{STATE} {Path(path) / STATE}:", f"{STATE}")) from None
    try:
        with np.load(Path(path) / STATE, allow_pickle=False) as z:
            for i, want in enumerate(meta["leaves"]):
                a = z[f"leaf_{i:05d}"]
                if list(a.shape) != want.get("shape") or a.dtype.str != want.get("dtype"):
                    raise Damaged(f"array {i} ({meta['tree_paths'][i]}) has the wrong shape")
                if digest(a) != want.get("sha256"):
                    raise Damaged(f"array {i} ({meta['tree_paths'][i]}) does not match its digest")
                out.append(a)
    except FileNotFoundError:
        raise Damaged(f"{STATE} is missing") from None
    except KeyError as e:
        raise Damaged(f"{STATE} lacks array {e}") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile,
            SyntaxError, tokenize.TokenError, TypeError, MemoryError) as e:  # fmt: skip
        # an array's .npy header is a Python literal: a changed byte there makes numpy's
        # parser raise SyntaxError or TokenError, a changed shape a huge allocation
        raise Damaged(f"{STATE} is unreadable ({type(e).__name__})") from None
    return out


def config_key(settings: dict[str, Any]) -> str:
    """A short hash of the settings that say how a run was started (not how long or how
    loudly it runs; fields at their defaults left out, so it survives new fields): two
    runs continue each other's checkpoints only when their keys are equal."""
    defaults = {f.name: f.default for f in dataclasses.fields(RunSpec)}
    kept = {k: _norm(v) for k, v in settings.items()
            if k not in RUN_CONTROL_KEYS and _norm(v) != _norm(defaults.get(k, ...))}  # fmt: skip
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _norm(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return [_norm(x) for x in v]
    return v


def differing(saved: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """The keys ``given`` sets that say how a run was started and differ from ``saved``."""
    out = []
    for key, value in given.items():
        if key in RUN_CONTROL_KEYS or key not in saved:
            continue
        if _norm(value) != _norm(saved[key]):
            out.append(key)
    return out
