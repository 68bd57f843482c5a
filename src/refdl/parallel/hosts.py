"""Where ranks run when they span hosts: the host list (``--hosts`` or a hostfile), the
launch agent that starts a command on a named host (ssh, or ``scripts/hosts.sh agent``
for the test hosts), and the ``mpirun`` command line that uses them.

A hostfile is data: one host a line, ``NAME`` or ``NAME slots=N`` (OpenMPI's form) or
``NAME:N``, ``#`` comments; nothing in it is executed, and it is never handed to mpirun
as it is (mpirun reads other keys from such files).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

from refdl.config.files import read_text
from refdl.errors import UsageError

_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$")  # a DNS name or address
MAX_SLOTS = 4096
HOSTFILE_LIMIT = 1 << 20
# What the ranks on other hosts need from this environment: mpirun passes the environment
# to the ranks on its own host only, and these by name (-x) to the others.
FORWARDED = ("PYTHONPATH", "GLIBC_TUNABLES", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL",
             "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")  # fmt: skip
FORWARDED_PREFIXES = ("REFDL_", "JAX_")


@dataclass(frozen=True)
class Host:
    """A host and the ranks it takes."""

    name: str
    slots: int


def _host(text: str, where: str) -> Host:
    name, _, slots = text.strip().partition(":")
    if not _NAME.match(name):
        raise UsageError(f"{where}: {name!r} is not a host name (letters, digits, '.', '-')")
    if slots == "":
        return Host(name, 1)
    if not slots.isdigit() or not 1 <= int(slots) <= MAX_SLOTS:
        raise UsageError(f"{where}: {text.strip()!r}: slots must be an integer in [1, {MAX_SLOTS}]")
    return Host(name, int(slots))


def parse_hosts(text: str) -> list[Host]:
    """``--hosts refdl-h1:2,refdl-h2:2`` (a host without ``:N`` takes one rank)."""
    hosts = [_host(part, "--hosts") for part in text.split(",") if part.strip()]
    if not hosts:
        raise UsageError("--hosts is empty; give NAME:RANKS,... (e.g. refdl-h1:2,refdl-h2:2)")
    return _merged(hosts, "--hosts")


def read_hostfile(path: str | Path) -> list[Host]:
    """The hosts of a hostfile (see the module's docstring)."""
    text = read_text(path, "--hostfile", HOSTFILE_LIMIT)
    hosts = []
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--hostfile {path}, line {i}"
        words = line.split()
        if len(words) == 1:
            hosts.append(_host(words[0], where))
        elif len(words) == 2 and words[1].startswith("slots="):
            hosts.append(_host(f"{words[0]}:{words[1].removeprefix('slots=')}", where))
        else:
            raise UsageError(f"{where}: expected 'NAME', 'NAME:N' or 'NAME slots=N', got {line!r}")
    if not hosts:
        raise UsageError(f"--hostfile {path} names no host")
    return _merged(hosts, f"--hostfile {path}")


def _merged(hosts: list[Host], where: str) -> list[Host]:
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UsageError(f"{where}: {', '.join(twice)} named twice; give each host once")
    return hosts


def agent_words(agent: str, cwd: Path) -> list[str]:
    """The launch agent's words, a word naming a file under ``cwd`` made absolute (mpirun
    runs the agent from other folders)."""
    try:
        words = shlex.split(agent)
    except ValueError as e:
        raise UsageError(f"--launch-agent {agent!r}: {e}") from None
    if not words:
        raise UsageError("--launch-agent is empty; give a command such as 'ssh'")
    return [str((cwd / w).resolve()) if "/" in w and (cwd / w).is_file() else w for w in words]


def is_here(hosts: list[Host]) -> bool:
    """Whether this machine is one of ``hosts`` (by its host name)."""
    here = {socket.gethostname(), socket.getfqdn(), "localhost"}
    return any(h.name in here for h in hosts)


def forwarded_env(env: dict[str, str]) -> list[str]:
    """mpirun's ``-x NAME`` for each variable the ranks on other hosts need."""
    names = [n for n in sorted(env) if n in FORWARDED or n.startswith(FORWARDED_PREFIXES)]
    return [a for n in names for a in ("-x", n)]


def mpirun_on_hosts(
    mpirun: list[str], hosts: list[Host], agent: list[str] | None, env: dict[str, str]
) -> list[str]:
    """``mpirun`` placing its ranks on ``hosts`` (in order, filling each host's slots),
    starting its daemons through ``agent`` (ssh when None). When this machine is not one
    of the hosts and an agent is given, mpirun itself is started on the first host through
    the agent (its daemons must reach it: the test hosts cannot reach this machine), with
    the forwarded variables set on its command line (ssh's shell has its own environment;
    a signal to the agent reaches mpirun only where the agent execs it, as hosts.sh's)."""
    exe, rest = mpirun[0], [a for a in mpirun[1:] if a != "--oversubscribe"]
    spec = ",".join(f"{h.name}:{h.slots}" for h in hosts)
    # by slot: the first host's ranks, then the next's (oversubscribing would put every
    # rank on the first host; the ranks never outnumber the slots, ``refdl.launch``)
    cmd = [exe, "--host", spec, "--map-by", "slot", *forwarded_env(env)]
    if agent:
        cmd += ["--mca", "plm_ssh_agent", shlex.join(agent)]
    cmd += rest
    if agent and not is_here(hosts):  # ssh starts a shell of its own: say the environment
        named = [f"{n}={env[n]}" for n in sorted(env)
                 if n in FORWARDED or n.startswith(FORWARDED_PREFIXES)]  # fmt: skip
        line = f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(['env', *named, *cmd])}"
        return [*agent, hosts[0].name, line]
    return cmd
