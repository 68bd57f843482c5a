"""The planner's entry (``refdl plan``'s library half): settings in, the priced search out.

``plan_configurations`` checks its typed settings, prices every configuration the
model allows (``refdl.perf.search.Planner``) and returns the record ``refdl plan
--json`` prints with the search itself. The strategies' traits come in as a
parameter (``strategies``): the performance model never imports the strategies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from refdl import hw
from refdl.config.choices import chunks_of
from refdl.config.plan import Traits
from refdl.config.values import Int
from refdl.errors import UsageError
from refdl.perf import OPTIMIZER_WORDS, PredictOptions
from refdl.perf.transformer import stage_layers

MAX_DEVICES = 1 << 17  # the meshes of a count this size take seconds to enumerate


def model_of(name: str, seq_len: int | None) -> Any:
    """The model's cost (``refdl.perf.model_cost``), at ``seq_len`` tokens a sequence."""
    from refdl.perf.model_cost import model_cost, transformer_cost
    from refdl.perf.zoo import TRANSFORMERS

    if seq_len is None:
        return model_cost(name)
    if problem := Int(min=1, max=1 << 24).problem(seq_len):
        raise UsageError(f"--seq-len must be {problem}")
    if name in TRANSFORMERS.names():
        shape = dataclasses.replace(TRANSFORMERS.get(name).shape, seq=seq_len)
        return transformer_cost(name, shape)
    if model_cost(name).transformer is None:
        raise UsageError(f"--seq-len is for transformers; --model {name} is not one")
    return model_cost(name, (("seq_len", str(seq_len)),))


def default_optimizer(name: str) -> str:
    """A refdl model's own optimizer (its recipe's), Adam for a shape-only model."""
    from refdl.models import MODELS

    if name in MODELS.names():
        return str(MODELS.get(name).defaults.get("optimizer", "adam"))
    return "adam"


def boundaries(c: Any, layers: int) -> list[int] | None:
    """The layers where each pipeline stage (each chunk of it, interleaved) begins after
    the first (``refdl train --stage-boundaries``): equal stages, or a layer fewer at the
    ends where the stages do not divide the layers; None without stages."""
    stages = c.mesh.pipe * chunks_of(c.schedule, c.chunks)  # ZB-V and DualPipeV: 2
    if c.mesh.pipe == 1 or not layers:
        return None
    sizes = stage_layers(layers, stages)
    return [sum(sizes[:i]) for i in range(1, stages)]


def row(p: Any, transformer: bool, strategies: Mapping[str, Traits],
        layers: int = 0) -> dict[str, Any]:  # fmt: skip
    """One configuration as ``refdl plan --json`` gives it (``layers``: the model's, for
    its stage boundaries)."""
    c = p.config
    total = sum(p.terms.values())
    runs = c.runnable(transformer)
    return {
        "mesh": c.mesh.as_dict(),
        "strategy": c.strategy(transformer, strategies),
        "zero": c.zero,
        "microbatches": c.microbatches,
        "schedule": c.schedule if c.mesh.pipe > 1 else None,
        "chunks": c.chunks,
        "remat": c.remat,
        "recompute": c.remat,  # the same, by the word Megatron and torchtitan use
        "stage_boundaries": boundaries(p.config, layers),
        "precision": c.precision,
        "sequence_parallel": c.sequence_parallel,
        "cp": c.cp if c.mesh.context > 1 else None,
        "step_time_s": p.step_time_s,
        "step_time_low_s": p.low_s,
        "step_time_high_s": p.high_s,
        "memory_bytes_per_device": p.memory_bytes,
        "dominant_term": p.dominant,
        "dominant_share": p.terms[p.dominant] / total if total else None,
        "terms_s": p.terms,
        "train_flags": c.train_flags(transformer, strategies) if runs else None,
        "compress": c.compress or None,
        "allreduce": ("sparse" if c.sparse else "ring") if c.compress else None,
        "description": c.describe(),
    }


# How the configurations within TIE_BAND of the fastest are ordered (refdl plan --ties).
# Measured on the published configuration searches (refdl bench published, 2026-11-27,
# held-out part, 29 searches): the source's fastest first in 41 % / 69 % of them, in the
# first 3 in 90 % / 86 %, simplest / time.
TIE_ORDERS = {
    "simplest": "memory headroom (at most 90 % of the limit), exact before compressed "
    "gradients, fewer mesh axes, plainer schedule, less recomputation, then the predicted "
    "step",
    "time": "the predicted step",
}


def plan_configurations(
    hw_name: str,
    model: str,
    devices: int,
    batch_size: int,
    *,
    strategies: Mapping[str, Traits],
    seq_len: int | None = None,
    memory_limit: float | None = None,
    top: int = 5,
    precisions: tuple[str, ...] | None = None,
    optimizer: str | None = None,
    library: str | None = None,
    runnable_only: bool = False,
    ties: str = "simplest",
    lossy: bool = False,
    compute: str = "shape",
    grad_reduce: str = "fp32",
    tick: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Any], Any]:
    """The ``top`` fastest configurations of ``model`` on ``devices`` devices of profile
    ``hw_name`` at global batch ``batch_size``: the ``--json`` record and the search.
    ``memory_limit``: bytes per device (default: the device's); ``runnable_only``: only
    what ``refdl train`` runs; ``ties``: the order of the configurations the model cannot
    rank by time (``TIE_ORDERS``); ``lossy``: data's compressed exchanges priced too
    (``search.LOSSY``; they change the training); ``compute``: a transformer's products
    priced by shape (``refdl.perf.gemm``) or every FLOP alike (``flops``); ``grad_reduce``:
    a transformer's gradients reduced in fp32 or in the compute precision; ``tick(done,
    total)``: the search's progress over its layouts."""
    from refdl.perf.prediction import overhead_note

    def launches(note: str | None) -> str | None:
        """predict's note, with what it means for a ranking of layouts."""
        return note and (f"{note} a step, once more for each microbatch; the rows are "
                         "bounds, and a layout with more microbatches or stages pays more "
                         "launches than they show")  # fmt: skip

    from refdl.perf.search import TIE_BAND, Planner, plainness, why_first, why_plainer

    bounds = (("--devices", devices, MAX_DEVICES), ("--batch-size", batch_size, 1 << 24),
              ("--top", top, 1 << 20))  # fmt: skip
    for flag, value, most in bounds:
        if problem := Int(min=1, max=most).problem(value):
            raise UsageError(f"{flag} must be {problem}")
    PredictOptions(compute=compute, grad_reduce=grad_reduce).validate()  # one line, exit 2
    if ties not in TIE_ORDERS:
        raise UsageError(f"--ties must be one of {', '.join(TIE_ORDERS)} (got {ties!r})")
    optimizer = optimizer or default_optimizer(model)
    if optimizer not in OPTIMIZER_WORDS:
        raise UsageError(f"unknown --optimizer {optimizer!r}; choose {', '.join(OPTIMIZER_WORDS)}")
    if bad := [x for x in precisions or () if x not in ("fp32", "bf16")]:
        raise UsageError(f"--precision {','.join(bad)}: choose fp32 or bf16")
    profile = hw.load(hw_name)
    device = profile.need_device()
    for p in precisions or ():  # one line where the device has no such precision
        if p != "fp32" and profile.dtype_for(p) not in device.peak_flops:
            raise UsageError(f"--precision {p}: {profile.name}'s {device.name} lists no "
                             f"{p} peak; plan fp32 (or leave --precision out: every "
                             "precision the device has)")  # fmt: skip
    limit = memory_limit if memory_limit is not None else device.memory_bytes
    # a limit above the profile's card (80 GiB on an 80 GB profile, or a larger card priced
    # on its sibling's profile) is taken, and said
    note = (f"--memory-limit {limit / 1e9:.4g} GB is above the {device.name}'s "
            f"{device.memory_bytes / 1e9:.4g} GB in {profile.name}: the plans assume a card "
            "with that memory" if limit > device.memory_bytes else None)  # fmt: skip
    cost = model_of(model, seq_len)
    if lossy and cost.transformer is not None:
        raise UsageError(f"--lossy prices data's compressed exchanges for models priced by "
                         f"their compiled step (mlp, lenet5, resnet, vgg ...); {model} is "
                         "priced by the transformer formula, which has none")  # fmt: skip
    t0 = time.perf_counter()
    planner = Planner(
        cost, profile, devices, batch_size, memory_limit=limit, precisions=precisions,
        optimizer_words=OPTIMIZER_WORDS[optimizer], library=library,
        runnable_only=runnable_only, strategies=strategies, muon=optimizer == "muon",
        lossy=lossy, compute=compute, grad_reduce=grad_reduce,
    )  # fmt: skip
    result = planner.search(top, tick)
    seconds = time.perf_counter() - t0
    shown = list(result.found)
    if ties == "simplest":  # the tie set first, simplest first; then the fastest of the rest
        tied = sorted(result.tie_set, key=lambda p: plainness(p, limit))
        shown = (tied + [p for p in result.found if p not in result.tie_set])[:top]
    transformer = cost.transformer is not None
    stage_units = cost.transformer.layers if transformer else cost.layers
    record = {
        "hw": profile.name,
        "model": model,
        "optimizer": optimizer,
        "params": cost.params,
        "devices": devices,
        "global_batch": batch_size,
        "seq_len": cost.transformer.seq if transformer else None,
        "memory_limit_bytes": limit,
        # a limit above the profile's card (80 GiB on an 80 GB profile, or a larger card
        # priced on its sibling's profile) is taken, and said
        "memory_limit_note": note,
        # a compiled model priced below its kernels' launches (a GPU profile has no
        # per-kernel figure): the rows are FLOP-and-byte bounds, not a ranking
        "overhead_note": launches(overhead_note(profile, cost, result.found[0].step_time_s))
        if result.found
        else None,
        "priced": result.priced,
        "meshes": result.meshes,
        "did_not_fit": result.too_big,
        "seconds": seconds,
        # stages cut a transformer's blocks, as predict --stage-boundaries counts them (a
        # shape-only model's traced layers, gpt2's 123, are not what the stages hold)
        "configurations": [row(p, transformer, strategies, stage_units) for p in shown],
        # how many configurations (of all, not only those printed) the model cannot tell
        # from the fastest: within TIE_BAND of its step; they come first, simplest first
        "tie_band": TIE_BAND,
        "indistinguishable_from_best_count": result.tied,
        "ties": ties,
        "tie_order": TIE_ORDERS[ties],
        "lossy": lossy,
    }
    if result.found:
        fastest = result.found[0].step_time_s
        for r in record["configurations"]:
            r["indistinguishable_from_best"] = r["step_time_s"] <= fastest * TIE_BAND
    if len(shown) > 1:
        a, b = shown[0], shown[1]
        both_tied = ties == "simplest" and a in result.tie_set and b in result.tie_set
        record["why_first"] = (f"as fast as the next within the model's paired error, and "
                               f"{why_plainer(a, b, limit)}" if both_tied and plainness(
                                   a, limit)[:5] != plainness(b, limit)[:5]
                               else why_first(a, b))  # fmt: skip
    return record, result
