"""Write the app icon as Windows .ico and macOS .icns from the PNGs in resources/icons (pure Python, no Pillow).

Both formats are containers of PNG images, so the Windows, macOS and Linux installers all show the very same
pixels that the app's window icon uses. build.spec calls `write_platform_icons` on every build.
"""

from __future__ import annotations

import struct
from pathlib import Path

# Apple's PNG-capable icon types by pixel size (the @2x types reuse the next size up).
ICNS_TYPES: dict[int, tuple[bytes, ...]] = {
    16: (b"icp4",),
    32: (b"icp5", b"ic11"),
    64: (b"icp6", b"ic12"),
    128: (b"ic07",),
    256: (b"ic08", b"ic13"),
    512: (b"ic09", b"ic14"),
    1024: (b"ic10",),
}
ICO_MAX = 256
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    if not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def app_pngs(icons_dir: Path, name: str = "switchyard") -> dict[int, bytes]:
    """The square PNGs of icon `name` by size, from `icons_dir/<N>x<N>/<name>.png`."""
    found: dict[int, bytes] = {}
    for path in sorted(icons_dir.glob(f"*x*/{name}.png")):
        data = path.read_bytes()
        width, height = png_size(data)
        if width == height:
            found[width] = data
    if not found:
        raise FileNotFoundError(f"no {name}.png icons under {icons_dir}")
    return found


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """A Windows icon holding each PNG of at most 256 px (PNG entries, supported since Windows Vista)."""
    images = [(size, data) for size, data in sorted(pngs.items()) if size <= ICO_MAX]
    header = struct.pack("<HHH", 0, 1, len(images))
    offset = len(header) + 16 * len(images)
    entries, blobs = b"", b""
    for size, data in images:
        dim = 0 if size == 256 else size  # 0 means 256 in the directory entry
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(data), offset)
        blobs += data
        offset += len(data)
    return header + entries + blobs


def icns_bytes(pngs: dict[int, bytes]) -> bytes:
    """A macOS icon family holding each PNG under every type of its pixel size."""
    chunks = b""
    for size, data in sorted(pngs.items()):
        for kind in ICNS_TYPES.get(size, ()):
            chunks += kind + struct.pack(">I", 8 + len(data)) + data
    return b"icns" + struct.pack(">I", 8 + len(chunks)) + chunks


def write_platform_icons(icons_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """Write switchyard.ico and switchyard.icns into out_dir; return their paths."""
    pngs = app_pngs(icons_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ico, icns = out_dir / "switchyard.ico", out_dir / "switchyard.icns"
    ico.write_bytes(ico_bytes(pngs))
    icns.write_bytes(icns_bytes(pngs))
    return ico, icns
