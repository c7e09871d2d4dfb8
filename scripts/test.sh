#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole suite: pytest on tests/ and
# nbval on every notebook, against the reference solutions. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export LABS_IMPL=solutions PYTHONHASHSEED=0
# Lint and format first: a repository that ruff rejects fails here, in seconds.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
