"""The facts every installer must agree on, in one place: name, version, identifiers, icon.

The version is read from `desktop/__init__.py` (`__version__`) as text, so build tooling needs no import of the
app. build.spec, installers/macos/dmg_settings.py and the Linux build script use this module; the Inno Setup
script gets the version through the `version.iss` include that build.spec writes, and its fixed strings are
checked against these values by tests/test_installer_recipes.py.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP_NAME = "Switchyard"  # what people see: window title, menu entry, .app, Start menu
EXE_NAME = "switchyard"  # the command, the bundle folder, the .deb package, the icon name
BUNDLE_ID = "org.switchyard.Switchyard"  # macOS CFBundleIdentifier
WINDOWS_APP_ID = "{{7D3C8E52-4B1A-4F0E-9C2D-5A6B7E8F9A01}"  # Inno Setup AppId (doubled brace is Inno's escape)
PUBLISHER = "The Switchyard developers"
SUMMARY = "Pick, launch, watch and A/B llama.cpp and vLLM on your own workstation"
ICONS_DIR = ROOT / "resources" / "icons"
UNINSTALL_FLAG = "--uninstall-stop-engines"  # see desktop/_frozen.py


def read_version(root: Path = ROOT) -> str:
    """`__version__` from desktop/__init__.py."""
    text = (root / "desktop" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"no __version__ in {root / 'desktop' / '__init__.py'}")
    return match.group(1)


if __name__ == "__main__":  # `python3 installers/metadata.py` prints the version, for shell scripts
    print(read_version())
