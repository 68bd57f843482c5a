"""Property tests of the validation functions, in-process: whatever value or file a user
gives, each check either accepts it or raises the one error kind it promises (a
``UsageError``/``DataError`` of one line) - never another exception, never a crash."""

from __future__ import annotations

import dataclasses
import math
import tomllib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refdl.config.mesh import MeshSpec
from refdl.config.spec import RunSpec, command_line
from refdl.config.values import Choice, Float, Int, Ints
from refdl.errors import DataError, UsageError

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.lists(st.integers(-5, 5), max_size=3),
)  # fmt: skip


@SETTINGS
@given(lo=st.integers(-10, 10), width=st.integers(0, 20), v=ANY)
def test_int_accepts_exactly_the_integers_in_range(lo, width, v):
    kind = Int(lo, lo + width)
    ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= lo + width
    assert (kind.problem(v) is None) == ok


@SETTINGS
@given(v=ANY, lo=st.floats(-5, 5), open_=st.booleans())
def test_float_accepts_exactly_finite_numbers_above_the_bound(v, lo, open_):
    kind = Float(min=lo, min_open=open_)
    number = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = number and (v > lo if open_ else v >= lo)
    assert (kind.problem(v) is None) == ok


@SETTINGS
@given(text=st.text(max_size=20))
def test_parse_agrees_with_problem(text):
    for kind in (Int(0, 100), Float(min=0.0), Choice(("a", "b")), Ints(1, 9)):
        try:
            value = kind.parse(text)
        except ValueError as e:
            assert str(e) and "\n" not in str(e)
        else:
            assert kind.problem(value) is None


FIELDS = {f.name: f for f in dataclasses.fields(RunSpec)}


@SETTINGS
@given(name=st.sampled_from(sorted(FIELDS)), value=ANY)
def test_runspec_validate_accepts_or_names_the_flag(name, value):
    try:
        with command_line():  # refusals name the flag (a library caller: the argument)
            spec = RunSpec(**{name: value})  # checked as it is made
    except UsageError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith("--")
    else:
        assert FIELDS[name].metadata["value"].problem(getattr(spec, name)) is None


@SETTINGS
@given(text=st.text(alphabet="datmoelip=,-0123456789 ", max_size=30), n=st.integers(-2, 16))
def test_mesh_parse_gives_a_mesh_of_the_devices_or_one_line(text, n):
    try:
        mesh = MeshSpec.parse(text, n)
    except UsageError as e:
        assert "\n" not in str(e)
    else:
        assert mesh.size == n and min(mesh.shape) >= 1


@SETTINGS
@given(data=st.data())
def test_a_damaged_hardware_profile_is_one_line(tmp_path_factory, data):
    from refdl.hw import profile

    good = (profile.resources.files("refdl.hw") / "profiles" / "p100-nvlink.toml").read_text()
    raw = tomllib.loads(good)
    section = data.draw(st.sampled_from(["device", "links", "top"]))
    table = raw if section == "top" else raw[section]
    if section == "links":
        table = table["intra"]
    key = data.draw(st.sampled_from(sorted(table)))
    table[key] = data.draw(st.one_of(ANY, st.dictionaries(st.text(max_size=3), ANY, max_size=2)))
    try:
        profile.parse(raw, "fuzzed")
    except UsageError as e:
        assert "\n" not in str(e) and "hardware profile fuzzed" in str(e)


@SETTINGS
@given(data=st.binary(max_size=400))
def test_any_bytes_as_a_cifar_batch_or_an_idx_file_are_refused_in_one_line(tmp_path_factory, data):
    from refdl.data.readers import read_cifar_batch, read_idx

    tmp = tmp_path_factory.mktemp("f")
    for name, reader in (("batch", read_cifar_batch), ("x-idx3-ubyte", read_idx),
                         ("x-idx3-ubyte.gz", read_idx)):  # fmt: skip
        (tmp / name).write_bytes(data)
        try:
            reader(tmp / name)
        except DataError as e:
            assert "\n" not in str(e)


@SETTINGS
@given(body=st.text(max_size=300))
def test_any_recipe_text_is_loaded_or_refused_in_one_line(tmp_path_factory, body):
    from refdl.bench.recipes import load

    path = tmp_path_factory.mktemp("r") / "r.toml"
    path.write_text(body)
    try:
        load(path)
    except UsageError as e:
        assert "\n" not in str(e)


@SETTINGS
@given(lines=st.lists(st.one_of(
    st.text(max_size=40),
    st.fixed_dictionaries({"step": ANY, "loss": ANY}).map(lambda d: __import__("json").dumps(d)),
    st.just('{"config": {"model": "mlp"}}'),
), max_size=5))  # fmt: skip
def test_any_framework_log_is_read_or_refused_in_one_line(tmp_path_factory, lines):
    from refdl.validate.logs import read_log

    path = tmp_path_factory.mktemp("l") / "log.jsonl"
    path.write_text("\n".join(lines))
    try:
        log = read_log(str(path))
        rows, config = log.rows, log.config
    except UsageError as e:
        assert "\n" not in str(e)
    else:
        assert config["model"] == "mlp" and all(isinstance(r["step"], int) for r in rows)


@pytest.mark.parametrize("n", [1, 3, 4])
@SETTINGS
@given(data=st.data())
def test_any_topology_file_gives_a_connected_graph_or_one_line(tmp_path_factory, n, data):
    import numpy as np

    from refdl.comm.topology import adjacency, metropolis

    path = tmp_path_factory.mktemp("t") / "graph.txt"
    path.write_text(data.draw(st.text(alphabet="01 .\n-2", max_size=40)))
    try:
        a = adjacency(str(path), n)
    except UsageError as e:
        assert "\n" not in str(e)
    else:
        w = metropolis(a)
        np.testing.assert_allclose(w.sum(1), 1.0)
