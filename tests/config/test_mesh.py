"""MeshSpec: parsing, -1, and the checks, all without devices."""

from __future__ import annotations

import pytest

from refdl.config.mesh import MeshSpec
from refdl.errors import UsageError


def test_parse_and_rest():
    assert MeshSpec.parse("data=2,model=4", 8) == MeshSpec(2, 4, 1)
    assert MeshSpec.parse("model=-1", 8) == MeshSpec(1, 8, 1)
    assert MeshSpec.parse("data=2,model=2,pipe=-1", 8) == MeshSpec(2, 2, 2)
    assert MeshSpec.parse(None, 4) == MeshSpec(4, 1, 1)
    assert MeshSpec.parse("data=2,model=4", 8).as_dict() == {
        "data": 2,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "model": 4,
        "pipe": 1,
    }


@pytest.mark.parametrize(
    "text,devices,message",
    [
        ("data=2,model=2", 8, "multiplies to 4 devices but --devices is 8"),
        ("data=3,model=-1", 8, "3 does not divide 8 devices"),
        ("data=-1,model=-1", 8, "only one axis may be -1"),
        ("tensor=2", 2, "AXIS one of data, fsdp, expert, context, model, pipe"),
        ("data=two", 2, "is not an integer"),
        ("data=2,data=1", 2, "given twice"),
        ("data=0", 1, "must be >= 1 or -1"),
    ],
)
def test_bad_meshes(text, devices, message):
    with pytest.raises(UsageError, match=message):
        MeshSpec.parse(text, devices)


def test_factor_gives_the_main_jobs_mesh_and_uses_every_device():
    assert MeshSpec.factor(8) == MeshSpec(2, 2, 2)
    for n in (1, 2, 3, 4, 6, 8, 12, 16, 64):
        assert MeshSpec.factor(n).size == n
    assert MeshSpec.factor(16) == MeshSpec(4, 2, 2) and MeshSpec.factor(6) == MeshSpec(3, 2, 1)
    assert MeshSpec.parse(MeshSpec.factor(8).text(), 8) == MeshSpec(2, 2, 2)
