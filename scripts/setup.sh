#!/usr/bin/env bash
# Create .venv (Python 3.11, 3.12 or 3.13) with the pinned requirements and the course installed in
# editable mode. Idempotent: reinstalls only when requirements.txt or pyproject.toml changed.
# Used by course.sh and test.sh. PYTHON=/path/to/python chooses the interpreter.
# Versions: every pin in requirements.txt has wheels for 3.11, 3.12 and 3.13; CI tests 3.11.
# Python 3.10 is refused by the pins numpy==2.4.6, matplotlib==3.11.2, transformers==5.24.0 and
# ipykernel==7.4.0 (each requires 3.11 or later).
#
# Offline (a workshop room with bad Wi-Fi): build a wheelhouse once, where there is a network,
#   bash scripts/setup.sh --wheelhouse DIR [--platform TAG] [--python X.Y] [--torch-index URL|pypi]
# then on every laptop, with no network:
#   WHEELHOUSE=DIR bash scripts/course.sh        (or scripts/test.sh, or this script)
# installs from DIR alone (pip install --no-index --find-links DIR).
#
# The wheelhouse holds a wheel of every pin of requirements.txt and of what they depend on, plus
# pip, setuptools and wheel (what pip needs to build the course's editable install), for one
# platform and one Python. --platform is a pip platform tag: manylinux_2_28_x86_64 (the default,
# Linux x86-64), macosx_14_0_arm64 (Apple silicon: torch 2.13's macOS wheels need macOS 14), or
# win_amd64. --python is the version, 3.11 to 3.13 (default: the interpreter's). torch comes first,
# from --torch-index: on Linux PyTorch's CPU index by default (https://download.pytorch.org/whl/cpu:
# torch 2.13.0+cpu, about 192 MB, instead of PyPI's CUDA build, several GB with its nvidia-*
# wheels); elsewhere PyPI, whose macOS and Windows torch is the CPU build. `--torch-index pypi`
# takes PyPI's build on Linux too (the CUDA build: a GPU box), a URL another index (e.g.
# https://download.pytorch.org/whl/cu128). A torch wheel already in DIR, or in pip's own
# find-links, is used as is (pip prefers the local version 2.13.0+cpu to 2.13.0), so a CPU wheel
# copied into DIR by hand works too.
set -euo pipefail
cd "$(dirname "$0")/.."
SUPPORTED="3.11, 3.12 or 3.13 (CI tests 3.11)"
is_supported='import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))'
CPU_INDEX="https://download.pytorch.org/whl/cpu"

usage() {
  echo "usage: bash scripts/setup.sh [--wheelhouse DIR [--platform TAG] [--python X.Y]" \
    "[--torch-index URL|pypi]]" >&2
  exit 2
}

WHEELHOUSE_OUT=""
PLATFORM=""
PYVER=""
TORCH_INDEX=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse) WHEELHOUSE_OUT="${2:?--wheelhouse needs a folder}"; shift 2 ;;
    --platform) PLATFORM="${2:?--platform needs a pip platform tag}"; shift 2 ;;
    --python) PYVER="${2:?--python needs a version such as 3.12}"; shift 2 ;;
    --torch-index) TORCH_INDEX="${2:?--torch-index needs a URL or pypi}"; shift 2 ;;
    *) echo "error: unknown option $1" >&2; usage ;;
  esac
done
if [ -z "$WHEELHOUSE_OUT" ] && [ -n "$PLATFORM$PYVER$TORCH_INDEX" ]; then
  echo "error: --platform, --python and --torch-index go with --wheelhouse DIR" >&2
  usage
fi

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

# ---- build a wheelhouse: bash scripts/setup.sh --wheelhouse DIR ...
if [ -n "$WHEELHOUSE_OUT" ]; then
  if [ -z "$PYVER" ]; then
    PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  fi
  case "$PYVER" in
    3.11 | 3.12 | 3.13) ;;
    *) echo "error: --python $PYVER: the course runs on Python $SUPPORTED" >&2; exit 1 ;;
  esac
  PLATFORM="${PLATFORM:-manylinux_2_28_x86_64}"
  if [ -z "$TORCH_INDEX" ]; then
    case "$PLATFORM" in
      *linux*) TORCH_INDEX="$CPU_INDEX" ;;
      *) TORCH_INDEX="pypi" ;;
    esac
  fi
  mkdir -p "$WHEELHOUSE_OUT"
  DIR="$(cd "$WHEELHOUSE_OUT" && pwd)"
  # Wheels only (pip cannot build an sdist for another platform), for this platform and Python,
  # with its environment markers (scripts/pip_for_platform.py says why pip alone cannot);
  # DIR itself is searched too, so a second run only fetches what is missing.
  platforms=(--platform "$PLATFORM")
  # pip widens a macOS tag to the older macOS versions by itself, but not manylinux_2_N: a
  # manylinux_2_28 system also runs manylinux_2_17 (manylinux2014), 2_12 (2010) and 2_5 (1) wheels.
  if [[ "$PLATFORM" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    glibc="${BASH_REMATCH[1]}"
    arch="${BASH_REMATCH[2]}"
    for ((minor = glibc - 1; minor >= 5; minor--)); do
      platforms+=(--platform "manylinux_2_${minor}_$arch")
    done
    platforms+=(--platform "manylinux2014_$arch" --platform "manylinux2010_$arch")
    platforms+=(--platform "manylinux1_$arch")
  fi
  target=(--dest "$DIR" --find-links "$DIR" --only-binary=:all: "${platforms[@]}"
    --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}")
  torch_pin="$(grep -E '^torch==' requirements.txt || true)"
  echo "building a wheelhouse in $DIR for $PLATFORM, Python $PYVER"
  start=$SECONDS
  if [ -n "$torch_pin" ]; then
    # torch alone first, so that a platform without its wheel fails here, with a message
    if [ "$TORCH_INDEX" = pypi ]; then
      torch_where="the package index"
      torch_source=(--retries 2)
    else
      torch_where="$TORCH_INDEX"
      torch_source=(--retries 2 --index-url "$TORCH_INDEX")
    fi
    echo "$torch_pin from $torch_where"
    if ! "$PY" scripts/pip_for_platform.py download --quiet "${target[@]}" --no-deps \
      "${torch_source[@]}" "$torch_pin"; then
      echo "error: no $torch_pin wheel for $PLATFORM, Python $PYVER from $torch_where." \
        "torch 2.13's own wheels are manylinux_2_28_x86_64 (Linux; CPU builds on $CPU_INDEX)," \
        "macosx_14_0_arm64 (macOS 14 or later) and win_amd64. A wheel copied into $DIR by hand" \
        "is used on the next run; --torch-index pypi takes PyPI's build (on Linux the CUDA" \
        "build: several GB)." >&2
      exit 1
    fi
  fi
  "$PY" scripts/pip_for_platform.py download --quiet "${target[@]}" -r requirements.txt \
    pip setuptools wheel
  wheels=("$DIR"/*.whl)
  echo "wheelhouse $DIR: ${#wheels[@]} wheels, $(du -sh "$DIR" | cut -f1)," \
    "built in $((SECONDS - start)) s; torch: $(cd "$DIR" && ls torch-* 2>/dev/null || echo none)"
  echo "install from it with no network: WHEELHOUSE=$DIR bash scripts/course.sh"
  exit 0
fi

# ---- install into .venv (from the package index, or from $WHEELHOUSE with no network)
pip_install=(-m pip install --quiet)
if [ -n "${WHEELHOUSE:-}" ]; then
  if [ ! -d "$WHEELHOUSE" ]; then
    echo "error: WHEELHOUSE=$WHEELHOUSE is not a folder" \
      "(build one with: bash scripts/setup.sh --wheelhouse $WHEELHOUSE)" >&2
    exit 1
  fi
  pip_install+=(--no-index --find-links "$(cd "$WHEELHOUSE" && pwd)")
fi
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $("$PY" --version) (the course runs on Python $SUPPORTED)"
  "$PY" -m venv .venv
fi
stamp=".venv/.stamp-$(cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "installing requirements into .venv${WHEELHOUSE:+ from $WHEELHOUSE}" \
    "(first time: a few minutes)"
  .venv/bin/python "${pip_install[@]}" --upgrade pip
  .venv/bin/python "${pip_install[@]}" -r requirements.txt
  .venv/bin/python "${pip_install[@]}" --no-deps -e .
  rm -f .venv/.stamp-*
  touch "$stamp"
fi
