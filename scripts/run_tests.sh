#!/usr/bin/env bash
# Install nanotron with its test dependencies and the data extra into a virtual environment (created if missing), lint
# with ruff (the rules are in pyproject.toml; a finding fails the run), then run pytest.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh tests/test_model.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # the CPU wheel; tests need no GPU

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "$TORCH_SPEC"
"$VENV/bin/pip" install -q -e ".[test,data]"
"$VENV/bin/ruff" check src tests scripts examples
exec "$VENV/bin/python" -m pytest -q "$@"
