"""``Compression``: what ``--compress`` asks for, parsed once from its text.

``topk:RATIO`` (with ``,q8``/``,q4``: the sparse allreduce's value bits),
``qsgd:LEVELS``, ``terngrad`` or ``sign``; the quantizers take
``,rounding=stochastic|nearest``. ``refdl.comm.compress.Codec`` runs it; the checks
and the performance model read its fields, never the text.
"""

from __future__ import annotations

import dataclasses

from refdl.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Compression:
    """One compression scheme; ``kind`` is topk, qsgd, terngrad or sign."""

    kind: str
    ratio: float = 0.01
    levels: int = 16
    rounding: str = "stochastic"  # the quantizers': stochastic (unbiased) or nearest
    bits: int = 32  # topk's value bits in a sparse allreduce: 32, 8 or 4
    given: str = dataclasses.field(default="", compare=False, repr=False)  # the flag's text

    def __str__(self) -> str:
        return self.given or self.kind

    @property
    def topk(self) -> bool:
        """Whether it sends the top-k pairs (what a sparse allreduce sums)."""
        return self.kind == "topk"

    @property
    def error_feedback(self) -> bool:
        """Biased codecs (topk, sign, a quantizer rounding to nearest) keep a residual;
        unbiased ones (qsgd, terngrad with stochastic rounding) do not: feeding back their
        zero-mean noise makes it compound (qsgd:4 diverged with it)."""
        return self.kind in ("topk", "sign") or self.rounding == "nearest"

    @classmethod
    def parse(cls, text: str) -> Compression:
        """``--compress`` text; anything else is a one-line error.

        >>> Compression.parse("topk:0.01,q4").bits, Compression.parse("qsgd:8").levels
        (4, 8)
        """
        text = str(text)
        head, *opts = text.split(",")
        kind, _, arg = head.partition(":")
        rounding, bits = "stochastic", 32
        seen: set[str] = set()
        for opt in opts:
            what = "a value width (q8, q4)" if opt in ("q8", "q4") else opt.partition("=")[0]
            if what in seen:  # the last would win silently
                raise UsageError(f"--compress {text!r}: {what} given twice; give it once")
            seen.add(what)
            if opt in ("q8", "q4") and kind == "topk":
                bits = int(opt[1:])
                continue
            if opt in ("q8", "q4"):
                raise UsageError(f"--compress {text!r}: {opt} sets the width of topk's kept "
                                 "values; the other codecs have none")  # fmt: skip
            key, _, value = opt.partition("=")
            if key != "rounding" or value not in ("stochastic", "nearest"):
                raise UsageError(f"--compress {text!r}: {opt!r} is not rounding=stochastic, "
                                 "rounding=nearest or (topk's) q8, q4")  # fmt: skip
            if kind not in ("qsgd", "terngrad"):
                raise UsageError(f"--compress {text!r}: rounding is an option of the "
                                 "quantizers (qsgd, terngrad)")  # fmt: skip
            rounding = value
        try:
            if kind == "topk":
                ratio = float(arg)
                if not 0 < ratio <= 1:
                    raise ValueError
                return cls("topk", ratio=ratio, bits=bits, given=text)
            if kind == "qsgd":
                levels = int(arg)
                if not 1 <= levels <= 127:
                    raise ValueError
                return cls("qsgd", levels=levels, rounding=rounding, given=text)
            if kind in ("terngrad", "sign") and not arg:
                return cls(kind, rounding=rounding, given=text)
        except ValueError:
            pass
        raise UsageError(
            f"--compress {text!r}: use topk:RATIO (0 < RATIO <= 1), qsgd:LEVELS (1..127), "
            "terngrad or sign; the quantizers take ,rounding=stochastic|nearest, topk ,q8 or ,q4"
        )
