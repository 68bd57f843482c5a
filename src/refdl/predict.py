"""``python -m refdl.predict``: predictions from hardware profiles and the alpha-beta model.

    .venv/bin/python -m refdl.predict collective --op allreduce --algo ring \\
        --hw p100-nvlink --workers 4 --bytes 67108864 --json
    .venv/bin/python -m refdl.predict profiles

(Step-time predictions per strategy are not implemented yet.)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

PROG = "refdl.predict"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(
        prog=f"python -m {PROG}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    c = sub.add_parser("collective", help="time, algbw and busbw of one collective")
    c.add_argument("--op", default="allreduce")
    c.add_argument("--algo", default="ring")
    c.add_argument("--hw", required=True, help="profile name or .toml path")
    c.add_argument("--workers", required=True, help="P, or a list like 1,2,4,8")
    c.add_argument("--bytes", type=float, required=True)
    c.add_argument("--json", action="store_true")
    sub.add_parser("profiles", help="list the shipped hardware profiles")
    args = p.parse_args(argv)

    from refdl import hw
    from refdl.errors import UsageError
    from refdl.perf.collectives import bandwidths, collective_time

    try:
        if args.cmd == "profiles":
            for name in hw.names():
                print(f"{name:22s} {hw.load(name).description}")
            return 0
        profile = hw.load(args.hw)
        try:
            workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
        except ValueError:
            raise UsageError(f"--workers {args.workers!r}: give integers like 4 or 1,2,4") from None
        rows = []
        for w in workers:
            link = profile.link(w)
            t = collective_time(args.op, args.algo, args.bytes, w, link.alpha_beta())
            algbw, busbw = bandwidths(args.op, args.bytes, w, t)
            rows.append(
                {
                    "op": args.op,
                    "algo": args.algo,
                    "hw": profile.name,
                    "workers": w,
                    "bytes": args.bytes,
                    "time_s": t,
                    "algbw": algbw,
                    "busbw": busbw,
                }
            )
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows, indent=1))
    else:
        print(f"{'workers':>8s} {'time (ms)':>12s} {'algbw (GB/s)':>14s} {'busbw (GB/s)':>14s}")
        for r in rows:
            print(
                f"{r['workers']:8d} {r['time_s'] * 1e3:12.4f} {r['algbw'] / 1e9:14.2f} "
                f"{r['busbw'] / 1e9:14.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
