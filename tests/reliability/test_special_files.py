"""Files from elsewhere are read with limits: a special file where a file is expected is
refused within a second (never waited on), nesting of any depth is refused without the
parser recursing, and bombs (a nested-list pickle, an IDX header of huge dimensions)
are refused before they cost time or memory."""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from refdl.config import files
from refdl.errors import UsageError


def make_special(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "device":
        path.symlink_to("/dev/zero")  # endless: a reader that does not check reads forever
    elif kind == "socket":
        import socket

        s, here = socket.socket(socket.AF_UNIX), os.getcwd()
        os.chdir(path.parent)  # a relative name: a checkpoint's data files lie deep
        try:
            s.bind(path.name)
        finally:
            os.chdir(here)
            s.close()


def _ckpt_state(p: Path) -> None:
    from refdl.core.state import TrainState
    from refdl.run import checkpoint

    state = TrainState(step=np.asarray(1, np.int32), params={"w": np.ones(2)}, model_state={},
                       opt_state=(), rng=np.zeros(2, np.uint32))  # fmt: skip
    c = checkpoint.save(p / "checkpoints", state, {"spec": {"model": "mlp"}})
    return c


def reader_calls(tmp: Path) -> dict:
    """Each reader of a user's file, as (where the special file goes, the call)."""
    from refdl.bench import recipes
    from refdl.comm.topology import _read_adjacency
    from refdl.data import readers
    from refdl.data.store import ZarrDataset
    from refdl.hw import profile
    from refdl.run import checkpoint
    from refdl.run.report import read_metrics
    from refdl.strategies.ps.ssp import load_trace
    from refdl.validate.logs import read_log

    def ckpt(name):
        def call(p):
            c = tmp / "ckpt"
            step = c / "checkpoints" / "step_0000001"
            f = step / name if name else next((step / "state").glob("ocdbt.process_0/d/*"))
            f.unlink()
            make_special(f, KIND[0])
            checkpoint.resolve(c)

        return call

    return {
        "recipe": lambda p: recipes.load(p),
        "profile": lambda p: profile.load(p.with_suffix(".toml")),
        "topology": lambda p: _read_adjacency(str(p), 4),
        "ps trace": lambda p: load_trace(p, 2, 10, 0),
        "IDX": lambda p: readers.read_idx(p),
        "CIFAR batch": lambda p: readers.read_cifar_batch(p),
        "PTB text": lambda p: readers.read_ptb(p),
        "metrics.jsonl": lambda p: read_metrics(p),
        "framework log": lambda p: read_log(str(p)),
        "zarr info": lambda p: ZarrDataset(p.parent),
        "checkpoint manifest": ckpt("meta/metadata"),
        "checkpoint arrays": ckpt(None),
        "orbax's metadata": ckpt("state/_METADATA"),
    }


KIND: list[str] = ["fifo"]


@settings(max_examples=48, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(reader=st.sampled_from(["recipe", "profile", "topology", "ps trace", "IDX",
                               "CIFAR batch", "PTB text", "metrics.jsonl", "framework log",
                               "zarr info", "checkpoint manifest", "checkpoint arrays",
                               "orbax's metadata"]),
       kind=st.sampled_from(["fifo", "folder", "device", "socket"]))  # fmt: skip
def test_a_special_file_is_refused_within_a_second(tmp_path_factory, reader, kind):
    tmp = tmp_path_factory.mktemp("special")
    _ckpt_state(tmp / "ckpt")
    name = {"zarr info": "info.json", "profile": "input.toml", "framework log": "input.jsonl"}
    path = tmp / name.get(reader, "input")
    if not reader.startswith("checkpoint"):
        make_special(path, kind)
    KIND[0] = kind
    outcome: list = []
    read = reader_calls(tmp)[reader]  # imported before the clock starts

    def call():
        t0 = time.perf_counter()
        try:
            read(path)
            outcome.append("accepted")
        except UsageError as e:  # DataError and the checkpoint's refusal are UsageErrors
            outcome.append(str(e))
        except BaseException as e:
            outcome.append(e)
        outcome.append(time.perf_counter() - t0)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=5.0)
    assert outcome, f"{reader} still blocked on a {kind} after 5 s"
    assert isinstance(outcome[0], str) and outcome[0] != "accepted", outcome[0]
    assert outcome[1] < 1.0, f"{reader}: {outcome[1]:.2f} s"
    said = ("not a regular file", "cannot read", "a folder with no TensorBoard event file")
    assert any(words in outcome[0] for words in said), outcome[0]
    assert "\n" not in outcome[0]


@settings(max_examples=40, deadline=None)
@given(depth=st.integers(65, 300_000), kind=st.sampled_from(["[", "{", "mixed"]),
       fmt=st.sampled_from(["json", "toml"]))  # fmt: skip
def test_nesting_of_any_depth_is_refused_without_recursion(depth, kind, fmt):
    opens = {"[": "[" * depth, "{": '{"a":' * depth, "mixed": '[{"a":' * (depth // 2 + 1)}
    closes = {"[": "]" * depth, "{": "}" * depth, "mixed": "}]" * (depth // 2 + 1)}
    body = opens[kind] + "1" + closes[kind]
    if fmt == "toml":
        body = "x = " + body.replace('{"a":', "{a = ").replace('"a":', "a = ")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(150)  # a parser that recursed would fail here, not refuse
    try:
        load = files.loads_json if fmt == "json" else files.loads_toml
        with pytest.raises(UsageError, match="nested deeper than 64 levels"):
            load(body, "test")
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("depth", [1, 10, 63])
def test_nesting_within_the_bound_parses(depth):
    assert files.value_depth(files.loads_json("[" * depth + "]" * depth, "t")) == depth
    toml = files.loads_toml("x = " + "[" * depth + "]" * depth, "t")
    assert files.value_depth(toml) == depth + 1


def test_strings_and_comments_do_not_count_as_nesting():
    text = 'a = "[[[[[[" # {{{{{{{\nb = \'[[[[\'\nc = """\n[[[[[[\n"""\n'
    assert files.scan_depth(text * 30) == 0
    assert files.loads_toml(text, "t")["a"] == "[[[[[["


def test_a_nested_list_pickle_is_refused_at_once(tmp_path):
    from refdl.data.readers import read_cifar_batch
    from refdl.errors import DataError

    nested: list = [0]
    for _ in range(60):  # 2**60 leaves once expanded
        nested = [nested, nested]
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": nested}))
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="nested containers"):
        read_cifar_batch(path)
    assert time.perf_counter() - t0 < 1.0
    flat = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [[1], [2]]}
    path.write_bytes(pickle.dumps(flat))
    with pytest.raises(DataError, match="labels are not a list of integers"):
        read_cifar_batch(path)


@settings(max_examples=40, deadline=None)
@given(dims=st.lists(st.integers(1, 2**32 - 1), min_size=1, max_size=6), body=st.integers(0, 64))
def test_an_idx_header_is_checked_before_any_allocation(tmp_path_factory, dims, body):
    from refdl.data.readers import IDX_LIMIT, read_idx
    from refdl.errors import DataError

    path = tmp_path_factory.mktemp("idx") / "x-idx3-ubyte"
    path.write_bytes(bytes([0, 0, 0x08, len(dims)]) + struct.pack(f">{len(dims)}I", *dims)
                     + bytes(body))  # fmt: skip
    need = int(np.prod(dims, dtype=object))
    if need == body:
        assert read_idx(path).shape == tuple(dims)
        return
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"asks for|IDX body has"):
        read_idx(path)
    assert time.perf_counter() - t0 < 1.0 and (need <= IDX_LIMIT or need > body)


def test_profile_names_with_control_characters_and_unknown_keys_are_refused(tmp_path):
    from refdl.hw import profile

    good = (ROOT / "src/refdl/hw/profiles/p100-nvlink.toml").read_text()
    for edit, message in (
        (good.replace('name = "p100-nvlink"', 'name = "p100\\u001b[2J"'), "control characters"),
        (good.replace("[links.intra]\n", "[links.intra]\nbandwith = 1\n"), "bandwith is not"),
        (good.replace("[device]\n", "[device]\nflops = 1\n"), "device.flops is not one of"),
    ):
        (tmp_path / "p.toml").write_text(edit)
        with pytest.raises(UsageError, match=message):
            profile.load(tmp_path / "p.toml")
    assert files.printable("a\x1b[2Jb\n") == "a\\x1b[2Jb\\n"
