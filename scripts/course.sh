#!/usr/bin/env bash
# Install what the course needs (first run only) and open JupyterLab at notebook 00.
#   LABS_IMPL=solutions bash scripts/course.sh
# opens it running the reference solutions instead of your code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ROOT_FLAG=()
# containers often run as root; JupyterLab refuses it otherwise
if [ "$(id -u)" = 0 ]; then
  ROOT_FLAG=(--allow-root)
fi
exec .venv/bin/jupyter lab notebooks/00_setup_and_collectives.ipynb "${ROOT_FLAG[@]}" "$@"
