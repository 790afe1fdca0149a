#!/usr/bin/env bash
# Build the macOS installer on a Mac: dist/Switchyard.app (build.spec's BUNDLE) and dist/Switchyard-<version>.dmg.
# Needs Python 3.11+ and Xcode's command line tools. Usage: installers/macos/build.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(uname -s)" = Darwin ] || { echo "the macOS installer must be built on macOS" >&2; exit 1; }
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[build]' 'dmgbuild>=1.6'
.venv/bin/pyinstaller --noconfirm --log-level WARN --workpath build/pyinstaller --distpath dist build.spec
# Sign and notarize here for distribution (codesign --deep --options runtime, xcrun notarytool); unsigned apps
# open only after right-click > Open.
version=$(python3 installers/metadata.py)
.venv/bin/dmgbuild -s installers/macos/dmg_settings.py -D root="$PWD" Switchyard "dist/Switchyard-$version.dmg"
echo "built dist/Switchyard-$version.dmg"
