"""Bytes communicated by a compiled program, counted from the collectives it contains.

We read the optimized HLO (``compiled.as_text()``) and, for every collective,
charge the bytes a device sends, summed over all devices:

- ``collective-permute`` (ppermute): buffer bytes x number of source->target pairs;
- ``all-reduce`` over groups of g: ``2(g-1)/g`` x buffer per device (the ring's
  bytes; XLA's algorithm is opaque, nccl-tests charge the same);
- ``all-gather`` (result n): ``(g-1)/g·n`` per device; ``reduce-scatter``
  (result n/g): ``(g-1)·n/g`` per device; ``all-to-all``: ``(g-1)/g·n``.

This counts what the program runs, not what a formula says; the strategies
report it next to their analytic count.
"""

from __future__ import annotations

import re
from collections import defaultdict

_OPS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_LINE = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>collective-permute|all-reduce|all-gather|reduce-scatter|all-to-all)(?P<start>-start)?\("
)
_ARRAY = re.compile(r"([a-z]+)(\d*)\[([0-9,]*)\]")


def _array_bytes(text: str) -> list[int]:
    out = []
    for kind, bits, dims in _ARRAY.findall(text):
        if kind == "token":
            continue
        width = 8 if kind == "pred" else int(bits or 32)
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        out.append(n * width // 8)
    return out


def _group_size(line: str, devices: int) -> int:
    m = re.search(r"replica_groups=\{(\{[^}]*\})", line)
    if m:
        return len([t for t in m.group(1).strip("{}").split(",") if t.strip()])
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        size = 1
        for name in re.findall(r"'([^']+)'", m.group(2)):
            size *= int(sizes[name])
        return size
    return devices


def collective_bytes(hlo_text: str, devices: int) -> dict[str, int]:
    """Total bytes sent by all ``devices`` per execution, by collective kind (and ``total``)."""
    found: dict[str, int] = defaultdict(int)
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    devices = int(m.group(1)) if m and int(m.group(1)) > 1 else devices
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # drop /*index=5*/ comments inside tuples
        match = _LINE.search(line)
        if not match:
            continue
        op = match.group("op")
        sizes = _array_bytes(match.group("shape"))
        if not sizes:
            continue
        if match.group("start") and op == "collective-permute":
            sizes = sizes[:1]  # (operand, output, contexts...)
        n = sum(sizes) if not match.group("start") else sizes[0]
        if op == "collective-permute":
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
            count = len(re.findall(r"\{\d+,\d+", pairs.group(1) + "}")) if pairs else 0
            found[op] += n * count
            continue
        g = _group_size(line, devices)
        if g <= 1:
            continue
        if op == "all-reduce":
            found[op] += devices * 2 * (g - 1) * n // g
        elif op in ("all-gather", "all-to-all"):
            found[op] += devices * (g - 1) * n // g
        elif op == "reduce-scatter":
            found[op] += devices * (g - 1) * n
    found["total"] = sum(v for k, v in found.items() if k in _OPS)
    return dict(found)
