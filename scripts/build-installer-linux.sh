#!/usr/bin/env bash
# Build the Linux installer: PyInstaller bundle (build.spec) -> dist/switchyard_<version>_<arch>.deb.
# The package installs the bundle to /opt/switchyard, links /usr/bin/switchyard, adds the menu entry and icons,
# and its prerm stops running engines before removal (installers/linux/prerm). Needs dpkg-deb and ldd (Debian,
# Ubuntu). Build on the oldest distribution you support: the package depends on that one's glibc and on the
# system graphics libraries the Qt plugins link (see installers/README.md).
# Usage: scripts/build-installer-linux.sh
#   env DEB_COMPRESSION=zstd|xz|gzip (default zstd: 5 s here vs 6 min for xz, 87 vs 72 MiB; every system that meets
#   the package's glibc dependency has a dpkg that reads zstd), DEB_LEVEL=N (default 9).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

echo "== venv"
mkdir -p build
# --dev: plain `setup.sh` exits early on its stamp line under `set -e` (reported); the dev venv is a superset.
scripts/setup.sh --dev > build/setup.log 2>&1 || { cat build/setup.log >&2; exit 1; }
if ! .venv/bin/python -c "import PyInstaller" 2>/dev/null; then
  .venv/bin/python -m pip install --disable-pip-version-check -q 'pyinstaller>=6.10'  # pyproject's [build] extra
fi

echo "== PyInstaller bundle (build.spec)"
.venv/bin/pyinstaller --noconfirm --log-level WARN --workpath build/pyinstaller --distpath dist build.spec
bundle_time=$(( $(date +%s) - start ))

version=$(python3 installers/metadata.py)
arch=$(dpkg --print-architecture)
package=switchyard
stage="build/deb/${package}_${version}_${arch}"
deb="dist/${package}_${version}_${arch}.deb"

echo "== stage ${stage}"
rm -rf "$stage"
mkdir -p "$stage/opt" "$stage/usr/bin" "$stage/usr/share/applications" "$stage/usr/share/doc/$package" "$stage/DEBIAN"
cp -a dist/switchyard "$stage/opt/$package"
ln -s "/opt/$package/switchyard" "$stage/usr/bin/switchyard"
desktop_file=resources/switchyard.desktop
[ -f "$desktop_file" ] || { echo "missing $desktop_file" >&2; exit 1; }
install -m 0644 "$desktop_file" "$stage/usr/share/applications/switchyard.desktop"
for png in resources/icons/*x*/switchyard.png; do
  size=$(basename "$(dirname "$png")")
  install -D -m 0644 "$png" "$stage/usr/share/icons/hicolor/$size/apps/switchyard.png"
done
if [ -f resources/icons/switchyard.svg ]; then
  install -D -m 0644 resources/icons/switchyard.svg "$stage/usr/share/icons/hicolor/scalable/apps/switchyard.svg"
fi
cat > "$stage/usr/share/doc/$package/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: Switchyard
Files: *
License: Apache-2.0
Comment: /opt/switchyard bundles Python, Qt (LGPL-3.0, PySide6) and the other third-party libraries the app
 uses, each under its own licence; their licence files are under /opt/switchyard/_internal/*.dist-info.
EOF
install -m 0755 installers/linux/prerm "$stage/DEBIAN/prerm"
chmod -R u+rwX,go+rX,go-w "$stage"

echo "== dependencies (system libraries the bundle links but does not carry)"
# Libraries PyInstaller deliberately leaves to the system (glibc, GL/EGL, xcb, wayland) and the few the build
# machine lacks: the package depends on them so the menu entry works on a fresh desktop.
declare -A absent_lib_packages=(
  [libxcb-icccm.so.4]=libxcb-icccm4 [libxcb-keysyms.so.1]=libxcb-keysyms1
  [libwayland-cursor.so.0]=libwayland-cursor0 [libwayland-egl.so.1]=libwayland-egl1
)
internal="$stage/opt/$package/_internal"
mapfile -t libs < <(find "$stage/opt/$package" -type f \( -name '*.so*' -o -name switchyard \) -print0 |
  xargs -0 -n 50 env LD_LIBRARY_PATH="$internal" ldd 2>/dev/null |
  awk '/=>/ && $3 !~ /_internal/ {print $1, $3}' | sort -u)
declare -A depends=()
for line in "${libs[@]}"; do
  name=${line%% *}; path=${line#* }
  if [ "$path" = "not" ]; then
    pkg=${absent_lib_packages[$name]:-}
    [ -n "$pkg" ] || { echo "no package known for missing library $name: add it to absent_lib_packages" >&2; exit 1; }
  else
    pkg=$(dpkg -S "$(readlink -f "$path")" 2>/dev/null || dpkg -S "$path" 2>/dev/null || true)
    pkg=${pkg%%:*}
    [ -n "$pkg" ] || { echo "no package owns $path (needed as $name)" >&2; exit 1; }
  fi
  depends[$pkg]=1
done
# The newest glibc symbol version any bundled binary uses is the oldest glibc the bundle runs on.
if command -v objdump >/dev/null; then
  glibc=$(find "$stage/opt/$package" -type f \( -name '*.so*' -o -name switchyard \) -print0 |
    xargs -0 objdump -T 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -Vu | tail -1)
else
  glibc=$(dpkg-query -W -f='${Version}' libc6 | sed 's/-.*//')
fi
depends_line="libc6 (>= ${glibc})"
for pkg in $(printf '%s\n' "${!depends[@]}" | grep -vx libc6 | sort); do depends_line+=", $pkg"; done
echo "Depends: $depends_line"

installed_size=$(du -sk --apparent-size --exclude=DEBIAN "$stage" | cut -f1)
summary=$(python3 -c "import sys; sys.path.insert(0, 'installers'); import metadata; print(metadata.SUMMARY)")
publisher=$(python3 -c "import sys; sys.path.insert(0, 'installers'); import metadata; print(metadata.PUBLISHER)")
sed -e "s|@PACKAGE@|$package|" -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" \
    -e "s|@INSTALLED_SIZE@|$installed_size|" -e "s|@DEPENDS@|$depends_line|" \
    -e "s|@SUMMARY@|$summary|" -e "s|@PUBLISHER@|$publisher|" \
    installers/linux/control.in > "$stage/DEBIAN/control"

echo "== dpkg-deb"
rm -f "$deb"
dpkg-deb --root-owner-group -Z"${DEB_COMPRESSION:-zstd}" -z"${DEB_LEVEL:-9}" --build "$stage" "$deb"

echo "== done in $(( $(date +%s) - start )) s (bundle $bundle_time s)"
echo "bundle: $(du -sh dist/switchyard | cut -f1)  package: $deb $(du -h "$deb" | cut -f1)"
