#!/usr/bin/env bash
# Set up everything and run the whole test suite: lint, types, the Qt-free-core contract, then pytest with both
# real engines. Engines are provisioned once per user (outside the clone) and reused by later runs.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scripts/setup.sh --dev
echo "== engines (cached after the first run)"
.venv/bin/switchyard engines install llama.cpp vllm
echo "== ruff";          .venv/bin/ruff check desktop tests benchmarks
echo "== mypy";          .venv/bin/mypy
echo "== import-linter"; .venv/bin/lint-imports
echo "== pytest"
export QT_QPA_PLATFORM=offscreen
.venv/bin/python -m pytest -p no:cacheprovider "$@"
echo "== all checks passed in $(( $(date +%s) - start )) s"
