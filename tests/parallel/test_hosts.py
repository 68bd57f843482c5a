"""Runs across hosts: the test hosts of ``scripts/hosts.sh`` (network namespaces on this
machine), ``refdl launch --hosts``, a lost host, and the host lists launch reads.

Every synchronous strategy that runs under mpirun runs across 2 hosts x 2 ranks and ends
where ``single`` does (fp32, rtol 1e-5, atol 1e-6: the same programs as one host);
``decentralized`` ends where its one-device oracle does. A host whose processes are
killed ends every other rank in well under a second, with one line naming it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import ROOT
from refdl.config.spec import RunSpec
from refdl.errors import UsageError
from refdl.parallel import liveness
from refdl.parallel.hosts import Host, mpirun_on_hosts, parse_hosts, read_hostfile
from refdl.parallel.processes import expand_nodelist
from refdl.run.checkpoint import load_leaves
from refdl.run.loop import fit

AGENT = "bash scripts/hosts.sh agent"
HOSTS = "refdl-h1:2,refdl-h2:2"
SHORT = ("--model", "mlp", "--steps", "8", "--eval-every", "0")
TOL = dict(rtol=1e-5, atol=1e-6)


# Open MPI's launcher (prterun 5.0) on the test hosts once, in CI on 2026-11-25, failed
# before starting any rank: "The PMIx server's listener thread failed to start", exit 213
# (13 local runs, some under load, and stale session folders made on purpose did not
# repeat it). Nothing of refdl ran, so such a start is tried once more, with a warning;
# any other failure, or a second one, fails the test.
PMIX_START_FAILED = "PMIx server's listener thread failed to start"


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``refdl launch ARGS`` from the repository root (bounded)."""
    cmd = [sys.executable, "-m", "refdl", "launch", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 213 and PMIX_START_FAILED in proc.stderr:
        warnings.warn(f"mpirun did not start (PMIx), tried again: {args}", stacklevel=2)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc


def train(out: Path, *args: str) -> subprocess.CompletedProcess:
    """``refdl train ARGS --out OUT`` in one process."""
    return subprocess.run([sys.executable, "-m", "refdl.train", *args, "--out", str(out),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def across_hosts(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``refdl launch --hosts refdl-h1:2,refdl-h2:2 --launch-agent ... train ARGS``."""
    return launch("--hosts", HOSTS, "--launch-agent", AGENT, "train", *args, "--out", str(out),
                  "--no-progress", "--timeout", "60", timeout=timeout)  # fmt: skip


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def params(out: Path) -> dict[str, np.ndarray]:
    return {k: v for k, v in load_leaves(out).items() if k.startswith(".params")}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **TOL)


# ----- host lists and the command line, no hosts needed ---------------------------------


def test_host_lists_parse_and_refuse_with_one_line(tmp_path):
    assert parse_hosts("refdl-h1:2,refdl-h2") == [Host("refdl-h1", 2), Host("refdl-h2", 1)]
    f = tmp_path / "hostfile"
    f.write_text("# two nodes\nnode1 slots=4\nnode2:2   # the second\n\n")
    assert read_hostfile(f) == [Host("node1", 4), Host("node2", 2)]
    for bad, why in (("a:0", "slots"), ("a:2,a:2", "named twice"), ("-x:2", "not a host"),
                     ("a;rm -rf /:2", "not a host"), (",", "empty")):  # fmt: skip
        with pytest.raises(UsageError, match=why):
            parse_hosts(bad)
    f.write_text("node1 slots=2 max_slots=4\n")
    with pytest.raises(UsageError, match="line 1"):
        read_hostfile(f)
    assert expand_nodelist("refdl-h[1-2],login,n[008-010,12]") == [
        "refdl-h1", "refdl-h2", "login", "n008", "n009", "n010", "n12"]  # fmt: skip


def test_mpirun_runs_on_the_first_host_when_this_machine_is_not_one():
    hosts = [Host("refdl-h1", 2), Host("refdl-h2", 2)]
    agent, env = ["bash", "/x/hosts.sh", "agent"], {"PYTHONPATH": "p", "HOME": "h"}
    cmd = mpirun_on_hosts(["mpirun", "--oversubscribe", "-n", "4", "python"], hosts, agent, env)
    assert cmd[:4] == ["bash", "/x/hosts.sh", "agent", "refdl-h1"]  # mpirun itself goes there
    line = cmd[4]
    assert "--host refdl-h1:2,refdl-h2:2 --map-by slot -x PYTHONPATH" in line
    assert "--oversubscribe" not in line and "HOME" not in line  # every rank on h1 else
    assert "plm_ssh_agent 'bash /x/hosts.sh agent'" in line


@pytest.mark.parametrize(
    "args, says",
    [
        (["--launch-agent", "ssh", "train"], "--launch-agent needs --hosts"),
        (["-n", "5", "--hosts", "a:2,b:2", "train"], "more ranks than the hosts take"),
        (["train"], "give -n RANKS"),
        (["--hosts", "a:x", "train"], "slots must be"),
        (["--elastic", "-n", "2", "train"], "--elastic runs train across --hosts"),
        (["--elastic", "--hosts", "a:2", "validate"], "--elastic runs train across --hosts"),
        (["--elastic", "--hosts", "a:2,b:2", "-n", "2", "train"], "takes every slot"),
        (["--elastic", "--hosts", "a:2", "--min-hosts", "2", "train"], "--min-hosts must be"),
        (["--elastic", "--hosts", "a:2", "train", "--resume", "runs/x"], "--elastic starts a run"),
        (["--hosts", "a:2", "--min-hosts", "1", "train"], "--min-hosts is an option of --elastic"),
        (["--hosts", "a:2", "--no-rejoin", "train"], "--no-rejoin is an option of --elastic"),
        (["--elastic", "--hosts", "a:2", "train", "--strategy", "ps"], "cannot be resharded"),
        (
            ["--elastic", "--hosts", "a:2", "train", "--strategy", "decentralized"],
            "cannot be resharded",
        ),
    ],
)
def test_launch_refuses_bad_hosts_with_one_line(args, says):
    proc = launch(*args, timeout=60)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_an_elastic_run_names_its_folder_and_saves_every_step_unless_told():
    from refdl.elastic import prepare

    args, out = prepare(["--strategy", "data"])
    assert args[:2] == ["--strategy", "data"] and str(out).startswith("runs/elastic-")
    assert args[args.index("--out") + 1] == str(out) and "--checkpoint-every" in args
    assert args[args.index("--checkpoint-every") + 1] == "1"
    given = ["--out", "runs/e", "--checkpoint-every=5"]
    assert prepare(given) == (given, Path("runs/e"))


# ----- two hosts x two ranks -----------------------------------------------------------


@pytest.fixture(scope="module")
def single_8(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    ok(train(out, "--strategy", "single", *SHORT))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize(
    "args",
    [
        # slow: the default suite's 15 minutes on 2 cores (14 min 4 s, 2026-11-26); data
        # since 2026-11-27 (the elastic and killed-host tests compare data across hosts to
        # single in the default run)
        pytest.param(("--strategy", "data"), marks=pytest.mark.slow),
        pytest.param(("--strategy", "hybrid", "--mesh", "data=2,model=2"), marks=pytest.mark.slow),
        pytest.param(("--strategy", "fsdp", "--zero", "3"), marks=pytest.mark.slow),
        pytest.param(("--strategy", "model"), marks=pytest.mark.slow),
    ],
    ids=["data", "hybrid-d2m2", "fsdp-zero3", "model"],
)
def test_two_hosts_equal_single(tmp_path, test_hosts, single_8, args):
    out = tmp_path / "run"
    ok(across_hosts(out, *args, "--devices", "4", *SHORT))
    assert_same(params(out), params(single_8))
    s = json.loads((out / "summary.json").read_text())
    assert s["hosts"] == {"refdl-h1": [0, 1], "refdl-h2": [2, 3]}, s["hosts"]


@pytest.mark.mpi
@pytest.mark.slow  # 17 s; the default run keeps data across hosts and the killed host
def test_two_hosts_ps_sync_equals_single(tmp_path, test_hosts):
    """1 server and 3 workers over two hosts (batch 96 splits over 3)."""
    ref, out = tmp_path / "single", tmp_path / "ps"
    ok(train(ref, "--strategy", "single", *SHORT, "--batch-size", "96"))
    ok(across_hosts(out, "--strategy", "ps", "--ps-mode", "sync", *SHORT, "--batch-size", "96"))
    assert_same(params(out), params(ref))
    assert json.loads((out / "summary.json").read_text())["hosts"]["refdl-h2"] == [2, 3]


@pytest.mark.mpi
@pytest.mark.slow  # 17 s; the default run keeps data across hosts and the killed host
def test_two_hosts_decentralized_equals_its_oracle(tmp_path, test_hosts):
    oracle, out = tmp_path / "oracle", tmp_path / "ranks"
    args = ("--strategy", "decentralized", "--topology", "ring", *SHORT)
    ok(train(oracle, *args, "--simulate", "--workers", "4"))
    ok(across_hosts(out, *args))
    assert_same(params(out), params(oracle))


@pytest.mark.mpi
@pytest.mark.slow
def test_a_two_host_hybrid_checkpoint_resumes_resharded_in_one_process(tmp_path, test_hosts):
    """hybrid data=2 x model=2 across the hosts for 20 steps (Adam), then ``--reshard`` as
    ``single`` for 20 more: one device's 40 steps (rtol 1e-5, atol 5e-5: Adam's fp32
    noise, tests/run/test_reshard.py)."""
    adam = ("--model", "mlp", "--optimizer", "adam", "--lr", "0.003", "--eval-every", "0")
    run, ref = tmp_path / "hybrid", tmp_path / "single"
    ok(across_hosts(run, "--strategy", "hybrid", "--mesh", "data=2,model=2", *adam,
                    "--steps", "20"))  # fmt: skip
    ok(train(run, "--resume", str(run), "--reshard", "--strategy", "single", "--steps", "40"))
    ok(train(ref, "--strategy", "single", *adam, "--steps", "40"))
    got, want = params(run), params(ref)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=5e-5, err_msg=k)


# ----- a lost host ----------------------------------------------------------------------


def lose_a_host(tmp_path: Path, how: str, timeout: float = 20) -> tuple[Any, Path, float]:
    """Start a long run across the hosts, wait for its second checkpoint, then take
    refdl-h2 away (``kill``: SIGKILL to every process on it; ``cut``: its link down);
    returns the launcher, the run folder and when the host went."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "refdl", "launch", "--hosts", HOSTS, "--launch-agent", AGENT,
           "train", "--strategy", "data", "--devices", "4", "--model", "mlp", "--steps",
           "100000", "--checkpoint-every", "20", "--eval-every", "0", "--log-every", "20",
           "--out", str(out), "--no-progress", "--timeout", str(timeout)]  # fmt: skip
    for attempt in (1, 2):
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        deadline = time.monotonic() + 240
        while len(list((out / "checkpoints").glob("step_*"))) < 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "no second checkpoint in 240 s"
            time.sleep(0.2)
        if proc.poll() is None:
            break
        said = proc.communicate()
        if attempt == 1 and proc.returncode == 213 and PMIX_START_FAILED in said[1]:
            warnings.warn("mpirun did not start (PMIx), tried again", stacklevel=2)
            continue
        raise AssertionError(f"the run ended before the host went: {proc.returncode} {said}")
    subprocess.run(["bash", "scripts/hosts.sh", how, "refdl-h2"], cwd=ROOT, check=True)
    return proc, out, time.monotonic()


def check_lost(proc: subprocess.Popen, out: Path, gone: float, bound: float) -> float:
    """Every rank ended (the launcher returned 3) within ``bound`` s of the loss, saying
    which host and which checkpoint; summary.json says failed; the checkpoint resumes."""
    try:
        said_out, err = proc.communicate(timeout=bound + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    took = time.monotonic() - gone
    summary = out / "summary.json"
    # all there is to read when it fails (it did, 2 of ~10 CI runs: exit 0, no stderr)
    seen = (f"after {took:.2f} s; stderr: {err[-2000:]!r}; stdout: {said_out[-1500:]!r}; "
            f"summary: {summary.read_text()[:1500] if summary.exists() else None}")  # fmt: skip
    assert proc.returncode == 3, seen
    said = "refdl.launch: error:"
    line = [ln[ln.index(said) :] for ln in err.splitlines() if said in ln]
    assert line and "ranks 2, 3 on refdl-h2 were lost" in line[0], err[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "failed" and "refdl-h2" in s["reason"], s
    assert s["last_checkpoint"] and s["last_checkpoint"] in line[0]
    assert Path(s["last_checkpoint"]).is_dir()
    assert took < bound, took
    return took


@pytest.mark.mpi
# In 3 of about 12 fresh-clone CI runs (2026-11-25/26), and about 1 in 3 here (2026-11-27),
# rank 0 ended before its record. Two causes, both closed (docs/distributed.md, "A lost
# host"): JAX's distributed service ended every process once a task died (its recoverable
# mode, processes.init_spmd), and Open MPI ended a rank in an MPI call when a peer's
# connection reset (its fault tolerance, processes.FAULT_TOLERANCE; the test below). In
# the default suite again since 2026-11-27 (about 45 s).
def test_a_killed_host_ends_every_rank_and_the_rest_carry_on(tmp_path, test_hosts):
    """SIGKILL to every process on refdl-h2: the connections reset, every rank on
    refdl-h1 ends with exit status 3 (measured: 0.35 s, 2026-11-25). The run then goes on
    on the host that remains (--reshard, 2 ranks) and ends where one device does."""
    proc, out, gone = lose_a_host(tmp_path, "kill")
    check_lost(proc, out, gone, bound=10)
    ckpt = json.loads((out / "summary.json").read_text())["last_checkpoint"]
    steps = int(Path(ckpt).name.removeprefix("step_")) + 10
    resumed = launch("--hosts", "refdl-h1:2", "--launch-agent", AGENT, "train", "--resume",
                     str(out), "--reshard", "--strategy", "data", "--steps", str(steps),
                     "--no-progress")  # fmt: skip
    # (once in 31 runs here, 2026-11-27, with other tests beside it, the resumed ranks
    # could not bind refdl-h1's address: what the hosts looked like then is kept)
    seen = subprocess.run("ip netns list; ip -n refdl-h1 -br addr; ip -n refdl-net -br link",
                          shell=True, capture_output=True, text=True).stdout  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:] + "\nhosts:\n" + seen
    ref = tmp_path / "single"
    fit(RunSpec(strategy="single", model="mlp", steps=steps, eval_every=0, out=str(ref),
                progress=False))  # in-process  # fmt: skip
    assert_same(params(out), params(ref))
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "completed" and s["hosts"] == {"refdl-h1": [0, 1]}


# Rank 0 loops on processes.agree (the MPI allreduce the loop makes every step) while
# the other host's processes are killed; it leaves what happened to it in FOLDER.
IN_AN_MPI_CALL = """
import os, sys, time
from refdl.parallel import processes
folder, n = sys.argv[1], 0
try:
    while True:
        processes.agree(False)
        n += 1
        if n == 200 and processes.comm().Get_rank() == 0:
            open(os.path.join(folder, "ready"), "w").close()
except Exception as e:
    if processes.comm().Get_rank() == 0:
        open(os.path.join(folder, "raised"), "w").write(repr(e))
    os._exit(5)
"""


@pytest.mark.mpi
def test_a_rank_in_an_mpi_call_when_a_host_dies_gets_an_error_not_an_exit(tmp_path, test_hosts):
    """Issue 53's race, found on 2026-11-27 by tracing a failing killed-host run (ftrace:
    rank 0's main thread called exit_group(14) as the monitor saw the loss): Open MPI ends
    a rank whose peer's connection resets during an MPI call ("An error occurred in
    Socket closed ... MPI_ERRORS_ARE_FATAL"), before its heartbeats can say which host
    was lost. With Open MPI's fault tolerance (processes.FAULT_TOLERANCE) the call
    raises MPI_ERR_PROC_FAILED instead; without it this test ends with no 'raised'."""
    script = tmp_path / "agree_loop.py"
    script.write_text(IN_AN_MPI_CALL)
    from refdl.parallel import processes

    env = processes.mpirun_env()
    two = [Host("refdl-h1", 1), Host("refdl-h2", 1)]
    cmd = mpirun_on_hosts(processes.mpirun_command(2, [str(script), str(tmp_path)]), two,
                          AGENT.split(), env)  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "rank 0 made no 200 allreduces in 120 s"
            time.sleep(0.1)
        subprocess.run(["bash", "scripts/hosts.sh", "kill", "refdl-h2"], cwd=ROOT, check=True)
        deadline = time.monotonic() + 20
        while not (tmp_path / "raised").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=60)
    raised = (tmp_path / "raised").read_text() if (tmp_path / "raised").exists() else None
    assert raised is not None and "Exception" in raised, err[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
def test_a_cut_host_ends_every_rank_within_the_timeout(tmp_path, test_hosts):
    """refdl-h2's link down: nothing resets, so its silence tells (half of --timeout 20);
    the launcher then gives mpirun, waiting for a daemon it cannot reach, 5 s, and its
    ranks 5 more."""
    proc, out, gone = lose_a_host(tmp_path, "cut")
    try:
        took = check_lost(proc, out, gone, bound=30)
        assert took > 9  # silence is the only sign: not sooner than lost_after (10 s)
    finally:
        subprocess.run(["bash", "scripts/hosts.sh", "mend", "refdl-h2"], cwd=ROOT)


# ----- Slurm ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(test_hosts):
    """Slurm on the test hosts (``scripts/slurm_hosts.sh up 2``: slurmctld and munged on
    refdl-h1, slurmd on both; Debian's packages installed if missing); stopped after."""
    script = ["bash", "scripts/slurm_hosts.sh"]
    subprocess.run([*script, "down"], cwd=ROOT, capture_output=True)
    made = subprocess.run([*script, "up", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot bring Slurm up here: {made.stderr.strip()[-400:]}")
    yield
    subprocess.run([*script, "down"], cwd=ROOT, capture_output=True)


def on_h1(*words: str, timeout: float = 300, env: dict | None = None):
    """A command on refdl-h1 (where srun and sbatch find the test cluster)."""
    line = " ".join(f"{k}={v}" for k, v in (env or {}).items()) + " " + " ".join(words)
    return subprocess.run(["bash", "scripts/hosts.sh", "agent", "refdl-h1", line], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.mpi
@pytest.mark.slow
def test_srun_two_nodes_equals_single(tmp_path, slurm, single_8):
    """srun -N 2 --ntasks-per-node 2: jax.distributed from Slurm's environment (the step's
    first node, a port from the job and step ids), MPI through srun's PMIx plugin."""
    out = tmp_path / "srun"
    train_cmd = (sys.executable, "-m", "refdl.train", "--strategy", "data", "--devices", "4")
    ok(on_h1("srun", "-N", "2", "--ntasks-per-node", "2", *train_cmd, *SHORT, "--out", str(out),
             "--no-progress"))  # fmt: skip
    assert_same(params(out), params(single_8))
    assert json.loads((out / "summary.json").read_text())["hosts"] == {
        "refdl-h1": [0, 1], "refdl-h2": [2, 3]}  # fmt: skip


@pytest.mark.mpi
@pytest.mark.slow
def test_sbatch_example_trains(tmp_path, slurm):
    log = tmp_path / "slurm.out"
    proc = on_h1("sbatch", "--wait", f"--output={log}", "examples/slurm/train.sbatch",
                 env={"REFDL_STEPS": "8"})  # fmt: skip
    ok(proc)
    job = proc.stdout.split()[-1]
    run = ROOT / "runs" / f"slurm-{job}"
    try:
        s = json.loads((run / "summary.json").read_text())
        assert s["status"] == "completed" and s["steps"] == 8 and len(s["hosts"]) == 2
    finally:
        shutil.rmtree(run, ignore_errors=True)


@pytest.mark.mpi
@pytest.mark.slow
def test_a_partial_slurm_environment_is_one_line_on_every_task(tmp_path, slurm):
    """jax-ml/jax#30073: a task without SLURM_NTASKS is refused, not run alone."""
    out = tmp_path / "partial"
    proc = on_h1("srun", "-N", "2", "--ntasks-per-node", "1", "env", "-u", "SLURM_NTASKS",
                 sys.executable, "-m", "refdl.train", "--strategy", "data", *SHORT,
                 "--out", str(out))  # fmt: skip
    assert proc.returncode == 2
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("refdl.train: error:")]
    assert len(said) == 2 and all("SLURM_NTASKS missing" in ln for ln in said), proc.stderr
    assert not out.exists()


RANK0_SAYS = """
from refdl.parallel import liveness, processes
if processes.launched_rank() == 0:
    for word in WORDS:
        liveness.mark_for_launcher(word)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("words, status", [(("started",), 3), (("started", "ended"), 0), ((), 0)])
def test_the_launcher_does_not_take_mpiruns_0_for_a_run_that_never_ended(words, status):
    """mpirun exits 0 when it loses a host's daemon, and may end rank 0 before it leaves a
    record: a rank 0 that started its heartbeats and never ended its run is a failure (exit
    3, one line), not a success; a program without heartbeats is taken at its word."""
    code = RANK0_SAYS.replace("WORDS", repr(words))
    run = ("import sys; from refdl.parallel.processes import launch; "
           f"sys.exit(launch(2, ['-c', {code!r}]))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == status, proc.stderr[-2000:]
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("refdl.launch: error:")]
    assert len(said) == (status == 3), proc.stderr[-2000:]
    assert not said or "before rank 0's run ended" in said[0]


def test_the_launcher_reads_rank_0s_record_then_its_early_word_then_the_others(
    tmp_path, monkeypatch
):
    """A lost host's daemon makes mpirun end rank 0 while it gathers who else went: its
    early word (record.0) must still outrank another rank's view (record.2), and the full
    record outrank both; the first write of each wins."""
    record = tmp_path / "record"
    monkeypatch.setenv(liveness.RECORD_VAR, str(record))
    assert liveness.read_record(record) is None
    liveness.record_for_launcher("rank 0 was lost (silent)", rank=12)
    liveness.record_for_launcher("rank 0 was lost (silent)", rank=2)
    assert liveness.read_record(record) == "rank 0 was lost (silent)"
    liveness.record_for_launcher("rank 2 on refdl-h2 was lost", early=True)
    liveness.record_for_launcher("rank 3 on refdl-h2 was lost", early=True)  # not written
    assert liveness.read_record(record) == "rank 2 on refdl-h2 was lost"
    liveness.record_for_launcher("ranks 2, 3 on refdl-h2 were lost")
    assert liveness.read_record(record) == "ranks 2, 3 on refdl-h2 were lost"


# ----- an elastic run -------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.slow  # 75 s on 2 cores; slow since 2026-11-27, when the default run took 15:25
@pytest.mark.parametrize("strategy", ["data", "fsdp", "hybrid"])
def test_an_elastic_run_carries_on_on_the_host_that_remains(tmp_path, test_hosts, strategy):
    """Issue 53's acceptance: ``refdl launch --elastic`` across both hosts, refdl-h2 killed
    (SIGKILL to all its processes) once step 20 is checkpointed. The launcher restarts the
    run on refdl-h1 from the newest checkpoint, resharded to 2 ranks with the same global
    batch, exits 0, ends where 60 uninterrupted steps of single end (fp32: rtol 1e-5,
    atol 1e-6) and lists the restart in the summary. ``fsdp``: its ZeRO-3 shards of 4
    ranks restored onto 2."""
    out = tmp_path / "e"
    # --no-rejoin: refdl-h2 answers again at once (only its processes were killed)
    cmd = [sys.executable, "-m", "refdl", "launch", "--elastic", "--no-rejoin", "--hosts",
           HOSTS, "--launch-agent", AGENT, "train", "--strategy", strategy, "--devices", "4",
           "--steps", "60", "--out", str(out), "--no-progress", "--timeout", "30"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "step_0000020").is_dir():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint of step 20 in 240 s"
            time.sleep(0.02)
        subprocess.run(["bash", "scripts/hosts.sh", "kill", "refdl-h2"], cwd=ROOT, check=True)
        said_out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:] + said_out[-1000:]
    assert "refdl-h2 lost after step" in err and "carrying on on refdl-h1:2" in err, err[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == 60 and s["hosts"] == {"refdl-h1": [0, 1]}
    (r,) = s["restarts"]
    assert r["lost_hosts"] == ["refdl-h2"] and r["ranks"] == [4, 2]
    assert r["checkpoint_step"] >= 20 and 0 <= r["steps_redone"] <= 1, r
    assert 0 < r["seconds_lost"] < 120, r
    assert s["elastic"]["per_rank_batch"] == [s["global_batch"] / 4, s["global_batch"] / 2]
    assert s["elastic"]["rejoin"] is False
    ref = tmp_path / "single"
    fit(RunSpec(strategy="single", steps=60, out=str(ref), progress=False))  # in-process
    assert_same(params(out), params(ref))


@pytest.mark.mpi
@pytest.mark.slow  # about 140 s on 2 cores
def test_a_lost_host_that_answers_again_is_taken_back(tmp_path, test_hosts):
    """Issue 53's rejoin: refdl-h2's processes killed once step 20 is saved, then its link
    cut, so it does not answer the launch agent (as ssh would not). The run goes on on
    refdl-h1 and does not take refdl-h2 back while it is cut (two probes' time); once
    the link is mended, the ranks stop after the step in flight and the run starts again
    on both hosts from that step's checkpoint. It ends where 200 steps of single end
    (fp32: rtol 1e-5, atol 1e-6), and the summary lists both restarts."""
    from refdl import elastic

    out, said = tmp_path / "e", []
    cmd = [sys.executable, "-m", "refdl", "launch", "--elastic", "--hosts", HOSTS,
           "--launch-agent", AGENT, "train", "--strategy", "data", "--devices", "4",
           "--steps", "200", "--out", str(out), "--no-progress", "--timeout", "30"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    reader.start()

    def wait_for(what: str, done, seconds: float = 240) -> None:
        deadline = time.monotonic() + seconds
        while not done():
            assert proc.poll() is None, f"the launcher ended before {what}: {''.join(said)}"
            assert time.monotonic() < deadline, f"no {what} in {seconds} s: {''.join(said)}"
            time.sleep(0.02)

    def newest() -> int:
        found = sorted((out / "checkpoints").glob("step_???????"))
        return int(found[-1].name.removeprefix("step_")) if found else -1

    try:
        wait_for("checkpoint of step 20", lambda: newest() >= 20)
        subprocess.run(["bash", "scripts/hosts.sh", "kill", "refdl-h2"], cwd=ROOT, check=True)
        wait_for("restart on refdl-h1", lambda: any("carrying on on refdl-h1:2 " in ln
                                                    for ln in said))  # fmt: skip
        # (the launcher asks the lost host first REJOIN_EVERY_S after the restart)
        subprocess.run(["bash", "scripts/hosts.sh", "cut", "refdl-h2"], cwd=ROOT, check=True)
        resumed = newest()
        wait_for("step on refdl-h1 alone", lambda: newest() > resumed)
        time.sleep(2.5 * elastic.REJOIN_EVERY_S)  # two probes or more while it is cut
        assert not any("answers again" in ln for ln in said), "".join(said)
        mended_at = time.time()
        subprocess.run(["bash", "scripts/hosts.sh", "mend", "refdl-h2"], cwd=ROOT, check=True)
        proc.wait(timeout=300)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["bash", "scripts/hosts.sh", "mend", "refdl-h2"], cwd=ROOT)
    assert proc.returncode == 0, "".join(said)[-4000:]
    assert any("refdl-h2 answers again" in ln for ln in said), "".join(said)
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == 200
    assert s["hosts"] == {"refdl-h1": [0, 1], "refdl-h2": [2, 3]}
    lost, back = s["restarts"]
    assert lost["lost_hosts"] == ["refdl-h2"] and lost["ranks"] == [4, 2], lost
    assert back["returned_hosts"] == ["refdl-h2"] and back["ranks"] == [2, 4], back
    assert back["lost_at_unix"] >= mended_at and back["steps_redone"] == 0, back
    assert back["checkpoint_step"] > lost["checkpoint_step"] and 0 < back["seconds_lost"] < 120
    g = s["global_batch"]
    assert s["elastic"]["per_rank_batch"] == [g / 4, g / 2, g / 4]
    assert s["elastic"]["hosts_at_end"] == {"refdl-h1": 2, "refdl-h2": 2}
    ref = tmp_path / "single"
    fit(RunSpec(strategy="single", steps=200, out=str(ref), progress=False))  # in-process
    assert_same(params(out), params(ref))
