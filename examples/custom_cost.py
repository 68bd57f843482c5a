"""The cost of a custom model predicted on a paper profile, without training it.

    .venv/bin/python examples/custom_cost.py

A shape-only model is a flax module; refdl reads its parameters and its training
step's FLOPs and bytes from shapes alone (nothing is allocated), and predicts the
step time, throughput and scaling of a strategy on a hardware profile.
"""

from __future__ import annotations

import flax.linen as nn

import refdl


@refdl.register_shape_model("wide_mlp", input_shape=(784,), outputs=10,
                            doc="a 784-8192-8192-10 MLP")  # fmt: skip
def wide_mlp() -> nn.Module:
    class WideMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(8192)(x))
            x = nn.relu(nn.Dense(8192)(x))
            return nn.Dense(10)(x)

    return WideMLP()


def main() -> None:
    w1, w2, w3 = 784 * 8192, 8192 * 8192, 8192 * 10
    params = w1 + w2 + w3 + 8192 + 8192 + 10
    rows = refdl.predict_steps("v100-nvlink", "data", "wide_mlp", batch_size=256,
                               workers=[1, 2, 4, 8])  # fmt: skip
    print(f"wide_mlp ({rows[0]['params'] / 1e6:.1f} M parameters), data parallel on "
          "v100-nvlink, global batch 256:")  # fmt: skip
    for r in rows:
        print(f"  P={r['workers']}: step {r['step_time_s'] * 1e3:7.3f} ms "
              f"(compute {r['compute_s'] * 1e3:.3f}, comm {r['comm_s'] * 1e3:.3f}), "
              f"{r['throughput']:9.0f} samples/s, efficiency {r['efficiency']:.2f}")  # fmt: skip
    assert rows[0]["params"] == params
    # 2 FLOPs per multiply-add: forward and weight gradient of each product, input gradient
    # of the last two (the data needs none); XLA's count adds the small elementwise work
    products = 256 * 2 * (2 * w1 + 3 * w2 + 3 * w3)
    assert abs(rows[0]["flops_per_device"] / products - 1) < 0.02
    assert rows[-1]["comm_s"] > 0 and rows[0]["comm_s"] == 0


if __name__ == "__main__":
    main()
