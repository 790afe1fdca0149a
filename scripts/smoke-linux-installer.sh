#!/usr/bin/env bash
# Smoke-test the built Linux installer without installing it on this system: unpack the .deb into a temp root
# (dpkg-deb -x), then check what a user gets: the files and links, the menu entry, `--version`, `detect --json`,
# the main window opening offscreen and exiting cleanly, and the prerm stopping a running engine.
# Usage: scripts/smoke-linux-installer.sh [path/to/switchyard_<version>_<arch>.deb]   (default: newest in dist/)
set -euo pipefail
cd "$(dirname "$0")/.."

deb=${1:-$(ls -t dist/switchyard_*.deb 2>/dev/null | head -1 || true)}
[ -n "$deb" ] && [ -f "$deb" ] || { echo "no .deb found: build it first with scripts/build-installer-linux.sh" >&2; exit 1; }
version=$(python3 installers/metadata.py)
work=$(mktemp -d)
fake_engine=""
kept_engine=""
cleanup() {
  for pid in $fake_engine $kept_engine; do kill -KILL "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
root="$work/root"
passed=0
ok() { passed=$((passed + 1)); echo "ok   $*"; }
fail() { echo "FAIL $*" >&2; echo "smoke: $passed passed, 1 failed" >&2; exit 1; }

echo "== $deb"
[ "$(dpkg-deb -f "$deb" Package)" = switchyard ] || fail "package name"
[ "$(dpkg-deb -f "$deb" Version)" = "$version" ] || fail "package version is not desktop/__init__.py's $version"
ok "control: switchyard $version, Depends: $(dpkg-deb -f "$deb" Depends)"

dpkg-deb -x "$deb" "$root"
dpkg-deb -e "$deb" "$work/DEBIAN"
bin="$root/opt/switchyard/switchyard"
[ -x "$bin" ] || fail "/opt/switchyard/switchyard missing or not executable"
[ "$(readlink "$root/usr/bin/switchyard")" = /opt/switchyard/switchyard ] || fail "/usr/bin/switchyard link"
ok "installs /opt/switchyard with /usr/bin/switchyard -> /opt/switchyard/switchyard"

entry="$root/usr/share/applications/switchyard.desktop"
[ -f "$entry" ] || fail "menu entry missing"
grep -qx "Exec=switchyard" "$entry" && grep -qx "Icon=switchyard" "$entry" || fail "menu entry Exec/Icon"
if command -v desktop-file-validate >/dev/null; then
  desktop-file-validate "$entry" || fail "desktop-file-validate"
fi
[ -f "$root/usr/share/icons/hicolor/256x256/apps/switchyard.png" ] || fail "hicolor icon missing"
[ -f "$root/opt/switchyard/_internal/resources/icons/switchyard.svg" ] || fail "bundled resources missing"
ok "menu entry, hicolor icons and bundled resources present"

export SWITCHYARD_HOME="$work/home" SWITCHYARD_CACHE_DIR="$work/cache"
out=$("$bin" --version)
[ "$out" = "switchyard $version" ] || fail "--version said '$out'"
ok "--version: $out"

if "$bin" detect --help >/dev/null 2>&1; then
  "$bin" detect --json > "$work/detect.json" || fail "detect --json exited non-zero"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['cpu']['logical_cores'] >= 1, d" \
    "$work/detect.json" || fail "detect --json output"
  ok "detect --json: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['cpu']['model'], '|', d['cpu']['logical_cores'], 'threads |', len(d['gpus']), 'GPU(s)')" "$work/detect.json")"
else
  "$bin" engines list --json | python3 -c "import json,sys; assert isinstance(json.load(sys.stdin), list)" ||
    fail "engines list --json"
  ok "engines list --json (this build has no detect command)"
fi

gui_start=$(date +%s.%N)
gui_out=$(QT_QPA_PLATFORM=offscreen timeout 120 "$bin" gui --quit-when-ready 2>&1) || fail "gui exited non-zero: $gui_out"
grep -q "interactive after" <<<"$gui_out" || fail "gui did not report the window: $gui_out"
! grep -qi "could not load the qt platform plugin\|cannot load library" <<<"$gui_out" || fail "Qt plugin errors: $gui_out"
ok "main window offscreen: $(grep 'interactive after' <<<"$gui_out") (process $(python3 -c "import sys,time; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$gui_start") s)"

# A real X server, when this machine has one to offer (Xvfb) and the package's xcb dependencies are installed.
xcb_plugin="$root/opt/switchyard/_internal/PySide6/Qt/plugins/platforms/libqxcb.so"
if command -v xvfb-run >/dev/null &&
   ! LD_LIBRARY_PATH="$root/opt/switchyard/_internal" ldd "$xcb_plugin" | grep -q "not found"; then
  x_out=$(xvfb-run -a env QT_QPA_PLATFORM=xcb timeout 120 "$bin" gui --quit-when-ready 2>&1) ||
    fail "gui on X11 (xcb) exited non-zero: $x_out"
  ok "main window on X11 (Xvfb, xcb plugin): $(grep 'interactive after' <<<"$x_out")"
else
  echo "skip main window on X11: needs xvfb-run and the package's xcb Depends (apt-get install xvfb libxcb-icccm4 libxcb-keysyms1)"
fi

# prerm: two fake engines (own sessions, like real ones) recorded in pidfiles. The orphan must be stopped by the
# package's own prerm script (pointed at the unpacked tree instead of /opt, and at this test's SWITCHYARD_HOME
# only: without --all-users, so no real user's engines are touched); the one a live Switchyard elsewhere still
# supervises (here: this shell stands in for it) must be left running.
start_time() {  # seconds since the epoch, computed as psutil does: boot time + start ticks / CLK_TCK
  python3 -c "import sys; print(int(sys.argv[1]) + int(sys.argv[2]) / int(sys.argv[3]))" \
    "$(awk '/^btime/ {print $2}' /proc/stat)" "$(awk '{print $22}' "/proc/$1/stat")" "$(getconf CLK_TCK)"
}
record() {  # record PID OWNER_PID OWNER_CREATED
  printf '{"pid": %d, "created": %s, "owner_pid": %d, "owner_created": %s, "engine": "llama.cpp", "port": 1}\n' \
    "$1" "$(start_time "$1")" "$2" "$3" > "$SWITCHYARD_HOME/run/engine-$1.json"
}
mkdir -p "$SWITCHYARD_HOME/run" "$SWITCHYARD_HOME/engines/llama.cpp/bin"
fake_server="$SWITCHYARD_HOME/engines/llama.cpp/bin/llama-server"  # the hook stops only programs from there
cp "$(command -v sleep)" "$fake_server"
setsid "$fake_server" 300 & fake_engine=$!
setsid "$fake_server" 300 & kept_engine=$!
disown "$kept_engine"  # killed in cleanup: no job-control notice
record "$fake_engine" 0 null
record "$kept_engine" $$ "$(start_time $$)"
sed -e "s#/opt/switchyard#$root/opt/switchyard#g" -e "s# --all-users##" "$work/DEBIAN/prerm" > "$work/prerm"
grep -q -- "--uninstall-stop-engines" "$work/prerm" || fail "prerm does not call the uninstall hook"
! grep -q -- "--all-users" "$work/prerm" || fail "could not confine the prerm to this test's data dir"
prerm_out=$(sh "$work/prerm" remove 2>&1) || fail "prerm exited non-zero: $prerm_out"
wait "$fake_engine" 2>/dev/null || true
kill -0 "$fake_engine" 2>/dev/null && fail "prerm left the orphaned engine running"
[ ! -e "$SWITCHYARD_HOME/run/engine-$fake_engine.json" ] || fail "prerm left the orphan's pidfile"
kill -0 "$kept_engine" 2>/dev/null || fail "prerm stopped an engine another live Switchyard supervises"
fake_engine=""
ok "prerm stopped the orphaned engine, kept the supervised one: $(tail -1 <<<"$prerm_out")"

echo "bundle size: $(du -sh "$root/opt/switchyard" | cut -f1) ($(find "$root/opt/switchyard" -type f | wc -l) files)"
echo "package size: $(du -h "$deb" | cut -f1) ($deb)"
echo "smoke: $passed passed, 0 failed"
