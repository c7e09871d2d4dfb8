#!/usr/bin/env bash
# Create .venv (Python 3.11) with the pinned requirements and the course installed in editable
# mode. Idempotent: reinstalls only when requirements.txt or pyproject.toml changed.
# Used by course.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  is_311='import sys; sys.exit(sys.version_info[:2] != (3, 11))'
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "$is_311"; then
      PY="$candidate"
      break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "error: the course needs Python 3.11" \
    "(set PYTHON=/path/to/python3.11, or use environment.yml with conda)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
stamp=".venv/.stamp-$(cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "installing requirements into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  .venv/bin/python -m pip install --quiet --no-deps -e .
  rm -f .venv/.stamp-*
  touch "$stamp"
fi
