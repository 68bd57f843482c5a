"""Synthetic data for throughput runs: random inputs of a chosen shape.

Example ``i`` is generated from ``(seed, i)`` alone, so batches are
deterministic and nothing is stored; ``shape`` picks MNIST-, CIFAR- or
ImageNet-like images, or token sequences. Labels are random: nothing is
learnable, only speed is measured.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from refdl.config.values import Choice, Int, Option
from refdl.data.base import DataInfo, Dataset, DatasetDef, register
from refdl.errors import UsageError

SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "mnist": ((28, 28, 1), 10),
    "cifar": ((32, 32, 3), 10),
    "imagenet": ((224, 224, 3), 1000),
}


class SyntheticDataset(Dataset):
    """Random images (standard normal) or tokens (uniform), reproducible per index."""

    def __init__(
        self, shape: str = "mnist", size: int = 50_000, seq_len: int = 64, vocab: int = 256
    ) -> None:
        if shape == "tokens":
            input_shape, classes, kind, dtype = (seq_len,), vocab, "tokens", "int32"
        elif shape in SHAPES:
            input_shape, classes = SHAPES[shape]
            kind, dtype = "image", "float32"
        else:
            raise UsageError(
                f"synthetic: unknown shape {shape!r}; choose one of: "
                f"{', '.join([*SHAPES, 'tokens'])}"
            )
        if size <= 0:
            raise UsageError(f"synthetic: size must be > 0 (got {size})")
        self.seed = 1234
        self.test_size = min(1024, size)
        self.info = DataInfo(
            f"synthetic-{shape}", kind, input_shape, dtype, classes, size, self.test_size
        )

    def _examples(self, indices: np.ndarray, offset: int) -> dict[str, np.ndarray]:
        info = self.info
        xs, ys = [], []
        for i in np.asarray(indices):
            rng = np.random.default_rng([self.seed, offset, int(i)])
            if info.kind == "tokens":
                seq = rng.integers(0, info.num_classes, info.input_shape[0] + 1, dtype=np.int32)
                xs.append(seq[:-1])
                ys.append(seq[1:])
            else:
                xs.append(rng.standard_normal(info.input_shape, dtype=np.float32))
                ys.append(np.int32(rng.integers(0, info.num_classes)))
        return {"x": np.stack(xs), "y": np.stack(ys).astype(np.int32)}

    def train_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return self._examples(indices, 0)

    def test_batches(self, chunk: int = 512) -> Iterator[dict[str, np.ndarray]]:
        for i in range(0, self.test_size, chunk):
            yield self._examples(np.arange(i, min(i + chunk, self.test_size)), 1)


register(
    DatasetDef(
        "synthetic",
        SyntheticDataset,
        "image",
        {
            "shape": Option("mnist", Choice((*SHAPES, "tokens")), "input shape"),
            "size": Option(50_000, Int(1, 10**9), "training examples"),
            "seq_len": Option(64, Int(1, 1 << 16), "tokens: sequence length"),
            "vocab": Option(256, Int(2, 1 << 20), "tokens: vocabulary size"),
        },
        doc="random inputs: --data-opt shape=mnist|cifar|imagenet|tokens",
    )
)
