"""``MeshSpec``: the validated degrees of the device mesh (axes ``data``, ``model``, ``pipe``).

Like torchtitan's ParallelDims: checked once, without devices, with messages
that say what to change. ``-1`` means "the rest of the devices".

- ``data``: the global batch is split into ``data`` equal shards; with
  ``microbatches`` m, each shard is further split into m microbatches, so the
  global batch must be a multiple of ``data * m``.
- ``model``: every layer dimension named for tensor parallelism must divide by
  ``model`` (checked against the model by the strategy).
- ``pipe``: pipeline stages (a later issue); needs at least ``pipe`` layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from refdl.errors import UsageError

AXES = ("data", "model", "pipe")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Degrees of the three mesh axes; their product is the device count."""

    data: int = 1
    model: int = 1
    pipe: int = 1

    @property
    def size(self) -> int:
        return self.data * self.model * self.pipe

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.model, self.pipe)

    def as_dict(self) -> dict[str, int]:
        return {"data": self.data, "model": self.model, "pipe": self.pipe}

    @classmethod
    def parse(cls, text: str | None, devices: int) -> MeshSpec:
        """``"data=2,model=4"`` on ``devices`` devices; unnamed axes are 1, ``-1`` the rest.

        >>> MeshSpec.parse("data=2,model=-1", 8)
        MeshSpec(data=2, model=4, pipe=1)
        >>> MeshSpec.parse(None, 4)
        MeshSpec(data=4, model=1, pipe=1)
        """
        if devices <= 0:
            raise UsageError(f"--devices must be > 0 (got {devices})")
        if not text:
            return cls(data=devices)
        degrees: dict[str, int] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition("=")
            name = name.strip()
            if not sep or name not in AXES:
                raise UsageError(
                    f"--mesh {text!r}: each entry is AXIS=DEGREE with AXIS one of "
                    f"{', '.join(AXES)} (got {part.strip()!r})"
                )
            if name in degrees:
                raise UsageError(f"--mesh {text!r}: axis {name!r} given twice")
            try:
                degrees[name] = int(value)
            except ValueError:
                raise UsageError(
                    f"--mesh {text!r}: {name} degree {value!r} is not an integer"
                ) from None
            if degrees[name] == 0 or degrees[name] < -1:
                raise UsageError(f"--mesh {text!r}: {name} degree must be >= 1 or -1")
        rest = [n for n, d in degrees.items() if d == -1]
        if len(rest) > 1:
            raise UsageError(f"--mesh {text!r}: only one axis may be -1 (the rest)")
        known = math.prod(d for d in degrees.values() if d != -1)
        if rest:
            if devices % known:
                raise UsageError(
                    f"--mesh {text!r}: {known} does not divide {devices} devices, so "
                    f"{rest[0]}=-1 has no integer degree; change the degrees or --devices"
                )
            degrees[rest[0]] = devices // known
        spec = cls(**degrees)
        if spec.size != devices:
            raise UsageError(
                f"--mesh {text!r} multiplies to {spec.size} devices but --devices is {devices}; "
                f"make data x model x pipe = {devices} (or use -1 for one axis)"
            )
        return spec

    def check_batch(self, global_batch: int, microbatches: int = 1) -> None:
        """The global batch must split into ``data`` shards of ``microbatches`` equal parts."""
        if microbatches < 1:
            raise UsageError(f"--microbatches must be >= 1 (got {microbatches})")
        unit = self.data * microbatches
        if global_batch % unit:
            lo = (global_batch // unit) * unit
            hint = f"{lo} or {lo + unit}" if lo else f"{unit}"
            raise UsageError(
                f"--batch-size {global_batch} does not split into data={self.data} shards x "
                f"{microbatches} microbatches; use a multiple of {unit} (e.g. {hint})"
            )

    def check_layers(self, n_layers: int) -> None:
        """A pipeline needs at least one layer per stage."""
        if self.pipe > n_layers:
            raise UsageError(
                f"pipe={self.pipe} stages but the model has only {n_layers} layers; "
                f"use pipe <= {n_layers}"
            )

    def make(self, devices: Sequence) -> object:
        """The ``jax.sharding.Mesh`` over ``devices`` with axes ``(data, model, pipe)``."""
        import jax
        from jax.sharding import AxisType

        if len(devices) != self.size:
            raise UsageError(f"mesh {self.as_dict()} needs {self.size} devices, got {len(devices)}")
        return jax.make_mesh(
            self.shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=list(devices)
        )
