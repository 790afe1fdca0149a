"""Render the PNG icons from the SVG sources (run after editing an SVG): python resources/make_icons.py"""

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

HERE = Path(__file__).parent / "icons"
APP_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
PAGE_SIZES = (24, 48)


def render(svg: Path, size: int) -> None:
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    QSvgRenderer(str(svg)).render(painter)
    painter.end()
    out = HERE / f"{size}x{size}" / f"{svg.stem}.png"
    out.parent.mkdir(exist_ok=True)
    image.save(str(out))


if __name__ == "__main__":
    app = QGuiApplication([])
    for svg in sorted(HERE.glob("*.svg")):
        for size in APP_SIZES if svg.stem == "switchyard" else PAGE_SIZES:
            render(svg, size)
