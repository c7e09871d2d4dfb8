#!/usr/bin/env bash
# Install what the course needs (first run only) and open JupyterLab at notebook 00.
# JupyterLab serves the repository root, so its file browser shows labs/ (the exercise modules you
# edit) beside notebooks/; each notebook's kernel still runs in notebooks/.
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
# Without --ServerApp.root_dir, JupyterLab would serve the folder of the notebook it opens.
exec .venv/bin/jupyter lab --ServerApp.root_dir="$PWD" notebooks/00_setup_and_collectives.ipynb \
  "${ROOT_FLAG[@]}" "$@"
