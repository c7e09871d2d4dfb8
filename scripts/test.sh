#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole suite: pytest on tests/ and
# nbval on every notebook, against the reference solutions. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export LABS_IMPL=solutions PYTHONHASHSEED=0
exec .venv/bin/python -m pytest "$@"
