"""``keep_freed_memory``: a freed 64 MiB buffer is reused, not page-faulted in again.

Each case runs in a fresh interpreter: the setting is process-wide, and GLIBC_TUNABLES
(which makes it stand down) is read by glibc only at start.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import numpy as np
from refdl.parallel.processes import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "apply" else False

def faults_of_one_pass():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(64 << 18, np.float32)  # 64 MiB, written, freed
    del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_one_pass()
print(applied, faults_of_one_pass())
"""


def _probe(mode: str, **env: str) -> tuple[bool, int]:
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**base, **env},
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_reuses_a_freed_buffer_instead_of_faulting_it_in_again():
    applied, faults_kept = _probe("apply")
    assert applied
    _, faults_default = _probe("leave")
    # Above glibc's 32 MiB mmap ceiling a buffer is returned to the kernel on free and
    # faulted in again: at least one fault per 2 MiB page even with transparent huge pages.
    assert faults_default >= 32
    assert faults_kept <= 8
    # Set by the user (or mpirun_env): theirs stands.
    applied, _ = _probe("apply", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1")
    assert not applied
