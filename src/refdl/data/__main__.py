"""``python -m refdl.data``: convert a data set into a tensorstore (zarr) store.

python -m refdl.data convert --dataset digits --out /tmp/digits.zarr
python -m refdl.data convert --dataset mnist --data-dir ~/mnist --out ~/mnist.zarr
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from refdl.cli import Parser
from refdl.config.paths import writable_folder
from refdl.config.values import Int
from refdl.data import load_dataset
from refdl.data.store import write_zarr
from refdl.errors import UsageError

STORE_ENTRIES = {"info.json", "train_x", "train_y", "test_x", "test_y"}


def check_not_another_folder(out: Path) -> None:
    """``--out`` is new, empty, or a store this command wrote (replaced): never a folder
    holding other files, such as a run's, which the store's arrays would be mixed into."""
    if not out.is_dir():
        return
    others = sorted(p.name for p in out.iterdir() if p.name not in STORE_ENTRIES)
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UsageError(f"--out {out} holds other files ({shown}); give a new or empty "
                         "folder, or a store this command wrote (it is replaced)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = Parser(name="refdl data", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.sub_parsers(dest="cmd", required=True, metavar="{convert}")
    conv = sub.add_parser("convert", help="write a data set as a zarr store")
    conv.add_argument("--dataset", required=True)
    conv.add_argument("--data-dir")
    conv.add_argument("--out", required=True)
    conv.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args(argv)
    try:
        if problem := Int(min=1, max=1 << 20).problem(args.chunk):
            raise UsageError(f"--chunk must be {problem}")
        if not args.out.strip():
            raise UsageError("--out is empty; give the folder to write the store in")
        writable_folder(args.out, "--out")
        check_not_another_folder(Path(args.out))
        ds = load_dataset(args.dataset, args.data_dir)
    except UsageError as e:
        print(f"refdl.data: error: {e}", file=sys.stderr)
        return 2
    try:
        path = write_zarr(ds, args.out, args.chunk)
    except (OSError, ValueError) as e:  # tensorstore reports a failed write as ValueError
        print(f"refdl.data: error: cannot write {args.out} ({e})", file=sys.stderr)
        return 1
    print(f"wrote {ds.info.train_size} train + {ds.info.test_size} test examples to {path}")
    return 0


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, "refdl.data"))
