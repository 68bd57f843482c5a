"""Published configuration searches: several layouts of one model on one machine, and
which one the source found fastest - does refdl's cost model choose as it did?

Two kinds, both in the published data set:

- *measured*: ``parallel`` points carrying a ``search`` id; a search is the points of one
  id at one worker count and one global batch (the rest of the layout varies), each with
  its measured time. Reported: the rank refdl's prediction gives the measured best,
  Kendall's tau between predicted and measured times, both over distinct configurations
  (one the source ran twice stands at its faster run); the points' intervals count in the
  ``parallel`` kind's coverage like any other point's.
- *stated*: ``[[search]]`` tables, where the source says which of its candidates was
  fastest but prints no numbers (e.g. Narayanan et al. 2021, Figures 12-17): the
  candidates (layout changes over a base layout) and the index of the fastest.

A search's part is its source's (``[split]``); no fit reads a search (the stated ones
have no numbers; the measured points of a calibration source are marked ``fit =
false``), so the held-out part judges the ranking on cases it was not tuned on.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import mean
from typing import Any

from refdl.bench.parallel_points import check_grad_reduce
from refdl.config.mesh import MeshSpec
from refdl.errors import UsageError
from refdl.perf.search import TIE_BAND, layout_plainness

TIE_SOURCE = "bigscience_tr11_prequel"  # the searches TIE_BAND was set from

SEARCH_KEYS = {"id", "source", "where", "quote", "hw", "library", "model", "workers", "nodes",
               "precision", "base", "candidates", "best", "note"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Stated:
    """A search whose source states the fastest candidate (a ``[[search]]`` table)."""

    id: str
    source: str
    part: str
    hw: str
    library: str
    model: str
    workers: int
    nodes: int
    precision: str
    base: dict
    candidates: list[dict]
    best: int


def load_stated(
    raw: list[dict[str, Any]], parts: dict[str, str], path: str,
    inherited: dict[str, dict[str, Any]] | None = None,
) -> list[Stated]:  # fmt: skip
    """The data set's ``[[search]]`` tables, checked; each base takes what its source
    states for every layout (``inherited``: its gradient-reduction precision)."""
    out = []
    for t in raw:
        sid = t.get("id", "?")
        if set(t) - SEARCH_KEYS or t.get("source") not in parts:
            raise UsageError(f"--data {path}: search {sid!r} has an unknown source or keys "
                             f"other than {', '.join(sorted(SEARCH_KEYS))}")  # fmt: skip
        cands = t.get("candidates") or []
        for lay in (t.get("base", {}), *cands):
            check_grad_reduce(lay, f"--data {path}: search {sid!r}")
        best = t.get("best")
        if len(cands) < 2 or not isinstance(best, int) or not 0 <= best < len(cands):
            raise UsageError(f"--data {path}: search {sid!r} needs 2+ candidates and the "
                             "index of the fastest (best)")  # fmt: skip
        out.append(Stated(sid, t["source"], parts[t["source"]], t["hw"], t.get("library", ""),
                          t["model"], int(t["workers"]), int(t.get("nodes", 1)),
                          t["precision"],
                          {**(inherited or {}).get(t["source"], {}), **t.get("base", {})},
                          [dict(c) for c in cands],
                          best))  # fmt: skip
    return out


def kendall_tau_b(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b (ties in either sample count as neither agreeing nor not)."""
    c = d = tx = ty = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                c += 1
            else:
                d += 1
    den = ((c + d + tx) * (c + d + ty)) ** 0.5
    return (c - d) / den if den else None


def rank_of(predicted: list[float], index: int) -> int:
    """Candidate ``index``'s place in refdl's order: 1 + how many others it predicts as
    fast or faster (a tie counts against it)."""
    return 1 + sum(t <= predicted[index] for i, t in enumerate(predicted) if i != index)


def plain_rank(layouts: list[dict[str, Any]], predicted: list[float], best: int) -> int:
    """Candidate ``best``'s place in ``refdl plan``'s order: the tie set first, simplest
    first (``refdl.perf.search.plainness``: fewer mesh axes, plainer schedule, less
    recomputation, then the step; less its memory headroom, since every candidate here
    ran), then the others fastest first."""
    top = min(predicted) * TIE_BAND

    def key(i: int) -> tuple:
        lay = layouts[i]
        plain = layout_plainness(MeshSpec.parse(lay["mesh"]), lay.get("schedule", "1f1b"),
                                 lay.get("remat", "none"))  # fmt: skip
        return (0, *plain, predicted[i]) if predicted[i] <= top else (1, 0, 0, 0, predicted[i])

    return 1 + sorted(range(len(predicted)), key=key).index(best)


def distinct(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A search's candidates: one row per configuration (the same layout priced the same),
    a configuration the source ran more than once standing at its fastest run - a
    configuration cannot rank behind itself."""
    fastest: dict[tuple[str, float], dict[str, Any]] = {}
    for r in rows:
        key = (r["layout_text"], r["predicted"])
        if key not in fastest or r["published"] < fastest[key]["published"]:
            fastest[key] = r
    return list(fastest.values())


def measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured search (rows of predicted points with a ``search_key``): the
    measured best, the rank refdl gives it and Kendall's tau over its distinct
    configurations (``distinct``); the pairs' log errors over every run, repeats
    included (their spread is part of what a tie band must hold)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("search_key") and "predicted" in r:
            groups.setdefault(r["search_key"], []).append(r)
    out = []
    for key, runs in sorted(groups.items()):
        rs = distinct(runs)
        if len(rs) < 2:
            continue
        pub = [r["published"] for r in rs]
        pred = [r["predicted"] for r in rs]
        best = pub.index(min(pub))
        pairs = [abs(math.log(a["predicted"] / b["predicted"])
                     - math.log(a["published"] / b["published"]))
                 for i, a in enumerate(runs) for b in runs[i + 1:]]  # fmt: skip
        out.append({"search": key, "kind": "measured", "part": rs[0]["part"],
                    "source": rs[0]["source"], "candidates": len(rs), "runs": len(runs),
                    "best": rs[best]["layout_text"], "refdl_rank_of_best": rank_of(pred, best),
                    "refdl_plain_rank_of_best": plain_rank([r["layout"] for r in rs], pred,
                                                           best),
                    "refdl_first": rs[pred.index(min(pred))]["layout_text"],
                    "kendall_tau_b": kendall_tau_b(pred, pub), **ties(pred, best),
                    "pair_log_errors": pairs})  # fmt: skip
    return out


def stated(searches: list[Stated], predict: Any) -> list[dict[str, Any]]:
    """Each stated search: the rank refdl gives the source's fastest candidate.
    ``predict(search, layout) -> seconds`` (``refdl.bench.published``)."""
    out = []
    for s in searches:
        row = {"search": s.id, "kind": "stated", "part": s.part, "source": s.source,
               "candidates": len(s.candidates)}  # fmt: skip
        try:
            pred = [predict(s, {**s.base, **c}) for c in s.candidates]
        except UsageError as e:
            out.append({**row, "skipped": str(e)})
            continue
        text = [", ".join(f"{k}={v}" for k, v in c.items()) for c in s.candidates]
        lays = [{**s.base, **c} for c in s.candidates]
        out.append({**row, "best": text[s.best], "refdl_rank_of_best": rank_of(pred, s.best),
                    "refdl_plain_rank_of_best": plain_rank(lays, pred, s.best),
                    "refdl_first": text[pred.index(min(pred))], **ties(pred, s.best)})  # fmt: skip
    return out


def ties(predicted: list[float], best: int) -> dict[str, Any]:
    """The candidates refdl plan would call indistinguishable from its fastest (within
    ``TIE_BAND``): whether the source's fastest is among them, and how many they are."""
    top = min(predicted) * TIE_BAND
    return {"best_in_tie_set": predicted[best] <= top,
            "tie_set": sum(t <= top for t in predicted)}  # fmt: skip


def tie_check(results: list[dict[str, Any]]) -> dict[str, Any]:
    """``TIE_BAND`` judged on the searches it was not set from (all but ``TIE_SOURCE``'s):
    how often the source's fastest lies in the tie set, the set's share of the
    candidates, and the share of measured pairs whose ratio the band holds."""
    held = [r for r in results if r.get("source") != TIE_SOURCE and "best_in_tie_set" in r]
    pairs = [e for r in held for e in r.get("pair_log_errors", [])]
    band = math.log(TIE_BAND)
    return {
        "tie_band": TIE_BAND,
        "set_from": TIE_SOURCE,
        "searches": len(held),
        "best_in_tie_set": _share([r["best_in_tie_set"] for r in held]),
        "mean_tie_set_share": mean(r["tie_set"] / r["candidates"] for r in held) if held else None,
        "pairs": len(pairs),
        "pairs_within_band": _share([e <= band for e in pairs]),
    }


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per part: searches ranked, how often the source's fastest is refdl's first and in
    its first three (also among searches of more than three candidates alone), the mean
    Kendall's tau of the measured ones."""
    out: dict[str, Any] = {}
    for part in ("calibration", "heldout"):
        done = [r for r in results if r["part"] == part and "refdl_rank_of_best" in r]
        wide = [r for r in done if r["candidates"] > 3]
        taus = [r["kendall_tau_b"] for r in done if r.get("kendall_tau_b") is not None]
        out[part] = {
            "searches": len(done),
            "measured": sum(r["kind"] == "measured" for r in done),
            "stated": sum(r["kind"] == "stated" for r in done),
            "best_is_first": _share([r["refdl_rank_of_best"] == 1 for r in done]),
            "best_in_top3": _share([r["refdl_rank_of_best"] <= 3 for r in done]),
            "wide_searches": len(wide),
            "wide_best_in_top3": _share([r["refdl_rank_of_best"] <= 3 for r in wide]),
            "mean_kendall_tau_b": mean(taus) if taus else None,
            # the same in refdl plan's order (the tie set simplest first: plain_rank)
            "plain_best_is_first": _share([r["refdl_plain_rank_of_best"] == 1 for r in done]),
            "plain_best_in_top3": _share([r["refdl_plain_rank_of_best"] <= 3 for r in done]),
        }
    out["skipped"] = [r["search"] for r in results if "skipped" in r]
    out["ties"] = tie_check(results)
    return out


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None
