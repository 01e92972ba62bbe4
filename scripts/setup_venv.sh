#!/usr/bin/env bash
# Create (or reuse) .venv with Python >= 3.12 and install jaxgdn with its test and tool extras.
# Finds Python on PATH first, then under pyenv; says what is missing if there is none.
set -euo pipefail
cd "$(dirname "$0")/.."

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local c
  for c in python3.13 python3.12 python3 python; do
    if command -v "$c" >/dev/null 2>&1 && ok "$(command -v "$c")"; then command -v "$c"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/3.1[2-9]*/bin/python3; do
      if [ -x "$c" ] && ok "$c"; then echo "$c"; return 0; fi
    done
  fi
  return 1
}

if [ -x .venv/bin/python ] && ok .venv/bin/python; then
  PY=.venv/bin/python
else
  if ! BASE=$(find_python); then
    echo "jaxgdn needs Python >= 3.12 (jax 0.11 does), and none was found on PATH or under pyenv." >&2
    echo "Install one (e.g. 'pyenv install 3.12' or your distribution's python3.12 with venv) and rerun." >&2
    exit 1
  fi
  echo "setup: creating .venv with $BASE ($("$BASE" --version))"
  rm -rf .venv
  "$BASE" -m venv .venv
  PY=.venv/bin/python
fi
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -e ".[test,tools]"
echo "setup: .venv ready ($("$PY" -c 'import jax; print("jax", jax.__version__)'))"
