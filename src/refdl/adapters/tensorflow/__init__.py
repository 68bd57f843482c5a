"""The TensorFlow adapter: Keras twins of refdl's models and TensorFlow's own runners
(single; ``MirroredStrategy`` over logical CPU devices; ``MultiWorkerMirroredStrategy``
across processes; ``ParameterServerStrategy`` with chief, worker and ps processes).

It runs in its own process (``python -m refdl.adapters.tensorflow JOB_FOLDER``),
reading and writing the files of ``refdl.adapters.exchange``; nothing here is
imported into refdl's process, and nothing here imports JAX.
"""
