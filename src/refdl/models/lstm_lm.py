"""LSTM language model after Zaremba et al. 2014 ("small": 2 layers x 200 units, 20 steps).

Embedding -> LSTM x layers -> linear decoder over the vocabulary. Sequences
are independent windows with a zero initial state (the data order is random
windows, not a continuous stream), and no dropout, as in the "small" setting.
"""

from __future__ import annotations

from refdl.config.values import Int, Option
from refdl.core.layers import LSTM, Dense, Embed, Sequential
from refdl.models.base import ModelDef, register


def build(info, hidden: int = 200, layers: int = 2) -> Sequential:
    """``Embed(vocab, hidden) -> LSTM(hidden) x layers -> Dense(vocab)``."""
    seq = [Embed(info.num_classes, hidden)]
    seq += [LSTM(hidden) for _ in range(layers)]
    seq.append(Dense(info.num_classes, "embed", "vocab"))
    return Sequential(tuple(seq))


LSTM_LM = register(
    ModelDef(
        name="lstm_lm",
        build=build,
        data_kind="tokens",
        options={
            "hidden": Option(200, Int(1, 1 << 16), "units per LSTM layer"),
            "layers": Option(2, Int(1, 64), "LSTM layers"),
        },
        defaults={"optimizer": "adam", "lr": 0.003, "dataset": "pytext"},
        doc="LSTM language model (Zaremba et al., 2x200)",
    )
)
