# dmgbuild settings for the Switchyard disk image (https://dmgbuild.readthedocs.io). dmgbuild executes this file
# with a `defines` dict; build with installers/macos/build.sh, which runs:
#   dmgbuild -s installers/macos/dmg_settings.py -D root="$PWD" Switchyard dist/Switchyard-<version>.dmg
# The image holds Switchyard.app (from build.spec's BUNDLE), a link to /Applications to drag it onto, and
# "Uninstall Switchyard.command", which stops the app's running engines before moving the app to the Trash (the
# same uninstall behaviour as the .deb's prerm and the Windows uninstaller).
import os.path
import sys

defines = globals().get("defines", {})  # noqa: F821 - provided by dmgbuild
root = os.path.abspath(defines.get("root", "."))
sys.path.insert(0, os.path.join(root, "installers"))
import metadata  # noqa: E402

version = metadata.read_version()
app_name = metadata.APP_NAME
app_bundle = f"{app_name}.app"
uninstaller = f"Uninstall {app_name}.command"

# The command line's filename and volume name are replaced so every build is named the same way.
filename = os.path.join(root, "dist", f"{app_name}-{version}.dmg")
volume_name = f"{app_name} {version}"
format = defines.get("format", "UDZO")  # zlib: opens on every supported macOS; ULFO is smaller, 10.11+
filesystem = "HFS+"
size = None  # let dmgbuild measure the contents

files = [
    os.path.join(root, "dist", app_bundle),
    os.path.join(root, "installers", "macos", uninstaller),
]
symlinks = {"Applications": "/Applications"}
icon = os.path.join(root, "build", "installer", "switchyard.icns")  # written by build.spec from resources/icons

# One window: the app on the left, Applications on the right, the uninstaller below.
window_rect = ((200, 160), (560, 400))
default_view = "icon-view"
show_status_bar = False
show_toolbar = False
show_pathbar = False
show_sidebar = False
icon_size = 96
text_size = 13
icon_locations = {
    app_bundle: (140, 150),
    "Applications": (420, 150),
    uninstaller: (280, 310),
}
background = "builtin-arrow"
