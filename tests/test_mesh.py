"""MeshSpec: parsing, -1, and the checks, all without devices."""

from __future__ import annotations

import pytest

from refdl.errors import UsageError
from refdl.mesh import MeshSpec


def test_parse_and_rest():
    assert MeshSpec.parse("data=2,model=4", 8) == MeshSpec(2, 4, 1)
    assert MeshSpec.parse("model=-1", 8) == MeshSpec(1, 8, 1)
    assert MeshSpec.parse("data=2,model=2,pipe=-1", 8) == MeshSpec(2, 2, 2)
    assert MeshSpec.parse(None, 4) == MeshSpec(4, 1, 1)
    assert MeshSpec.parse("data=2,model=4", 8).as_dict() == {"data": 2, "model": 4, "pipe": 1}


@pytest.mark.parametrize(
    "text,devices,message",
    [
        ("data=2,model=2", 8, "multiplies to 4 devices but --devices is 8"),
        ("data=3,model=-1", 8, "3 does not divide 8 devices"),
        ("data=-1,model=-1", 8, "only one axis may be -1"),
        ("tensor=2", 2, "AXIS one of data, model, pipe"),
        ("data=two", 2, "is not an integer"),
        ("data=2,data=1", 2, "given twice"),
        ("data=0", 1, "must be >= 1 or -1"),
    ],
)
def test_bad_meshes(text, devices, message):
    with pytest.raises(UsageError, match=message):
        MeshSpec.parse(text, devices)


def test_batch_and_layer_checks():
    MeshSpec(data=4).check_batch(64, 2)
    with pytest.raises(UsageError, match=r"use a multiple of 8 \(e\.g\. 56 or 64\)"):
        MeshSpec(data=4).check_batch(60, 2)
    with pytest.raises(UsageError, match="--microbatches must be >= 1"):
        MeshSpec().check_batch(64, 0)
    with pytest.raises(UsageError, match="pipe=4 stages but the model has only 3 layers"):
        MeshSpec(pipe=4).check_layers(3)
