"""From the settings a command line gave to the settings a run starts with.

A resumed run takes its own settings (``config.json``) and the flags given again,
which must agree; a strategy's options given for another strategy are refused even at
their default; the device count is decided before JAX starts its backend. Only light
modules are imported at the top: JAX starts inside ``choose_devices``, after the
device count is set.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from refdl.config.files import load_json
from refdl.config.flags import file_settings
from refdl.config.mesh import MeshSpec
from refdl.config.paths import writable_file
from refdl.config.spec import (
    LAYOUT_KEYS,
    OUTPUT_KEYS,
    flag,
)
from refdl.errors import UsageError

# JAX (which the checkpoints, the strategies and the launcher's helpers import) loads inside
# the functions that need it, so a missing file or a bad value answers in well under 1 s.


def run_config(resume: str) -> tuple[Path | None, dict[str, Any] | None]:
    """The run folder ``--resume`` names (a run folder, its ``checkpoints``, or one of its
    checkpoints) and the settings it was started with (its ``config.json``; None when it
    has none). A damaged ``config.json`` is a one-line error, never a guess."""
    from refdl.run import checkpoint

    p = Path(resume)
    if checkpoint.is_checkpoint(p):
        folder = p.parent.parent
    elif p.name == "checkpoints":
        folder = p.parent
    else:
        folder = p
    record = folder / "config.json"
    if not record.exists():
        return (folder if (folder / "checkpoints").is_dir() else None), None
    config = load_json(record, "--resume: the run's")
    if not isinstance(config, dict):
        raise UsageError(f"--resume {resume}: {record} is not a table of settings")
    return folder, config


def resumed_settings(explicit: dict[str, Any]) -> dict[str, Any]:
    """With ``--resume``: the run's own settings, then the flags given again (which must
    agree on everything but how long and how loudly the run goes). The checkpoint is the
    newest intact one of the run's own configuration (its ``config.json``); where it
    writes, only the command line says."""
    from refdl.parallel import processes
    from refdl.run import checkpoint
    from refdl.run.checkpoint import config_key, differing

    folder, config = run_config(explicit["resume"])
    named = checkpoint.is_checkpoint(explicit["resume"])
    # the manifest only: the arrays are read (and verified) once the ranks have joined
    choice = checkpoint.resolve(explicit["resume"], None if named else config, arrays=False)
    path, saved = choice.path, choice.meta["spec"]
    if config is None and not named and processes.launched_rank() == 0:  # said, not guessed
        print(f"refdl.train: {folder}/config.json is missing: continuing with the settings "
              f"saved in {path}", file=sys.stderr, flush=True)  # fmt: skip
    if explicit.get("reshard"):
        return resharded_settings(explicit, path, saved)
    other = named and config is not None and config_key(config) != config_key(saved)
    if other and Path(explicit.get("out", folder)).resolve() == Path(folder).resolve():
        keys = ", ".join(differing(config, saved)[:4]) or "settings"
        raise UsageError(
            f"--resume {explicit['resume']}: this checkpoint's {keys} differ from those "
            f"{folder} was started with; continue it in another folder with --out DIR"
        )
    if processes.under_mpi() and "devices" not in explicit:
        explicit = {**explicit, "devices": processes.launched_size()}
    diff = differing(saved, explicit)
    if diff:
        parts = ", ".join(f"{flag(k)} {explicit[k]!r} (the run has {saved[k]!r})" for k in diff)
        layout = set(diff) <= set(LAYOUT_KEYS)
        other = "add --reshard to continue on this layout, " if layout else ""
        raise UsageError(
            f"--resume {explicit['resume']}: {parts}; drop these flags to continue the run as "
            f"it was started, {other}or start a new run without --resume"
        )
    # Where a run writes comes from the command line only, never from a file.
    base = {k: v for k, v in saved.items() if k not in OUTPUT_KEYS}
    if "out" not in explicit:
        explicit = {**explicit, "out": str(path.parent.parent)}
    return {**base, **explicit}


def holds_one_state(strategy: str, ps_mode: str | None = None) -> bool:
    """Whether ``strategy`` holds one state of the whole model (synchronous; no servers,
    no per-worker replicas): the states ``--reshard`` moves to another layout."""
    from refdl.strategies import traits_of

    t = traits_of(strategy)
    return not (t.replicas or t.has_servers or not t.synchronous_with(ps_mode))


def resharded_settings(
    explicit: dict[str, Any], path: Path, saved: dict[str, Any]
) -> dict[str, Any]:
    """``--resume RUN --reshard``: the checkpoint at ``path`` (written with settings
    ``saved``) continued under the layout the command line gives - strategy, devices, mesh,
    every strategy's options, recomputation (``LAYOUT_KEYS``; the saved strategy when none
    is given, the rest at their defaults) - while everything else must agree. Both
    strategies must be synchronous and hold one state (not ps or decentralized): then the
    trajectory goes on as one device's would, the data order included (a pure function of
    the seed, the step and the global batch, whatever the data-parallel degree)."""
    from refdl.parallel import processes
    from refdl.run.checkpoint import differing

    old = saved.get("strategy", "single")
    new = explicit.get("strategy", old)
    for name, whose in ((old, "the checkpoint's"), (new, "the new")):
        mode = saved.get("ps_mode") if name == old else explicit.get("ps_mode")
        if not holds_one_state(name, mode):
            raise UsageError(
                f"--reshard: {whose} strategy {name} does not hold one state of the whole "
                "model; resharding moves the state of single, data, fsdp, model, context, "
                "hybrid and pipeline runs"
            )
    base = {k: v for k, v in saved.items() if k not in OUTPUT_KEYS and k not in LAYOUT_KEYS}
    given = {k: v for k, v in explicit.items() if k not in LAYOUT_KEYS}
    diff = differing(base, given)
    if diff:
        parts = ", ".join(f"{flag(k)} {explicit[k]!r} (the run has {saved[k]!r})" for k in diff)
        raise UsageError(
            f"--resume {explicit['resume']} --reshard: {parts}; --reshard changes only where "
            "the state lives (strategy, devices, mesh, their options), drop these flags"
        )
    if processes.under_mpi() and "devices" not in explicit:
        explicit = {**explicit, "devices": processes.launched_size()}
    out = explicit.get("out", str(path.parent.parent))
    # the very checkpoint chosen, which the new layout's settings would not find by key
    return {**base, "strategy": new, **explicit, "resume": str(path), "out": out}


def choose_devices(settings: dict[str, Any], prog: str = "refdl.train") -> dict[str, Any]:
    """Decide the device count before JAX starts its backend: the ranks under mpirun; the
    main job's 8 simulated devices (or every accelerator) for a strategy that fills the host
    (``Traits.fills_host``: hybrid) given neither;
    the product of a ``--mesh`` given without ``--devices``; else ``--devices``."""
    from refdl.parallel import processes
    from refdl.strategies import traits_of

    if processes.under_mpi():  # one device per rank; the ranks are the devices
        processes.one_device_per_rank()
        return {"devices": processes.launched_size(), **settings}
    if "devices" not in settings and settings.get("mesh"):
        named = MeshSpec.devices_of(settings["mesh"])
        if named is not None:
            settings = {**settings, "devices": named}
    name = settings.get("strategy", "single")
    fills = traits_of(name).fills_host
    if fills and "devices" not in settings:
        processes.simulate_devices(8)  # takes effect on a CPU host only
        import jax

        n, backend = jax.device_count(), jax.default_backend()
        if backend == "cpu":  # the main job: data=2,model=2,pipe=2 on 8 simulated devices
            n = min(n, 8)
            mesh, where = (
                (MeshSpec.factor(n).text() if n >= 8 else None),
                f"{n} simulated CPU devices",
            )
        else:
            mesh, where = MeshSpec.factor(n).text(), f"{n} {backend} devices"
        if mesh:
            print(f"{prog}: {name} on {where}, mesh {mesh.replace(',', ' x ')}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return {**settings, "devices": n, "mesh": mesh}
        return {**settings, "devices": n}
    processes.simulate_devices(settings.get("devices"))
    return settings


def check_given_options(settings: dict[str, Any], given: set[str]) -> None:
    """A strategy's option given on the command line for another strategy is refused,
    even at its default value (``--zero 3`` with ``single`` would be silently ignored)."""
    from refdl.config.plan import check_options
    from refdl.strategies import STRATEGIES, declared_traits

    name = settings.get("strategy", "single")
    if name not in STRATEGIES.names():
        return  # refused with the list of strategies when the run is built
    owners = declared_traits()
    check_options(given, name, owners[name], owners)


def run_settings(given: dict[str, Any], config: str | None, prog: str) -> dict[str, Any]:
    """The settings a run starts with, from the flags ``given`` (and ``--config FILE``):
    a resumed run's own, the strategy's options checked against the flags, the device
    count decided (before JAX starts), the plot's file writable before the run."""
    if config:
        given = {**file_settings(config), **given}
    named = set(given)
    settings = resumed_settings(given) if "resume" in given else given
    check_given_options(settings, named)
    settings = choose_devices(settings, prog)
    if settings.get("plot_schedule") is not None:  # writable before the run, not after
        writable_file(settings["plot_schedule"], "--plot-schedule", (".png", ".pdf", ".svg"))
    return settings
