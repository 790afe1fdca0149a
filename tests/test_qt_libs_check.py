"""scripts/check-qt-libs.sh, the first-run check run-app.sh makes before opening the window: run against a fake
plugin, fake ldd/ldconfig output and a fake apt-get (a fresh Debian desktop image is not available here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check-qt-libs.sh"
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="bash script for Linux desktops")

LDD_OUTPUT = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f)
\tlibxcb-icccm.so.4 => {icccm}
\tlibxcb-keysyms.so.1 => {keysyms}
\tlibxcb.so.1 => /lib/x86_64-linux-gnu/libxcb.so.1 (0x00007f)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f)
"""


def _fake_tools(tmp_path: Path, *, missing: bool, cursor: bool = True, extra_missing: str = "") -> dict[str, str]:
    """Executables standing in for ldd, `ldconfig -p` and apt-get. The fake apt-get logs its arguments and makes
    the libraries 'installed' (the fake ldd then finds them)."""
    installed = tmp_path / "installed"
    if not missing:
        installed.touch()
    found = "/lib/x86_64-linux-gnu/lib.so (0x00007f)"
    ldd = tmp_path / "ldd"
    ldd.write_text("#!/bin/sh\n"
                   f"if [ -e {installed} ]; then cat <<'EOF'\n{LDD_OUTPUT.format(icccm=found, keysyms=found)}EOF\n"
                   f"else cat <<'EOF'\n{LDD_OUTPUT.format(icccm='not found', keysyms='not found')}{extra_missing}EOF\n"
                   "fi\n")
    ldconfig = tmp_path / "ldconfig"
    cursor_line = "\tlibxcb-cursor.so.0 (libc6,x86-64) => /lib/x86_64-linux-gnu/libxcb-cursor.so.0\n"
    ldconfig.write_text("#!/bin/sh\n"
                        f"if [ -e {installed} ] || [ {int(cursor)} = 1 ]; then printf '{cursor_line}'; fi\n")
    apt = tmp_path / "apt-get"
    apt.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "apt.log"}\ntouch {installed}\n')
    plugin = tmp_path / "libqxcb.so"
    plugin.write_bytes(b"\x7fELF")
    for tool in (ldd, ldconfig, apt):
        tool.chmod(0o755)
    return {"SWITCHYARD_QT_PLUGIN": str(plugin), "SWITCHYARD_LDD": str(ldd), "SWITCHYARD_LDCONFIG": str(ldconfig),
            "SWITCHYARD_APT_GET": str(apt)}


def _check(env: dict[str, str], euid: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,  # noqa: S603, S607
                          env={**os.environ, **env, "SWITCHYARD_EUID": str(euid)})


def test_all_libraries_present_opens_the_window_silently(tmp_path: Path) -> None:
    result = _check(_fake_tools(tmp_path, missing=False), euid=1000)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == ""


def test_a_user_gets_the_one_apt_get_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    result = _check(_fake_tools(tmp_path, missing=True, cursor=False), euid=1000)
    assert result.returncode == 1
    assert result.stdout.strip() == "sudo apt-get install -y libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1"
    assert "libxcb-icccm.so.4" in result.stderr and "libxcb-cursor.so.0" in result.stderr
    assert not (tmp_path / "apt.log").exists(), "a user is told, never installed for"


def test_root_with_apt_installs_the_packages_then_opens(tmp_path: Path) -> None:
    result = _check(_fake_tools(tmp_path, missing=True), euid=0)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "apt.log").read_text().split() == ["install", "-y", "--no-install-recommends",
                                                          "libxcb-icccm4", "libxcb-keysyms1"]


def test_a_library_without_a_known_package_is_named(tmp_path: Path) -> None:
    env = _fake_tools(tmp_path, missing=True, extra_missing="\tlibweird.so.3 => not found\n")
    result = _check(env, euid=0)
    assert result.returncode == 1
    assert "apt-file search libweird.so.3" in result.stderr
    assert not (tmp_path / "apt.log").exists()

