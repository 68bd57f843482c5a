"""A model defined outside the package, trained under single, data, model and pipeline,
and checked equal to the single-device reference with ``refdl.assert_equivalent``.

    .venv/bin/python examples/custom_model.py

The model is written for one device with refdl's layers; each parameter carries
logical axis names (``embed``, ``mlp``, ``conv_out``), and the strategies split
along them. Registering it makes it a ``--model`` like the built-in ones.
"""

from __future__ import annotations

from refdl.parallel.processes import simulate_devices

simulate_devices(8)  # 8 simulated CPU devices, set before JAX starts its backend

import refdl  # noqa: E402
from refdl.config.values import Int, Option  # noqa: E402
from refdl.core.layers import Conv, Dense, Flatten, Pool, Sequential  # noqa: E402


def build(info, width: int = 8, hidden: int = 32) -> Sequential:
    """conv 3x3 -> max pool -> flatten -> dense (column split) -> classifier (row split)."""
    return Sequential((
        Conv(width, (3, 3), act="relu"),
        Pool("max", 2, 2, "SAME"),
        Flatten(),
        Dense(hidden, "embed", "mlp", act="relu"),
        Dense(info.num_classes, "mlp", None),
    ))  # fmt: skip


refdl.register_model(
    refdl.ModelDef(
        name="tiny_cnn",
        build=build,
        data_kind="image",
        options={
            "width": Option(8, Int(1, 256), "convolution features"),
            "hidden": Option(32, Int(1, 4096), "hidden units"),
        },
        defaults={"optimizer": "momentum", "lr": 0.05, "dataset": "digits"},
        doc="a user's tiny CNN",
    )
)


def main() -> None:
    base = {"model": "tiny_cnn", "batch_size": 32, "progress": False}
    for strategy, kw in [
        ("data", {"devices": 4}),
        ("model", {"devices": 2}),
        ("pipeline", {"devices": 2, "microbatches": 4}),
        ("hybrid", {"devices": 8, "mesh": "data=2,model=2,pipe=2", "microbatches": 2}),
    ]:
        spec = refdl.RunSpec(strategy=strategy, **base, **kw)
        diff = refdl.assert_equivalent(spec, steps=5, rtol=1e-5, atol=1e-6)
        print(f"tiny_cnn {strategy:8s} {kw}: equal to single over 5 steps ({diff})")
    final = refdl.RunSpec(strategy="single", steps=200, eval_every=0, overwrite=True, **base)
    summary = refdl.fit(final, out="runs/tiny_cnn")  # overwrite: the example can be rerun
    print(f"tiny_cnn single, 200 steps: test accuracy {summary['test_accuracy']:.3f}")
    assert summary["test_accuracy"] > 0.9


if __name__ == "__main__":
    main()
