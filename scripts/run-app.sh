#!/usr/bin/env bash
# Set up everything and run Switchyard. The first run builds llama-server (several minutes, cached per user)
# and generates the embedded demo model, so the app works on a fresh machine with no GPU and no network.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/switchyard engines install llama.cpp
# Opening the window on X11: check Qt's xcb plugin finds its system libraries first (installs them as root,
# otherwise prints the one apt-get line), instead of Qt's bare "could not load the Qt platform plugin xcb".
if { [ $# -eq 0 ] || [ "$1" = gui ]; } && [ "${QT_QPA_PLATFORM:-xcb}" = xcb ]; then
  scripts/check-qt-libs.sh .venv/bin/python
fi
exec .venv/bin/switchyard "$@"
