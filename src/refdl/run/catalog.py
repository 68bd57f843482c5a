"""What can be trained: the strategies, models and data sets registered, as ``--list`` shows."""

from __future__ import annotations

from refdl.config.mesh import AXES
from refdl.data import DATASETS
from refdl.models import MODELS
from refdl.strategies import STRATEGIES


def print_list() -> None:
    """Each strategy (its mesh axes and options), model (its recipe and options) and data
    set, a line each."""
    print("strategies (mesh axes; options):")
    for name in STRATEGIES.names():
        t = STRATEGIES.get(name).traits
        axes = ",".join(t.axes) or ("workers" if t.replicas else "one device")
        opts = " ".join(sorted("--" + o.replace("_", "-") for o in t.options)) or "-"
        print(f"  {name:13s} {axes}; {opts}")
    print(f"mesh axes: {', '.join(AXES)} (--mesh AXIS=N,... over a strategy's axes)")
    print("models:")
    for name in MODELS.names():
        m = MODELS.get(name)
        opts = ", ".join(f"{k}={v}" for k, v in m.defaults_of_options().items())
        trains = ", ".join(f"{k} {v}" for k, v in m.defaults.items())
        print(f"  {name:12s} {m.doc} [{m.data_kind}] trains with: {trains}; options: {opts}")
    print("data sets:")
    for name in DATASETS.names():
        d = DATASETS.get(name)
        opts = ", ".join(f"{k}={v}" for k, v in d.defaults_of_options().items()) or "none"
        print(
            f"  {name:14s} {d.doc}{' (needs --data-dir)' if d.needs_dir else ''}; options: {opts}"
        )
