"""Configuration: what a run is (``RunSpec``), its mesh (``MeshSpec``), the logical-axis
rules, and every check of them (``plan``), all without data or devices."""

from refdl.config.mesh import AXES, MeshSpec
from refdl.config.plan import ModelShape, Plan, Traits, plan
from refdl.config.spec import RunSpec

__all__ = ["AXES", "MeshSpec", "ModelShape", "Plan", "RunSpec", "Traits", "plan"]
