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
