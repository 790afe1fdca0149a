"""Icons and the style sheet from the repository's `resources/` folder (SVG first, PNGs at several sizes as a
fallback, so icons stay sharp at any device-pixel ratio)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from PySide6.QtCore import QSize
from PySide6.QtGui import QIcon

ROOT = Path(__file__).resolve().parents[2] / "resources"
ICONS = ROOT / "icons"


@cache
def icon(name: str) -> QIcon:
    result = QIcon()
    svg = ICONS / f"{name}.svg"
    if svg.is_file():
        result.addFile(str(svg))
    for png in sorted(ICONS.glob(f"*x*/{name}.png")):
        size = int(png.parent.name.split("x")[0])
        result.addFile(str(png), QSize(size, size))
    return result


def app_icon() -> QIcon:
    return icon("switchyard")


def style_sheet() -> str:
    path = ROOT / "styles" / "app.qss"
    return path.read_text(encoding="utf-8") if path.is_file() else ""
