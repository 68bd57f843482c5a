"""``python -m refdl.adapters.mxnet JOB_FOLDER [ROLE INDEX]``: run a job of
``refdl.adapters.exchange`` with MXNet and write its result there. With a role this is
one process of a ``dist_sync``/``dist_async`` run (``DMLC_ROLE`` set): importing MXNet
as a scheduler or server runs its KVStore loop until the workers finish."""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    if len(argv) == 3:
        role, index = argv[1], int(argv[2])
        import mxnet  # noqa: F401  (a scheduler's or server's whole life happens here)

        if role == "worker":
            from refdl.adapters.mxnet.runners import worker_process

            worker_process(folder, index)
        return 0
    import mxnet as mx

    from refdl.adapters.exchange import read_job, write_result
    from refdl.adapters.mxnet import runners

    job, params, batches = read_job(folder)
    twins = {  # refdl's twin (the job's "strategy") -> MXNet's run of it
        "single": lambda: write_result(
            folder, *runners.train_local(job, params, batches, [mx.cpu()], None)
        ),
        "data": lambda: write_result(folder, *runners.train_local(
            job, params, batches, [mx.cpu(i) for i in range(job["devices"])], "local")),
        "ps": lambda: runners.train_dist(folder, job),
    }  # fmt: skip
    if job["strategy"] not in twins:
        raise ValueError(f"no MXNet runner for strategy {job['strategy']!r}")
    twins[job["strategy"]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
