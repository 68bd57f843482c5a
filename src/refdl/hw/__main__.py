"""``python -m refdl.hw``: calibrate this machine into a profile, or show a profile.

.venv/bin/python -m refdl.hw show p100-nvlink
.venv/bin/python -m refdl.hw calibrate --out my-machine.toml   # about three minutes
"""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path

from refdl.cli import Parser
from refdl.config.paths import writable_file, write_atomic
from refdl.errors import UsageError
from refdl.hw.profile import dumps, load, parse


def main(argv: list[str] | None = None) -> int:
    """``python -m refdl.hw calibrate [--out FILE]`` | ``python -m refdl.hw show NAME``."""
    ap = Parser(name="refdl hw", description=main.__doc__)
    sub = ap.sub_parsers(dest="cmd", required=True, metavar="{calibrate,show}")
    cal = sub.add_parser("calibrate", help="measure this machine and write a profile")
    cal.add_argument("--out", help="profile path (default: the shipped profiles/local.toml)")
    cal.add_argument("--name", default="local")
    show = sub.add_parser("show", help="print a profile")
    show.add_argument("name")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "calibrate" and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}",
                                                        args.name):  # fmt: skip
            raise UsageError(f"--name {args.name!r}: a profile's name is letters, digits, "
                             "'.', '_' and '-' (it names the file profiles/NAME.toml)")  # fmt: skip
        if args.cmd == "calibrate" and args.out:  # before minutes of measuring
            writable_file(args.out, "--out", (".toml",))
        if args.cmd == "show":
            print(dumps(load(args.name)), end="")
            return 0
        from refdl.hw.calibrate import calibrate  # (here: a mistake is answered without JAX)
        from refdl.parallel.processes import keep_freed_memory, simulate_devices

        simulate_devices(8)  # the calibration measures simulated devices, as the tests run
        keep_freed_memory()  # and steps as refdl.train runs them
        profile = parse(calibrate(args.name), "calibration")
        out = Path(args.out or str(resources.files("refdl.hw") / "profiles" / f"{args.name}.toml"))
        write_atomic(out, dumps(profile))
    except UsageError as e:
        print(f"refdl.hw: error: {e}", file=sys.stderr)
        return 2
    d = profile.device
    links = "; ".join(
        f"{k}: alpha {v.latency_s * 1e6:.1f} us, {v.bandwidth / 1e9:.2f} GB/s"
        for k, v in profile.links.items()
    )
    flops = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in d.peak_flops.items())
    print(f"wrote {out}: {flops}, memory {d.memory_bandwidth / 1e9:.1f} GB/s; {links}")
    return 0


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, "refdl.hw"))
