#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv). Idempotent and quiet when nothing changed.
# Usage: scripts/setup.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Reinstall only when the project's metadata changed since the last successful install.
stamp=".venv/.switchyard-installed"
if [ -n "$extras" ]; then stamp="$stamp-dev"; fi
digest=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$digest" ]; then
  log=.venv/setup.log
  echo "setting up .venv (log: $log)"
  if ! { .venv/bin/python -m pip install --disable-pip-version-check -q --upgrade pip &&
         .venv/bin/python -m pip install --disable-pip-version-check -q -e ".${extras}"; } >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" | tail -30
    echo "setup failed: see $log" >&2
    exit 1
  fi
  .venv/bin/python -c "import desktop, PySide6, gguf"
  echo "$digest" > "$stamp"
fi
# The .desktop entry is checked by desktop-file-validate (tests/test_installer_recipes.py): with --dev, install
# desktop-file-utils from Debian's apt when it is missing and we are root; otherwise say which command does it.
if [ -n "$extras" ] && ! command -v desktop-file-validate >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing desktop-file-utils (desktop-file-validate) with apt-get"
    if ! { apt-get install -y -q --no-install-recommends desktop-file-utils ||
           { apt-get update -q && apt-get install -y -q --no-install-recommends desktop-file-utils; }; } \
         >.venv/apt-desktop-file-utils.log 2>&1; then
      echo "could not install desktop-file-utils: see .venv/apt-desktop-file-utils.log" >&2
    fi
  else
    echo "note: desktop-file-validate is missing; install it with: sudo apt-get install desktop-file-utils" >&2
  fi
fi
