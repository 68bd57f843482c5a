"""mpirun's standard error under ``refdl launch`` (``refdl.parallel.banners``): the ranks'
lines pass through as they come, mpirun's banners are held and shown only when nothing
else said why the run ended. Fed through a real pipe, as mpirun's stderr is."""

from __future__ import annotations

import os
import time

from refdl.parallel.banners import Banners

RULE = b"-" * 74 + b"\n"
BANNER = RULE + b"prterun noticed that process rank 1 with PID 42 on node vm exited on\n" \
    b"signal 9 (Killed).\n" + RULE  # fmt: skip


def shown(chunks: list[bytes], needed: bool) -> tuple[bytes, bool, list[bytes]]:
    """What a ``Banners`` reading ``chunks`` from a pipe writes, whether a rank said why,
    and what it held, after ``finish(needed)``."""
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    with os.fdopen(r, "rb") as stream:
        banners = Banners(stream, out=out_w)
        for chunk in chunks:
            os.write(w, chunk)
            time.sleep(0.01)  # (separate reads, as from a live mpirun)
        os.close(w)
        banners.finish(needed=needed)
    os.close(out_w)
    with os.fdopen(out_r, "rb") as f:
        return f.read(), banners.said, banners.held


def test_a_banner_is_held_when_a_line_says_why():
    rank = b"refdl.train: error: rank 1: --steps must be at least 1\n"
    out, said, held = shown([b"step 1 ...\n", BANNER, rank], needed=True)
    assert out == b"step 1 ...\n" + rank  # the banner left out: a rank said why
    assert said and held == [BANNER]


def test_a_banner_is_shown_at_the_end_when_nothing_else_says_why():
    out, said, held = shown([b"step 1 ...\n", BANNER, b"step 2 ...\n"], needed=True)
    assert out == b"step 1 ...\nstep 2 ...\n" + BANNER  # after the ranks' lines
    assert not said and held == [BANNER]
    out, _, _ = shown([BANNER], needed=False)  # the launcher says it: not shown
    assert out == b""


def test_a_line_in_pieces_passes_at_once_and_a_banner_split_across_reads_is_still_held():
    progress = [b"\rtrain: 10/300", b"\rtrain: 20/300", b"\n"]  # a bar's updates, no newline
    half = len(BANNER) // 2
    out, _, held = shown([*progress, BANNER[:half], BANNER[half:]], needed=False)
    assert out == b"".join(progress) and held == [BANNER]


def test_dashes_that_are_not_a_rule_pass_through():
    table = b"| a | b |\n|---|---|\n" + b"-" * 20 + b"\n"  # short rules: a rank's own table
    out, _, held = shown([table], needed=False)
    assert out == table and held == []


# PRRTE's banner (on mpirun's standard output) and ssh's line (on its standard error) for
# `refdl launch --hosts bogus:2 ...`, as Open MPI 5 printed them here on 2026-11-28.
NO_DAEMON = (b"-" * 60 + b"\nA daemon failed to report back after being spawned. This could\n"
             b"be due to several factors, including inability to find the\n"
             b"daemon executable, or the executable was unable to find its\n"
             b"required supporting libraries. In some cases, the daemon was\n"
             b"able to execute, but was unable to complete a TCP connection\n"
             b"back to prterun:\n\n  Local host:    vm\n  Remote host:   bogus\n"
             b"  Daemon exit status: 255\n\nThis may also be caused by a firewall on the "
             b"remote host. Please\ncheck that any firewall (e.g., iptables) has been "
             b"disabled and\ntry again.\n" + b"-" * 60 + b"\n")  # fmt: skip
SSH = b"ssh: Could not resolve hostname bogus: Name or service not known\n"


def test_a_host_not_reached_is_one_line_naming_it_with_ssh_words():
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    r2, w2 = os.pipe()  # mpirun's standard output, where PRRTE prints this banner
    with os.fdopen(r, "rb") as stream, os.fdopen(r2, "rb") as stdout:
        banners = Banners(stream, out=out_w, more=((stdout, out_w),))
        os.write(w, SSH)
        os.write(w2, NO_DAEMON)
        os.close(w)
        os.close(w2)
        banners.finish(needed=True)
    os.close(out_w)
    with os.fdopen(out_r, "rb") as f:
        lines = f.read().decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("refdl.launch: error: mpirun could not start its daemon on bogus")
    assert "(ssh: Could not resolve hostname bogus" in lines[0]
    assert banners.unresolved  # the launcher exits 2: a name that does not resolve


def test_ssh_lines_without_a_lost_daemon_still_show():
    out, _, held = shown([b"ssh: connect to host x port 22: Connection refused\n"], needed=True)
    assert out == b"ssh: connect to host x port 22: Connection refused\n" and held == []


def test_an_ssh_warning_before_the_ranks_speak_keeps_its_place():
    warning = b"ssh: Warning: Permanently added 'h2' to the list of known hosts.\n"
    out, _, _ = shown([warning, b"step 1 ...\n"], needed=False)
    assert out == warning + b"step 1 ...\n"
