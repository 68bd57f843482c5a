"""refdl: a pure-JAX reference implementation of parallel and distributed training.

Importing the package is cheap and does not import JAX, so that
``python -m refdl.train --devices 8`` can configure the simulated devices
before JAX starts.
"""

__version__ = "0.1.0"
