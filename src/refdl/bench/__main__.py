"""``python -m refdl.bench COMMAND``: benchmarks that check refdl against measurement.

.venv/bin/python -m refdl.bench predict-vs-measure [--mpi] [--out FILE.json]
"""

from __future__ import annotations

import sys

COMMANDS = ("predict-vs-measure",)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(
            f"refdl.bench: error: give a command: {', '.join(COMMANDS)} (see --help)",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "predict-vs-measure":
        from refdl.bench import predict_vs_measure

        predict_vs_measure.configure()
        return predict_vs_measure.main(argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
