"""Format-1 checkpoints (one ``state.npz``, written before orbax) still resume, verified as
before: every kind of damage makes a checkpoint skipped (with the reason) in favour of the
newest intact one, or a one-line error; never a traceback and never a wrong state."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refdl.config.spec import RunSpec
from refdl.core.state import to_host
from refdl.errors import UsageError
from refdl.run import checkpoint, checkpoint_npz
from refdl.run.build import build


@pytest.fixture(scope="module")
def states():
    run = build(RunSpec(model="mlp", optimizer="momentum", progress=False))
    s0 = to_host(run.task.init_state(0))
    return s0, s0.replace(step=np.asarray(5, np.int32))


def saved(tmp: Path, states) -> tuple[Path, Path]:
    old = checkpoint_npz.save(tmp, states[0], {"spec": {"model": "mlp"}})
    new = checkpoint_npz.save(tmp, states[1], {"spec": {"model": "mlp"}})
    return old, new


def flip_a_byte_of_array_data(p: Path) -> None:
    z = p / checkpoint_npz.STATE
    raw = bytearray(z.read_bytes())
    with zipfile.ZipFile(z) as zf:  # a byte inside the first array's data, not the header
        info = zf.getinfo("leaf_00001.npy")
    offset = info.header_offset + 30 + len(info.filename) + 200
    raw[offset] ^= 0x10
    z.write_bytes(bytes(raw))


def drop_an_array(p: Path) -> None:
    z = p / checkpoint_npz.STATE
    with np.load(z) as arrays:
        kept = {k: arrays[k] for k in arrays.files if k != "leaf_00002"}
    np.savez(z, **kept)


DAMAGE = {
    "manifest truncated": lambda p: (p / "meta.json").write_text(
        (p / "meta.json").read_text()[:40]
    ),
    "manifest deleted": lambda p: (p / "meta.json").unlink(),
    "manifest without settings": lambda p: (p / "meta.json").write_text(json.dumps({"step": 5})),
    "manifest of another format": lambda p: (p / "meta.json").write_text(
        (p / "meta.json").read_text().replace('"format": 1', '"format": 99')
    ),
    "manifest not text": lambda p: (p / "meta.json").write_bytes(b"\xff\xfe\x00junk"),
    "arrays deleted": lambda p: (p / "state.npz").unlink(),
    "arrays truncated": lambda p: (p / "state.npz").write_bytes(
        (p / "state.npz").read_bytes()[:100]
    ),
    "arrays zeroed": lambda p: (p / "state.npz").write_bytes(
        bytes(len((p / "state.npz").read_bytes()))
    ),
    "a byte flipped in an array": flip_a_byte_of_array_data,
    "an array missing": drop_an_array,
    "arrays replaced by a pickle": lambda p: np.savez(
        p / "state.npz", leaf_00000=np.array([{"x": 1}], dtype=object)
    ),
    "the folder emptied": lambda p: [f.unlink() for f in p.iterdir()],
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_skips_to_the_older_intact_checkpoint(tmp_path, states, kind):
    old, new = saved(tmp_path, states)
    DAMAGE[kind](new)
    choice = checkpoint.resolve(tmp_path)
    assert choice.path == old
    assert [name for name, _ in choice.skipped] == [new.name]
    assert "resuming from" in choice.report() and new.name in choice.report()
    back = checkpoint.restore(choice, states[0])
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_of_the_only_checkpoint_is_one_line(tmp_path, states, kind):
    path = checkpoint_npz.save(tmp_path, states[0], {"spec": {}})
    DAMAGE[kind](path)
    with pytest.raises(UsageError, match="no intact checkpoint") as err:
        checkpoint.resolve(tmp_path)
    assert "\n" not in str(err.value) and path.name in str(err.value)


def test_a_killed_writers_temporary_is_removed_and_never_chosen(tmp_path, states):
    path = checkpoint_npz.save(tmp_path, states[0], {"spec": {}})
    tmp = tmp_path / ".step_0000009.tmp-12345"
    shutil.copytree(path, tmp)
    assert checkpoint.resolve(tmp_path).path == path
    assert checkpoint.remove_temporaries(tmp_path) == [tmp] and not tmp.exists()


def test_a_changed_byte_in_an_array_header_is_damage_not_a_syntax_error(tmp_path, states):
    # found by the property below: numpy parses a .npy header as a Python literal, so one
    # byte turned into "{" raised tokenize.TokenError out of read_leaves
    path = checkpoint_npz.save(tmp_path, states[1], {"spec": {}})
    f = path / "state.npz"
    raw = f.read_bytes()
    # the 64 x 256 kernel: numpy parses its header before the zip's CRC is checked (a small
    # array is read whole first, and its CRC fails: BadZipFile)
    assert raw.count(b"False, 'shape': (64, 256)") == 2  # the kernel and its momentum
    f.write_bytes(raw.replace(b"False, 'shape': (64, 256)", b"False,{'shape': (64, 256)", 1))
    with pytest.raises(checkpoint.Damaged, match=r"state\.npz is unreadable \(TokenError\)"):
        checkpoint_npz.read_leaves(path, checkpoint_npz.read_meta(path))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(which=st.sampled_from(["meta.json", "state.npz"]), data=st.data())
def test_any_corruption_is_either_harmless_or_detected(tmp_path_factory, states, which, data):
    """Random truncations and byte changes of either file: the checkpoint either still
    verifies with exactly the saved arrays, or is reported damaged - nothing else."""
    tmp = tmp_path_factory.mktemp("ck")
    path = checkpoint_npz.save(tmp, states[1], {"spec": {}})
    f = path / which
    raw = bytearray(f.read_bytes())
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="length")]
    else:
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            i = data.draw(st.integers(0, len(raw) - 1), label="offset")
            raw[i] ^= data.draw(st.integers(1, 255), label="mask")
    f.write_bytes(bytes(raw))
    try:
        meta = checkpoint_npz.read_meta(path)
        leaves = checkpoint_npz.read_leaves(path, meta)
    except checkpoint.Damaged as e:
        assert str(e) and "\n" not in str(e)
        return
    for a, b in zip(jax.tree.leaves(states[1]), leaves, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # 23 s on 2 cores (2026-11-27): the default suite is near its 15 minutes
def test_a_run_whose_checkpoint_is_format_1_resumes_exactly_and_quietly(tmp_path):
    """Format 1 stays readable until refdl 1.0 (at least until 2027-06-01): a run whose only
    checkpoint is a ``state.npz`` continues to where an uninterrupted run ends, bit for bit,
    and orbax's manager, meeting the old step folder, prints nothing (it warned "Metadata
    file does not exist" until 2026-11-27)."""
    from conftest import run_cli

    common = ("--model", "mlp", "--eval-every", "0", "--no-progress")
    run, ref = tmp_path / "run", tmp_path / "ref"
    first = run_cli(*common, "--steps", "4", "--checkpoint-every", "4", "--out", str(run))
    assert first.returncode == 0, first.stderr[-2000:]
    choice = checkpoint.resolve(run)  # orbax's step 4, on the host
    spec = RunSpec.from_dict(choice.meta["spec"])
    like = to_host(build(spec).task.init_state(0))
    state = jax.tree.unflatten(jax.tree.structure(like), [np.asarray(x) for x in choice.leaves])
    shutil.rmtree(choice.path)
    old = checkpoint_npz.save(run / "checkpoints", state, {"spec": choice.meta["spec"]})
    assert (old / "state.npz").exists()
    again = run_cli("--resume", str(run), "--steps", "8", "--no-progress")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Metadata file" not in again.stderr, again.stderr[-2000:]
    assert [ln for ln in again.stderr.splitlines() if ln.strip()] == [
        f"refdl: resuming from {old}"
    ], again.stderr[-2000:]
    whole = run_cli(*common, "--steps", "8", "--out", str(ref))
    assert whole.returncode == 0, whole.stderr[-2000:]
    got, want = checkpoint.load_leaves(run), checkpoint.load_leaves(ref)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
