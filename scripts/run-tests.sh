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
# Two workers, a test file each at a time: the suite is CPU-bound only part of the time (a vLLM start imports
# on one core for ~30 s), so the other core runs another file meanwhile (SWITCHYARD_TEST_WORKERS=0: one process).
.venv/bin/python -m pytest -p no:cacheprovider -n "${SWITCHYARD_TEST_WORKERS:-2}" --dist loadfile "$@"
echo "== all checks passed in $(( $(date +%s) - start )) s"
