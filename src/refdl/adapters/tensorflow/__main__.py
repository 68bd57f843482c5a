"""``python -m refdl.adapters.tensorflow JOB_FOLDER [ROLE INDEX]``: run a job of
``refdl.adapters.exchange`` with TensorFlow and write its result there. With a role
(``mwms``, ``ps``, ``worker``) this is one process of a multi-process run that the
job's own process started."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv: list[str]) -> int:
    from refdl.adapters.exchange import read_job, write_result
    from refdl.adapters.tensorflow import runners

    folder = Path(argv[0])
    if len(argv) == 3:
        role, index = argv[1], int(argv[2])
        if role == "mwms":
            runners.multiworker_process(folder, index)
        else:
            runners.server_process(folder, role, index)
        return 0
    job, params, batches = read_job(folder)
    if job.get("threads"):
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(job["threads"])
    twins = {  # refdl's twin (the job's "strategy") -> TensorFlow's run of it
        "single": lambda: write_result(folder, *runners.train_single(job, params, batches)),
        "data": lambda: (
            runners.train_multiworker(folder, job) if job["workers"] > 1
            else write_result(folder, *runners.train_mirrored(job, params, batches))
        ),
        "ps": lambda: write_result(folder, *runners.train_ps(folder, job, params, batches)),
    }  # fmt: skip
    if job["strategy"] not in twins:
        raise ValueError(f"no TensorFlow runner for strategy {job['strategy']!r}")
    twins[job["strategy"]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
