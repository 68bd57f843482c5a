"""A data set defined outside the package: registered by name, read by every strategy,
and trained on under ``data`` equal to ``single``.

    .venv/bin/python examples/custom_dataset.py

``load(**options)`` returns an ``ArrayDataset`` of NumPy arrays and a ``DataInfo`` that says
what a model needs to know (kind, input shape and dtype, classes, sizes). Registering it
makes it a ``--dataset`` like the built-in ones; its options are ``--data-opt KEY=VALUE``.
"""

from __future__ import annotations

from refdl.parallel.processes import simulate_devices

simulate_devices(4)  # 4 simulated CPU devices, set before JAX starts its backend

import numpy as np  # noqa: E402

import refdl  # noqa: E402
from refdl.config.values import Int, Option  # noqa: E402


def load_stripes(size: int = 8, n: int = 1200, seed: int = 0) -> refdl.ArrayDataset:
    """Images with a bright horizontal (class 0) or vertical (class 1) stripe, in noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n).astype(np.int32)
    x = rng.normal(0.0, 0.3, (n, size, size, 1)).astype(np.float32)
    at = rng.integers(0, size, n)
    for i in range(n):
        if y[i] == 0:
            x[i, at[i], :, 0] += 1.0
        else:
            x[i, :, at[i], 0] += 1.0
    cut = n * 4 // 5
    info = refdl.DataInfo("stripes", "image", (size, size, 1), "float32", 2, cut, n - cut)
    return refdl.ArrayDataset(info, (x[:cut], y[:cut]), (x[cut:], y[cut:]))


refdl.register_dataset(
    refdl.DatasetDef(
        name="stripes",
        load=load_stripes,
        kind="image",
        options={
            "size": Option(8, Int(4, 64), "image side"),
            "n": Option(1200, Int(10, 10**6), "examples (a fifth are the test set)"),
            "seed": Option(0, Int(0, 2**31 - 1), "seed of the images"),
        },
        doc="a user's striped images",
    )
)


def main() -> None:
    base = {"model": "mlp", "dataset": "stripes", "batch_size": 64, "progress": False}
    spec = refdl.RunSpec(strategy="data", devices=4, **base)
    diff = refdl.assert_equivalent(spec, steps=5, rtol=1e-5, atol=1e-6)
    print(f"stripes, mlp under data x4: equal to single over 5 steps ({diff})")
    final = refdl.RunSpec(strategy="data", devices=4, steps=100, eval_every=0, overwrite=True,
                          data_opts=(("size", "12"),), **base)  # fmt: skip
    summary = refdl.fit(final, out="runs/stripes")  # overwrite: the example can be rerun
    print(f"stripes 12x12, data x4, 100 steps: test accuracy {summary['test_accuracy']:.3f}")
    assert summary["test_accuracy"] > 0.9


if __name__ == "__main__":
    main()
