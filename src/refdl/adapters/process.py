"""refdl's side of a framework that runs in its own process: find its interpreter, hand it
a job folder (``refdl.adapters.exchange``), wait, read its result.

TensorFlow shares refdl's ``.venv`` (its pins do not clash with jax's or
torch's) but runs in a child process, so its runtime never meets JAX's; MXNet 1.9
needs numpy < 1.24 and lives in ``.venv-mxnet/`` (``scripts/setup.sh`` builds
both; ``REFDL_FRAMEWORKS=none`` skips them). The child sees refdl's ``src/`` on
its path and imports only the adapter's own modules and NumPy.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from refdl.adapters.exchange import Flat, read_result, write_job
from refdl.errors import UsageError
from refdl.progress import phase

ROOT = Path(__file__).resolve().parents[3]  # the repository (src/refdl/adapters/...)
SRC = ROOT / "src"
FRAMEWORKS = {
    "tensorflow": ("refdl.adapters.tensorflow", "tensorflow"),
    "mxnet": ("refdl.adapters.mxnet", "mxnet"),
}
SETUP_HINT = "run bash scripts/setup.sh (without REFDL_FRAMEWORKS=none)"


class FrameworkFailed(RuntimeError):
    """The framework's process failed or timed out (the message is one line)."""


def interpreter(framework: str) -> Path:
    """The Python that runs ``framework``: ``$REFDL_<NAME>_PYTHON``, else ``.venv-mxnet``'s
    for MXNet and this one for TensorFlow."""
    override = os.environ.get(f"REFDL_{framework.upper()}_PYTHON")
    if override:
        return Path(override)
    if framework == "mxnet":
        return ROOT / ".venv-mxnet" / "bin" / "python"
    return Path(sys.executable)


def missing(framework: str) -> str | None:
    """Why ``framework`` cannot run here (one line), or None when it can."""
    python = interpreter(framework)
    if not python.exists():
        return f"{framework} needs {python}, which is not there; {SETUP_HINT}"
    module = FRAMEWORKS[framework][1]
    probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"{framework} does not import in {python} ({last}); {SETUP_HINT}"
    return None


def require(framework: str) -> None:
    """A one-line UsageError when ``framework`` cannot run here."""
    if framework not in FRAMEWORKS:
        raise UsageError(f"unknown framework {framework!r}; choose {', '.join(FRAMEWORKS)}")
    if reason := missing(framework):
        raise UsageError(reason)


HEARTBEAT_S = 30.0  # a line this often while a framework's process runs


def _wait(proc: subprocess.Popen, framework: str, timeout: float) -> int:
    """``proc``'s exit status, saying every ``HEARTBEAT_S`` that it still runs (its
    output goes to a log file, so nothing else would be seen for minutes)."""
    t0 = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        try:
            return proc.wait(timeout=min(HEARTBEAT_S, left))
        except subprocess.TimeoutExpired:
            if time.monotonic() - t0 < timeout:
                phase(f"refdl: {framework} still running ({time.monotonic() - t0:.0f} s)")


def run(
    framework: str, job: dict[str, Any], params: Flat, batches: list[dict], timeout: float
) -> tuple[dict[str, Any], Flat, Flat]:
    """Run ``job`` in ``framework``'s process; ``(result, final params, first-update
    params)``. The job folder is removed afterwards unless ``$REFDL_KEEP_JOBS`` is set."""
    folder = Path(tempfile.mkdtemp(prefix=f"refdl-{framework}-"))
    try:
        write_job(folder, {**job, "framework": framework, "timeout": timeout}, params, batches)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get(
            "PYTHONPATH", "")]).rstrip(os.pathsep), "TF_CPP_MIN_LOG_LEVEL": "2"}  # fmt: skip
        cmd = [str(interpreter(framework)), "-m", FRAMEWORKS[framework][0], str(folder)]
        log = folder / "main.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                rc = _wait(proc, framework, timeout + 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                late = f"{framework} did not finish within {timeout:.0f} s"
                raise FrameworkFailed(late) from None
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        if rc != 0:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            last = lines[-1] if lines else "(no output)"
            raise FrameworkFailed(f"{framework} exited {rc}: {last}")
        return read_result(folder)
    finally:
        if not os.environ.get("REFDL_KEEP_JOBS"):
            shutil.rmtree(folder, ignore_errors=True)
