#!/usr/bin/env bash
# Set up everything and run Switchyard. The first run builds llama-server (several minutes, cached per user)
# and generates the embedded demo model, so the app works on a fresh machine with no GPU and no network.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/switchyard engines install llama.cpp
exec .venv/bin/switchyard "$@"
