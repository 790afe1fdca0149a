#!/usr/bin/env bash
# Before the window opens: does Qt's X11 platform plugin (libqxcb.so) find every system library it needs?
# A fresh Debian desktop lacks a few (libxcb-icccm4, libxcb-keysyms1, libxcb-cursor0 ...), and Qt then only says
# "Could not load the Qt platform plugin xcb". This names the missing libraries and their packages; as root with
# apt-get it installs them, otherwise it prints the one `sudo apt-get install` line to run and exits 1.
#
# Usage: scripts/check-qt-libs.sh [PYTHON]   (default .venv/bin/python)
# For tests: SWITCHYARD_QT_PLUGIN (the plugin file), SWITCHYARD_LDD, SWITCHYARD_LDCONFIG, SWITCHYARD_APT_GET and
# SWITCHYARD_EUID stand in for the real plugin, ldd, `ldconfig -p`, apt-get and the user id.
set -euo pipefail

python=${1:-.venv/bin/python}
plugin=${SWITCHYARD_QT_PLUGIN:-}
if [ -z "$plugin" ]; then
  qt=$("$python" -c 'import os, PySide6; print(os.path.join(os.path.dirname(PySide6.__file__), "Qt"))')
  plugin="$qt/plugins/platforms/libqxcb.so"
  export LD_LIBRARY_PATH="$qt/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # Qt's own libraries are not missing
fi
[ -f "$plugin" ] || { echo "switchyard: no Qt xcb plugin at $plugin (is PySide6 installed?)" >&2; exit 1; }
ldd_cmd=${SWITCHYARD_LDD:-ldd}
ldconfig_cmd=${SWITCHYARD_LDCONFIG:-ldconfig -p}
apt_get=${SWITCHYARD_APT_GET:-apt-get}
euid=${SWITCHYARD_EUID:-$(id -u)}

# soname -> Debian/Ubuntu package, for what Qt's xcb plugin and the Qt libraries under it load
declare -A package_of=(
  [libxcb-icccm.so.4]=libxcb-icccm4 [libxcb-keysyms.so.1]=libxcb-keysyms1 [libxcb-cursor.so.0]=libxcb-cursor0
  [libxkbcommon-x11.so.0]=libxkbcommon-x11-0 [libxkbcommon.so.0]=libxkbcommon0 [libxcb-image.so.0]=libxcb-image0
  [libxcb-render-util.so.0]=libxcb-render-util0 [libxcb-xinerama.so.0]=libxcb-xinerama0
  [libxcb-randr.so.0]=libxcb-randr0 [libxcb-shape.so.0]=libxcb-shape0 [libxcb-xkb.so.1]=libxcb-xkb1
  [libxcb-sync.so.1]=libxcb-sync1 [libxcb-xfixes.so.0]=libxcb-xfixes0 [libxcb-shm.so.0]=libxcb-shm0
  [libxcb-render.so.0]=libxcb-render0 [libxcb-util.so.1]=libxcb-util1 [libxcb-glx.so.0]=libxcb-glx0
  [libxcb.so.1]=libxcb1 [libX11-xcb.so.1]=libx11-xcb1 [libX11.so.6]=libx11-6 [libEGL.so.1]=libegl1
  [libGL.so.1]=libgl1 [libOpenGL.so.0]=libopengl0 [libGLX.so.0]=libglx0 [libfontconfig.so.1]=libfontconfig1
  [libfreetype.so.6]=libfreetype6 [libdbus-1.so.3]=libdbus-1-3 [libglib-2.0.so.0]=libglib2.0-0
  [libgthread-2.0.so.0]=libglib2.0-0 [libICE.so.6]=libice6 [libSM.so.6]=libsm6
)

missing_libraries() {
  # linked libraries ldd cannot find, plus libxcb-cursor.so.0, which Qt opens at run time (ldd cannot see it)
  { $ldd_cmd "$plugin" 2>/dev/null | awk '$2 == "=>" && $3 == "not" {print $1}'
    $ldconfig_cmd 2>/dev/null | grep -q 'libxcb-cursor\.so\.0 ' || echo libxcb-cursor.so.0
  } | sort -u
}

mapfile -t missing < <(missing_libraries)
[ "${#missing[@]}" -eq 0 ] && exit 0

packages=() unknown=()
for lib in "${missing[@]}"; do
  if [ -n "${package_of[$lib]:-}" ]; then packages+=("${package_of[$lib]}"); else unknown+=("$lib"); fi
done
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u | sed '/^$/d')
echo "switchyard: the window needs system libraries this machine lacks: ${missing[*]}" >&2
if [ "${#unknown[@]}" -gt 0 ]; then
  echo "switchyard: no package known for ${unknown[*]}; find it with: apt-file search ${unknown[0]}" >&2
fi
[ "${#packages[@]}" -gt 0 ] || exit 1
if [ "$euid" = 0 ] && command -v "${apt_get%% *}" >/dev/null 2>&1 && [ "${#unknown[@]}" -eq 0 ]; then
  echo "switchyard: installing ${packages[*]}" >&2
  DEBIAN_FRONTEND=noninteractive $apt_get install -y --no-install-recommends "${packages[@]}" >&2 ||
    { $apt_get update >&2 && DEBIAN_FRONTEND=noninteractive $apt_get install -y --no-install-recommends "${packages[@]}" >&2; }
  mapfile -t still < <(missing_libraries)
  [ "${#still[@]}" -eq 0 ] && exit 0
  echo "switchyard: still missing after installing: ${still[*]}" >&2
  exit 1
fi
if ! command -v "${apt_get%% *}" >/dev/null 2>&1; then
  echo "switchyard: install the packages that provide them with your system's package manager" >&2
  exit 1
fi
echo "switchyard: install them with:" >&2
echo "sudo apt-get install -y ${packages[*]}"
exit 1
