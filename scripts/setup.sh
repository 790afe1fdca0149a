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
stamp=".venv/.switchyard-installed$( [ -n "$extras" ] && echo -dev )"
digest=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$digest" ]; then
  .venv/bin/python -m pip install --disable-pip-version-check -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install --disable-pip-version-check -q -e ".${extras}" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import desktop, PySide6, gguf" 
  echo "$digest" > "$stamp"
fi
