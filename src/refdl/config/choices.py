"""The configuration's vocabulary: every word an option may take.

The modules that implement these words (``refdl.core.optim``, ``refdl.comm``,
``refdl.parallel.schedule``) import their names from here, so a spec can be
checked without importing them, and the two lists cannot drift apart
(``tests/config/test_spec.py`` checks each implementation against its list).
"""

from __future__ import annotations

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "muon")
LR_SCHEDULES = ("constant", "step", "cosine")
LOSSES = ("cross_entropy", "squared")
# refdl's, PyTorch's, Keras' and MXNet Gluon's (a bare net.initialize()) defaults
INIT_SCHEMES = ("lecun_normal", "torch", "keras", "mxnet")
# top-k pairs summed (refdl.comm.sparse), by recursive doubling or split-allgather
SPARSE_ALGORITHM = {"sparse": "recursive-doubling", "sparse-split": "split-allgather"}
SPARSE_ALLREDUCE = tuple(SPARSE_ALGORITHM)
ALLREDUCE = ("xla", "ring", "tree", "halving-doubling", *SPARSE_ALLREDUCE)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "looped-bfs")
LOOPED = ("interleaved", "looped-bfs")  # schedules taking --chunks (chunk c at c * p + s)
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # schedules splitting the backward into B and W
V_SHAPED = ("zbv", "dualpipev")  # two chunks per device, s and 2p - 1 - s
PS_MODES = ("sync", "async", "ssp", "hierarchical", "softsync")
ORDERS = ("atc", "cta")  # decentralized: adapt-then-combine, combine-then-adapt
TOPOLOGIES = ("ring", "torus", "exp2", "complete")
PRESETS = ("tensor", "owt")
MUON_SCHEMES = ("gather", "owner")  # Muon on fsdp's flat shards (refdl.parallel.muon)
CONTEXT_ATTENTION = ("ring", "all-to-all")  # context parallelism (refdl.parallel.context)
REMAT = ("none", "full", "selective")  # activation recomputation per layer
PRECISIONS = ("fp32", "bf16", "fp64")  # compute precision (bf16: fp32 master weights; fp64: all)


def chunks_of(schedule: str, chunks: int) -> int:
    """Model chunks per device under ``schedule``: ZB-V and DualPipeV always 2 (the V), the looped
    schedules ``chunks``, the others 1."""
    return 2 if schedule in V_SHAPED else (chunks if schedule in LOOPED else 1)
