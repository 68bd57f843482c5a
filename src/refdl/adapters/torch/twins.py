"""Which of PyTorch's own implementations runs as the twin of a refdl strategy, and how.

``Twin`` is a strategy's settings as the PyTorch side needs them (refdl's ``RunSpec``
fields, read once); ``train_twin`` dispatches: plain PyTorch, ``DistributedDataParallel``,
``torch.distributed.pipelining``'s schedule classes, FSDP2 and DTensor tensor parallelism
(``refdl.adapters.torch.sharded``), a mixture of experts over ``all_to_all_single`` and
D-PSGD over ``isend``/``irecv`` (``refdl.adapters.torch.gossip``). ``check_twin`` refuses
what no twin covers in one line, before any run.
"""

from __future__ import annotations

import dataclasses

from refdl.adapters.torch.experts import describe as describe_experts
from refdl.adapters.torch.experts import train_experts
from refdl.adapters.torch.gossip import describe as describe_gossip
from refdl.adapters.torch.gossip import train_gossip
from refdl.adapters.torch.runners import (
    TorchResult,
    TrainPlan,
    train_ddp,
    train_pipeline,
    train_single,
    train_single_apart,
)
from refdl.adapters.torch.sharded import Layout, train_sharded
from refdl.adapters.torch.sharded import describe as describe_sharded
from refdl.config.mesh import MeshSpec
from refdl.errors import UsageError

# The refdl strategies PyTorch runs its own way; any other synchronous strategy is compared
# with plain PyTorch, since its parameters after N steps equal ``single``'s.
# Each planted bug and the twins it is planted in (refdl validate --plant-bug).
BUGS = {"divide": ("fsdp", "hybrid"), "rowwise": ("model", "hybrid"),
        "microbatch-scale": ("pipeline",), "expert-return": ("hybrid",),
        "mixing": ("decentralized",)}  # fmt: skip
HYBRID_AXES = {"data", "fsdp", "model", "expert"}
MOE_TWINS = ("single", "hybrid")  # the twins that run refdl's mixture of experts


@dataclasses.dataclass(frozen=True)
class Twin:
    """A refdl strategy's settings as PyTorch's side needs them."""

    strategy: str = "single"
    devices: int = 1
    cuts: tuple[int, ...] = ()
    microbatches: int = 1
    schedule: str = "1f1b"
    zero: int = 3
    mesh: MeshSpec | None = None
    sequence_parallel: bool = False
    topology: str = "ring"
    bug: str | None = None

    def degrees(self) -> dict[str, int]:
        """The hybrid mesh's degrees by axis name."""
        mesh = self.mesh or MeshSpec(data=self.devices)
        return {a: d for a, d in mesh.as_dict().items() if d > 1}


def check_twin(strategy: str, model: str, mesh: MeshSpec | None, bug: str | None) -> None:
    """One line for what no PyTorch twin covers."""
    if bug is not None:
        if bug not in BUGS:
            raise UsageError(f"--plant-bug {bug}: choose one of {', '.join(BUGS)}")
        if strategy not in BUGS[bug]:
            raise UsageError(f"--plant-bug {bug} is planted in the {', '.join(BUGS[bug])} "
                             f"twin, not in --strategy {strategy}'s")  # fmt: skip
    if mesh:  # a mesh of several axes (the strategy's own checks refuse it elsewhere)
        axes = {a for a, d in mesh.as_dict().items() if d > 1}
        if extra := sorted(axes - HYBRID_AXES):
            raise UsageError(f"PyTorch's hybrid twin composes data, fsdp, model and expert "
                             f"axes; --mesh has {', '.join(extra)}")  # fmt: skip
        if "expert" in axes and (model != "moe" or axes - {"data", "expert"}):
            raise UsageError("PyTorch's expert twin runs --model moe on --mesh data=D,expert=E")
    if model == "moe" and strategy not in MOE_TWINS:
        raise UsageError("PyTorch's twin of --model moe is the expert-parallel hybrid "
                         "(--mesh data=D,expert=E) or plain training (single)")  # fmt: skip


def _ddp(t: Twin, plan: TrainPlan, timeout: float) -> tuple[TorchResult, str]:
    return train_ddp(plan, t.devices, timeout), f"DDP over gloo, {t.devices} processes"


def _pipeline(t: Twin, plan: TrainPlan, timeout: float) -> tuple[TorchResult, str]:
    result, cls = train_pipeline(plan, list(t.cuts), t.microbatches, t.schedule, timeout,
                                 bug=t.bug, world=t.devices)  # fmt: skip
    return result, f"torch.distributed.pipelining {cls}"


def _sharded(layout: Layout, plan: TrainPlan, timeout: float) -> tuple[TorchResult, str]:
    return train_sharded(plan, layout, timeout), describe_sharded(layout)


def _fsdp(t: Twin, plan: TrainPlan, timeout: float) -> tuple[TorchResult, str]:
    return _sharded(Layout(dp=t.devices, zero=t.zero, bug=t.bug), plan, timeout)


def _tensor(t: Twin, plan: TrainPlan, timeout: float) -> tuple[TorchResult, str]:
    layout = Layout(tp=t.devices, sequence=t.sequence_parallel, bug=t.bug)
    return _sharded(layout, plan, timeout)


def _hybrid(t: Twin, plan: TrainPlan, timeout: float) -> tuple[TorchResult, str]:
    d = t.degrees()
    data = d.get("data", 1)
    if d.get("expert", 1) > 1:
        result = train_experts(plan, data, d["expert"], t.bug, timeout)
        return result, describe_experts(data, d["expert"])
    layout = Layout(dp=data * d.get("fsdp", 1), tp=d.get("model", 1), bug=t.bug)
    return _sharded(layout, plan, timeout)


def _gossip(t: Twin, plan: TrainPlan, timeout: float) -> tuple[TorchResult, str]:
    result = train_gossip(plan, t.devices, t.topology, t.bug, timeout)
    return result, describe_gossip(t.devices, t.topology)


# refdl strategy -> the runner of its PyTorch twin (the adapter's table; single's is
# plain PyTorch, below).
RUNNERS = {"data": _ddp, "pipeline": _pipeline, "fsdp": _fsdp, "model": _tensor,
           "hybrid": _hybrid, "decentralized": _gossip}  # fmt: skip


def train_twin(
    twin: Twin, plan: TrainPlan, *, timeout: float = 600, apart: bool = False
) -> tuple[TorchResult, str]:
    """PyTorch's twin of ``twin.strategy`` on ``plan`` and what ran, in words (plain
    PyTorch for a strategy without one; ``apart``: plain PyTorch in its own process)."""
    runner = RUNNERS.get(twin.strategy)
    if runner is not None:
        return runner(twin, plan, timeout)
    return (train_single_apart(plan, timeout) if apart else train_single(plan)), "plain PyTorch"


# The refdl strategies PyTorch runs its own way; any other synchronous strategy is compared
# with plain PyTorch, since its parameters after N steps equal ``single``'s.
TWINS = ("single", *RUNNERS)
