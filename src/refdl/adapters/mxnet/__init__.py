"""The MXNet 1.9 adapter: Gluon twins of refdl's mlp and lenet5, and MXNet's own runners
(single; KVStore ``local`` over several CPU contexts; ``dist_sync`` and ``dist_async``
with a scheduler, a server and workers as processes on loopback - Jaeger et al.'s
configuration).

It runs in ``.venv-mxnet`` (MXNet 1.9 needs numpy < 1.24), as its own process
(``python -m refdl.adapters.mxnet JOB_FOLDER``), reading and writing the files of
``refdl.adapters.exchange``; it imports only MXNet, NumPy and those two modules.
"""
