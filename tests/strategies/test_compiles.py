"""Guard the compiled step: once a strategy has run two steps, further steps of the same
shapes compile nothing (a silent recompile per step would be a performance bug that no
equivalence test sees). Counted with JAX's own compile events."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest

from refdl.config.spec import RunSpec
from refdl.run.build import build
from refdl.run.trajectory import trajectory

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles():
    """Count XLA backend compilations inside the block."""
    count = [0]

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


CASES = {
    "single": {},
    "single-microbatches": {"microbatches": 2},
    "data": {"strategy": "data", "devices": 4},
    "data-ring-compressed": {"strategy": "data", "devices": 4, "allreduce": "ring",
                             "compress": "topk:0.1"},
    "model": {"strategy": "model", "devices": 2},
    "hybrid": {"strategy": "hybrid", "devices": 8, "mesh": "data=2,model=4"},
    "hybrid-pipe": {"strategy": "hybrid", "devices": 8, "mesh": "data=2,model=2,pipe=2"},
    "pipeline": {"strategy": "pipeline", "devices": 2, "microbatches": 4},
    "pipeline-zbv": {"strategy": "pipeline", "devices": 2, "microbatches": 4, "schedule": "zbv"},
    "fsdp": {"strategy": "fsdp", "devices": 4, "zero": 3},
    "hybrid-fsdp": {"strategy": "hybrid", "devices": 4, "mesh": "fsdp=2,model=2"},
    "ps-sync": {"strategy": "ps", "simulate": True, "workers": 2},
    "ps-async": {"strategy": "ps", "simulate": True, "workers": 2, "ps_mode": "async"},
    "decentralized": {"strategy": "decentralized", "devices": 4},
    "decentralized-serial": {"strategy": "decentralized", "simulate": True, "workers": 4},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_recompile_after_the_first_steps(case):
    run = build(RunSpec(model="mlp", progress=False, **CASES[case]))
    state = run.strategy.init_state(0)
    for out in trajectory(run, state, 0, 2):
        state = out.state
    with counting_compiles() as compiles:
        for out in trajectory(run, state, 2, 5):
            state = out.state
    assert compiles[0] == 0, f"{case}: {compiles[0]} compilations in steps 3-5"


def test_the_counter_sees_every_compile():
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    a, b = np.ones(3, np.float32), np.ones(4, np.float32)
    with counting_compiles() as compiles:
        f(a)
        f(a)  # cached
        f(b)  # a new shape compiles again
    assert compiles[0] == 2
