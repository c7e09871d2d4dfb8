#!/usr/bin/env bash
# Create .venv (Python 3.11, 3.12 or 3.13) with the pinned requirements and the course installed in
# editable mode. Idempotent: reinstalls only when requirements.txt or pyproject.toml changed.
# Used by course.sh and test.sh. PYTHON=/path/to/python chooses the interpreter.
# Versions: every pin in requirements.txt has wheels for 3.11, 3.12 and 3.13; CI tests 3.11.
# Python 3.10 is refused by the pins numpy==2.4.6, matplotlib==3.11.2, transformers==5.24.0 and
# ipykernel==7.4.0 (each requires 3.11 or later).
set -euo pipefail
cd "$(dirname "$0")/.."
SUPPORTED="3.11, 3.12 or 3.13 (CI tests 3.11)"
is_supported='import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))'
PY="${PYTHON:-}"
if [ -n "$PY" ] && ! "$PY" -c "$is_supported"; then
  echo "error: PYTHON=$PY is $("$PY" --version 2>&1); the course needs Python $SUPPORTED" >&2
  exit 1
fi
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3.13 python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "$is_supported"; then
      PY="$candidate"
      break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "error: the course needs Python $SUPPORTED" \
    "(set PYTHON=/path/to/python3.11, or use environment.yml with conda)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $("$PY" --version) (the course runs on Python $SUPPORTED)"
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
