#!/usr/bin/env bash
# The benchmark's peer libraries (scripts/benchmark.py --peer liger torchtitan) for a GPU machine without network:
# Liger, torchtitan and what torchtitan imports that a CUDA image with torch, transformers and triton lacks, as pinned
# wheels in .whl/ (pure Python; multiprocess is built per Python version). With network, pip install -e ".[bench]".
#   scripts/install_peers.sh download [PYTHON_VERSION]   # where pip reaches the registry: the wheels into .whl/
#                                                        # (for Python 3.12 unless given)
#   scripts/install_peers.sh [PIP_OPTIONS...]             # on the GPU machine, from .whl/ only, e.g. --target /tmp/site
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
  liger-kernel==0.8.5 torchtitan==0.2.2
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0   # torchtitan's config and data loader
  datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19                          # torchtitan's model module imports them
)

if [ "${1:-}" = download ]; then
  exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "${2:-3.12}" -d .whl "${WHEELS[@]}"
fi
exec "$PYTHON" -m pip install --no-deps --no-index --find-links .whl "$@" "${WHEELS[@]}"
