"""Fit the profiles' achieved figures to the calibration part of the published data set.

Reads ``docs/published/measurements.toml``, keeps the calibration part only, and
writes an ``[achieved]`` block at the end of each GPU profile and each network described
alone (replacing one that is there):

- per device (every profile with that device name) and op class / dtype, the
  fraction of peak FLOP/s ResNet-50-like calibration steps achieved, and per
  convolutional architecture its factor relative to ResNet-50 (``fit_steps``;
  the factors go to ``src/refdl/perf/architectures.toml``);
- per dated collective stack (``src/refdl/hw/stacks.toml``) and link kind, the latency
  and fraction of line rate that fit the calibration collectives of that stack, and the
  80 % bounds of their residuals (``fit_stacks``);
- per profile, library (``nccl``, ``mpi``, ``gloo``) and link the latency and fraction
  of line rate that fit the calibration collectives (``fit_links``); a profile or link
  with no calibration collective of that library takes the median of the library's
  fitted links of its kind (NVLink or PCIe inside a node, network between nodes), said
  in its source (no NCCL figures for a network without GPUs);
- per device and dtype, the fraction of peak that predicts the calibration part's
  ``parallel`` points (GPT-scale transformers on a stated layout) through
  ``refdl predict --strategy hybrid`` (op class ``transformer``,
  ``refdl.bench.parallel_points.fit``), with the links' fitted figures;
- memory: 0.9 of the datasheet bandwidth (a device-to-device copy on the lent H100
  moved 3.0 of 3.35 TB/s, ``/work/.library/device/KINDS.md``, 2026-11-13).

    .venv/bin/python scripts/fit_achieved.py [--data docs/published/measurements.toml]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import tomllib
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from refdl import hw
from refdl.bench import parallel_points
from refdl.bench.published import (
    DATA,
    PRECISION,
    REFERENCE_MODEL,
    _library,
    fit_links,
    fit_stacks,
    fit_steps,
    load,
)
from refdl.hw.profile import LIBRARIES
from refdl.perf import architectures

PROFILES = Path(__file__).resolve().parents[1] / "src" / "refdl" / "hw" / "profiles"
STACKS = PROFILES.parent / "stacks.toml"
MEMORY = 0.9
CPU = ("local", "xeon-e5-2680v2-fdr", "knl-omnipath")


def write_stacks(fits: dict, today: str) -> None:
    """``stacks.toml`` again: its comment header and each stack's library, years,
    description and rings as they are, with the fitted ``[links.<kind>]`` (figures and
    the 80 % bounds of their residuals)."""
    text = STACKS.read_text()
    head = [line for line in text.splitlines() if line.startswith("#")]
    lines = head[: next((i for i, x in enumerate(head) if not x.strip("# ")), len(head))]
    for name, s in tomllib.loads(text).get("stack", {}).items():
        lines += ["", f'[stack."{name}"]']
        lines += [f"{k} = {json.dumps(s[k])}" for k in ("library", "years", "description", "rings")
                  if k in s]  # fmt: skip
        for (stack, kind), v in fits.items():
            if stack != name:
                continue
            lines += ["", f'[stack."{name}".links.{kind}]',
                      f"latency_s = {v['latency_s']:.4g}", f"fraction = {v['fraction']:.4g}",
                      f"points = {v['points']}",
                      f'source = "scripts/fit_achieved.py, {today}: {v["points"]} calibration '
                      f'collectives ({", ".join(v["sources"])})"']  # fmt: skip
            if math.isfinite(v["log_q10"] + v["log_q90"]):
                lines += [f"log_q10 = {v['log_q10']:.4g}", f"log_q90 = {v['log_q90']:.4g}"]
    STACKS.write_text("\n".join(lines) + "\n")


def default_library(p, links: dict) -> str:
    """The library a profile's predictions assume: the one its calibration collectives
    ran (most points), else NCCL on a GPU machine and MPI on a network described alone."""
    mine = {lib: v["points"] for (name, lib, _), v in links.items() if name == p.name}
    if mine:
        return max(sorted(mine), key=mine.get)
    return "mpi" if p.device is None else "nccl"


def block(name: str, devices: dict, links: dict, medians: dict, today: str) -> str:
    p = hw.load(name)
    lines = ["[achieved]", f'library = "{default_library(p, links)}"']
    if p.device is not None:
        lines += ["", "[achieved.device]"]
        by_class: dict[str, dict[str, float]] = {}
        used = []
        for (dev, cls, dtype), v in devices.items():
            if dev == p.device.name:
                by_class.setdefault(cls, {})[dtype] = round(v["fraction"], 4)
                used.append(f"{cls}/{dtype} from {v['points']} points ({', '.join(v['sources'])})")
        for cls, table in sorted(by_class.items()):
            lines.append(f"{cls} = {{ " + ", ".join(f"{k} = {x}" for k, x in table.items()) + " }")
        none = "none on this device: peaks (no fraction) until a calibration point exists"
        src = (
            "fraction of peak FLOP/s achieved by the calibration part's single-device steps "
            f"(scripts/fit_achieved.py, {today}): " + ("; ".join(used) if used else none)
        )
        lines += [f"memory = {MEMORY}", f'source = "{src}; memory 0.9 of datasheet '
                  '(D2D copy 3.0 of 3.35 TB/s on the lent H100, 2026-11-13)"']  # fmt: skip
    for lib in LIBRARIES:
        if lib == "nccl" and p.device is None:  # NCCL runs between GPUs
            continue
        for level in p.links:
            key = (name, lib, level)
            if key in links:
                v = links[key]
                used = ", ".join(v["sources"])
                src = (f"fitted to {v['points']} calibration collectives ({used}) "
                       f"by scripts/fit_achieved.py, {today}")  # fmt: skip
                lat, frac = v["latency_s"], v["fraction"]
            else:
                kind = p.link_kind(level)
                if (lib, kind) not in medians:
                    continue
                m = medians[(lib, kind)]
                lat = max(m["latency_s"], p.links[level].latency_s)
                frac = m["fraction"]
                src = (
                    f"no {lib} calibration collective on this link: the median of the fitted "
                    f"{kind} links ({m['names']}), scripts/fit_achieved.py, {today}"
                )
            lines += ["", f"[achieved.{lib}.{level}]", f"latency_s = {lat:.4g}",
                      f"fraction = {frac:.4g}", f'source = "{src}"']  # fmt: skip
    return "\n".join(lines) + "\n"


def write(devices: dict, links: dict, medians: dict, today: str) -> None:
    """Each GPU profile's and network's ``[achieved]`` block, in place of the old one."""
    for name in hw.names():
        if name in CPU:
            continue
        path = PROFILES / f"{name}.toml"
        text = path.read_text()
        if "\n[achieved]" in text:
            text = text[: text.index("\n[achieved]") + 1]
        path.write_text(text.rstrip("\n") + "\n\n" + block(name, devices, links, medians, today))
        print(f"{name}: written", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args(argv)
    points, _ = load(args.data)
    for name in hw.names():  # fit against the peaks alone: drop old blocks first
        path = PROFILES / f"{name}.toml"
        text = path.read_text()
        if "\n[achieved]" in text:
            path.write_text(text[: text.index("\n[achieved]") + 1])
    devices, models = fit_steps(points)
    today = datetime.date.today().isoformat()
    lines = [
        f"# Written by scripts/fit_achieved.py on {today} from the calibration part of",
        "# docs/published/measurements.toml: an architecture's achieved fraction of",
        f"# peak relative to {REFERENCE_MODEL}'s on one device (refdl.perf.architectures)",
    ]
    for name, v in models.items():
        lines += [
            "",
            f"[model.{name}]",
            f"factor = {v['factor']:.4g}",
            f'source = "{v["points"]} calibration steps ({", ".join(v["sources"])})"',
        ]
    architectures.FILE.write_text("\n".join(lines) + "\n")
    links = fit_links(points)
    medians = {}
    for (name, lib, level), v in links.items():
        medians.setdefault((lib, hw.load(name).link_kind(level)), []).append((name, v))
    medians = {
        k: {"latency_s": median(v["latency_s"] for _, v in vs),
            "fraction": median(v["fraction"] for _, v in vs),
            "names": ", ".join(n for n, _ in vs)}
        for k, vs in medians.items()
    }  # fmt: skip
    write(devices, links, medians, today)
    stack_fits = fit_stacks(points)
    write_stacks(stack_fits, today)
    # large transformer layers: the parallel points predicted with the links just written
    # (the device fraction is the fit's variable), then written beside the others
    devices.update(parallel_points.fit(points, PRECISION, _library))
    write(devices, links, medians, today)
    for k, v in devices.items():
        print(f"device {k}: {v['fraction']:.3f} ({v['points']} points)")
    for k, v in models.items():
        print(f"architecture {k}: {v['factor']:.3f} ({v['points']} points)")
    for k, v in links.items():
        print(f"link {k}: latency {v['latency_s']:.3g} s, fraction {v['fraction']:.3f} "
              f"({v['points']} points)")  # fmt: skip
    for k, v in stack_fits.items():
        print(
            f"stack {k}: latency {v['latency_s']:.3g} s, fraction {v['fraction']:.3f} "
            f"({v['points']} points, residuals {v['log_q10']:.3f} .. {v['log_q90']:.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
