#!/bin/sh
# Uninstall Switchyard (shipped in the .dmg; double-click it in Finder). Like the Linux and Windows uninstallers:
# first stop the running engines that belong to this app (switchyard --uninstall-stop-engines, see
# desktop/_frozen.py), then move Switchyard.app to the Trash. Settings, history, downloaded models and engines in
# ~/Library/Application Support/switchyard and ~/Library/Caches/switchyard are kept.
set -u
app="/Applications/Switchyard.app"
[ -d "$app" ] || app="$HOME/Applications/Switchyard.app"
if [ ! -d "$app" ]; then
    echo "Switchyard.app is not in /Applications or ~/Applications: nothing to uninstall."
    exit 0
fi
"$app/Contents/MacOS/switchyard" --uninstall-stop-engines || true
osascript -e "tell application \"Finder\" to delete POSIX file \"$app\"" >/dev/null \
    || { echo "Could not move $app to the Trash; drag it there yourself."; exit 1; }
echo "Switchyard was moved to the Trash. Your models and settings were kept."
