"""``MeshSpec``: the validated degrees of the device mesh (``data``, ``fsdp``, ``expert``,
``context``, ``model``, ``pipe``).

Like torchtitan's ParallelDims: checked once, without devices, with messages
that say what to change. ``-1`` means "the rest of the devices".

- ``data``: the global batch is split into ``data`` equal shards; with
  ``microbatches`` m, each shard is further split into m microbatches, so the
  global batch must be a multiple of ``data * m``.
- ``model``: every layer dimension named for tensor parallelism must divide by
  ``model``;
- ``pipe``: pipeline stages; needs at least ``pipe`` layers;
- ``fsdp``: sharded data parallelism (MaxText's ``fsdp`` axis): the batch is split
  over ``data x fsdp`` and every parameter (and its optimizer state) is split over
  ``fsdp`` along a dimension that divides (``refdl.config.rules.param_spec``);
  XLA gathers a parameter where it is used and reduce-scatters its gradient;
- ``context``: the sequence is split into ``context`` pieces (context parallelism,
  ``refdl.parallel.context``); the sequence length must divide by it;
- ``expert``: the experts of a mixture-of-experts model are split over ``expert``, and
  the batch too (``refdl.parallel.expert``); the experts must divide by it.

Those checks against the batch and the model live in ``refdl.config.plan``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from refdl.errors import UsageError

AXES = ("data", "fsdp", "expert", "context", "model", "pipe")  # outermost first


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Degrees of the mesh axes; their product is the device count."""

    data: int = 1
    model: int = 1
    pipe: int = 1
    fsdp: int = 1
    context: int = 1
    expert: int = 1
    # the ``--mesh`` text these degrees were parsed from (``-1`` kept), for messages and
    # for a run's config.json; not part of the value
    given: str = dataclasses.field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return self.given or self.text()

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def replicas(self) -> int:
        """The degrees the global batch is split over: data x fsdp x expert."""
        return self.data * self.fsdp * self.expert

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def as_dict(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @classmethod
    def parse(cls, text: str | None, devices: int | None = None) -> MeshSpec:
        """``"data=2,model=4"`` on ``devices`` devices (default: the product the text names);
        unnamed axes are 1, ``-1`` the rest.

        >>> MeshSpec.parse("data=2,model=-1", 8)
        MeshSpec(data=2, model=4, pipe=1, fsdp=1, context=1, expert=1)
        >>> MeshSpec.parse(None, 4).as_dict()["data"]
        4
        """
        if not text:
            if not isinstance(devices, int) or devices <= 0:
                raise UsageError(f"--devices must be an integer > 0 (got {devices!r})")
            return cls(data=devices)
        return MeshLayout.parse(text).on(devices)

    @staticmethod
    def devices_of(text: str) -> int | None:
        """The device count a ``--mesh`` text names by itself (None when an axis is -1).

        >>> MeshSpec.devices_of("data=2,model=4"), MeshSpec.devices_of("data=-1,model=2")
        (8, None)
        """
        return MeshLayout.parse(text).devices

    @classmethod
    def factor(cls, devices: int) -> MeshSpec:
        """A hybrid mesh for ``devices`` devices: ``model`` 2 when the count is even, then
        ``pipe`` 2 when at least 2 remain for ``data``, the rest on ``data``.

        >>> MeshSpec.factor(8).text()
        'data=2,model=2,pipe=2'
        >>> MeshSpec.factor(4).text(), MeshSpec.factor(1).text()
        ('data=2,model=2,pipe=1', 'data=1,model=1,pipe=1')
        """
        model = 2 if devices % 2 == 0 else 1
        rest = devices // model
        pipe = 2 if rest % 4 == 0 else 1
        return cls(data=rest // pipe, model=model, pipe=pipe)

    def text(self) -> str:
        """The ``--mesh`` text of these degrees (``data=2,model=2,pipe=2``; ``fsdp``,
        ``expert`` and ``context`` only when they are used)."""
        always = ("data", "model", "pipe")
        return ",".join(f"{k}={v}" for k, v in self.as_dict().items() if k in always or v > 1)

    def make(self, devices: Sequence) -> object:
        """The ``jax.sharding.Mesh`` over ``devices`` with axes ``AXES``."""
        if len(devices) != self.size:
            raise UsageError(f"mesh {self.as_dict()} needs {self.size} devices, got {len(devices)}")
        import jax  # here, not at the top: flags are checked before JAX loads (about 1 s)
        from jax.sharding import AxisType

        return jax.make_mesh(
            self.shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=list(devices)
        )


def _degrees(text: str) -> dict[str, int]:
    """The degrees a ``--mesh`` text names (``-1``: the rest, at most one); syntax only."""
    degrees: dict[str, int] = {}
    for part in str(text).split(","):
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
            degrees[name] = int(value.strip())
        except ValueError:
            raise UsageError(
                f"--mesh {text!r}: {name} degree {value!r} is not an integer"
            ) from None
        if degrees[name] == 0 or degrees[name] < -1:
            raise UsageError(f"--mesh {text!r}: {name} degree must be >= 1 or -1")
    if sum(d == -1 for d in degrees.values()) > 1:
        raise UsageError(f"--mesh {text!r}: only one axis may be -1 (the rest)")
    return degrees


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A ``--mesh`` text parsed once, before the device count is known: degrees by axis,
    at most one ``-1`` (the rest). ``on(devices)`` resolves it; a sweep over device counts
    (``refdl.predict``) resolves one layout many times."""

    degrees: tuple[tuple[str, int], ...]
    given: str = dataclasses.field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return self.given or ",".join(f"{a}={d}" for a, d in self.degrees)

    @classmethod
    def parse(cls, text: str) -> MeshLayout:
        """``"data=-1,model=2"``; anything else is a one-line error."""
        return cls(tuple(_degrees(text).items()), str(text))

    @property
    def devices(self) -> int | None:
        """The device count the degrees name by themselves (None with a -1 axis)."""
        named = dict(self.degrees)
        return None if -1 in named.values() else math.prod(named.values())

    def on(self, devices: int | None = None, count: str = "--devices") -> MeshSpec:
        """The mesh on ``devices`` devices (default: the count the degrees name); ``count``:
        the flag that gave the count, as refusals name it (predict's is ``--workers``)."""
        text, degrees = str(self), dict(self.degrees)
        if devices is None:
            devices = self.devices
            if devices is None:
                raise UsageError(f"--mesh {text!r} has a -1 axis (the rest): give {count}")
        if not isinstance(devices, int) or devices <= 0:
            raise UsageError(f"{count} must be an integer > 0 (got {devices!r})")
        rest = [n for n, d in degrees.items() if d == -1]
        known = math.prod(d for d in degrees.values() if d != -1)
        if rest:
            if devices % known:
                raise UsageError(
                    f"--mesh {text!r}: {known} does not divide {devices} devices, so "
                    f"{rest[0]}=-1 has no integer degree; change the degrees or {count}"
                )
            degrees[rest[0]] = devices // known
        spec = MeshSpec(**degrees, given=text)
        if spec.size != devices:
            raise UsageError(
                f"--mesh {text!r} multiplies to {spec.size} devices but {count} is {devices}; "
                f"make {' x '.join(AXES)} = {devices} (or use -1 for one axis)"
            )
        return spec
