"""Prediction intervals: how far a prediction is from what was measured, stated with it.

A prediction's error on the published data set's **calibration** part (the part the
profiles' achieved figures were fitted to, never the held-out one) gives, per kind of
prediction, split-conformal 80 % bounds ``q10, q90`` of ``log(measured / predicted)``
(times of collectives and steps; steps predicted by a fit that leaves their source out)
or of ``measured - predicted`` (scaling efficiencies, in points): order statistics
chosen so a new exchangeable error falls between them with probability >= 0.8. The
stated interval of a new prediction ``t`` is ``[t e^q10, t e^q90]``.
Where the figure a prediction rests on is **borrowed** - a link whose achieved figures
are the median of other fitted links because none of its own collectives was in the
calibration part, or a device with no achieved fraction for the dtype - the interval
is widened on both sides by half the log-range of the fitted figures it was borrowed
from (how far apart the links it could have been are). ``refdl bench published``
measures the intervals' coverage and width on the held-out points.

A transformer's step on a device whose ``transformer`` fraction was fitted (its own,
not borrowed) states the ``transformer`` kind's interval: its residuals are those of
GPT-scale runs on stated layouts predicted with that fraction, not those of
convolutional steps (``step_kind``).

``intervals.toml`` is written by ``scripts/fit_intervals.py`` from the calibration part.
"""

from __future__ import annotations

import functools
import math
import tomllib
from pathlib import Path
from typing import Any

PATH = Path(__file__).with_name("intervals.toml")
LEVEL = 0.8  # the stated coverage
KINDS = ("collective", "step", "transformer", "scaling")
TRANSFORMER = "transformer"  # the op class, and the interval kind, of GPT-scale layers


def step_kind(profile: Any, dtype: str, op_class: str) -> tuple[str, bool]:
    """(interval kind, borrowed) of a step of ``op_class`` in ``dtype`` on ``profile``:
    ``transformer`` where the profile's own transformer fraction of that dtype (or its
    16-bit twin) prices it and the kind was fitted with finite bounds; a transformer
    without that fraction is ``step``, borrowed (another class's fraction stands in, as
    ``refdl bench published`` judges it); any other class is ``step``, borrowed where
    the device has no fraction of that dtype at all."""
    if profile.device is None:
        return "step", True
    if op_class != TRANSFORMER:
        return "step", profile.borrowed_device(dtype)
    if profile.borrowed_device(dtype, TRANSFORMER):  # another class's fraction stands in
        return "step", True
    q = table().get(TRANSFORMER, {})
    finite = all(math.isfinite(q.get(k, math.inf)) for k in ("log_q10", "log_q90"))
    return (TRANSFORMER, False) if finite else ("step", False)


@functools.cache
def table() -> dict[str, Any]:
    """``intervals.toml``'s per-kind quantiles (empty when it was never fitted)."""
    try:
        return tomllib.loads(PATH.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def time_interval(
    kind: str, t: float, borrowed: bool = False, own: Any = None
) -> tuple[float, float] | None:
    """The stated interval of a predicted time ``t`` of ``kind`` (collective, step or
    transformer),
    or None when no interval was fitted for that kind. A dated collective stack's own
    figures on the link (``own``, a ``refdl.hw.stacks.StackLink``) state their own
    residuals' bounds."""
    q = table().get(kind)
    if not q:
        return None
    if own is not None and own.log_q10 is not None and not borrowed:
        return t * math.exp(own.log_q10), t * math.exp(own.log_q90)
    widen = q.get("borrowed_log_spread", 0.0) if borrowed else 0.0
    return t * math.exp(q["log_q10"] - widen), t * math.exp(q["log_q90"] + widen)


def efficiency_interval(e: float) -> tuple[float, float] | None:
    """The stated interval of a predicted scaling efficiency ``e`` (points added)."""
    q = table().get("scaling")
    if not q:
        return None
    return max(0.0, e + q["q10"]), e + q["q90"]
