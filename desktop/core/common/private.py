"""The app's own files stay the user's own: folders 0700, files 0600, whatever umask the user's shell has.

History (with captured prompts), engine logs, pidfiles and sockets live under the data folder; another local user
must not read them. The CLI and the app run under umask 077 (`apply_umask`), and the places that create these
files ask for the mode explicitly as well (`private_dir`, `open_private`), so a library caller or a test under
umask 022 gets the same modes. Existing folders and files are tightened, never widened, and only when this user
owns them (a folder the user pointed SWITCHYARD_HOME at that belongs to someone else is left as it is).

`read_record` reads a small JSON record (a pidfile) written by a user that the reader does not trust, e.g. the
root uninstaller reading every user's run folder: it never follows a link, never blocks on a FIFO, refuses
anything but a small regular file owned by the expected user, and survives hostile JSON."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

APP_UMASK = 0o077
RECORD_MAX_BYTES = 64 * 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_tightened: set[str] = set()


def apply_umask() -> int:
    """Run this process (and the engines it starts) under umask 077; returns the previous umask."""
    return os.umask(APP_UMASK)


def _own(st: os.stat_result) -> bool:
    return not hasattr(os, "getuid") or st.st_uid == os.getuid()


def tighten(path: Path) -> None:
    """Drop group/other permission bits of `path` (not following a link) when this user owns it."""
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not _own(st) or not stat.S_IMODE(st.st_mode) & 0o077:
            return
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)


def private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) as 0700; tighten it once per process if it already existed."""
    key = str(path)
    if key in _tightened and path.is_dir():
        return path
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    tighten(path)
    _tightened.add(key)
    return path


def open_private(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND) -> int:
    """os.open for a file only this user may read: created 0600, never through a symlink, tightened if older."""
    fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC, 0o600)
    if os.name == "posix":
        try:
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) & 0o077 and _own(st):
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
        except OSError:
            os.close(fd)
            raise
    return fd


def write_private_text(path: Path, text: str) -> None:
    """Replace `path`'s content with `text`, mode 0600 (a planted link is replaced, not followed)."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_symlink():
            path.unlink()
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def private_database(path: Path) -> Path:
    """Make sure the SQLite file `path` exists as 0600 before SQLite opens it (SQLite gives its -wal and -shm
    files the database file's mode), and tighten an older one and its -wal/-shm."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # the app's own folders are private_dir'ed
    # An existing file is tightened by path, never opened: closing any descriptor of it would drop every POSIX
    # lock this process holds on it, the locks of SQLite connections already open here included (the classic
    # way to corrupt SQLite; seen as "disk I/O error" once a second process used the history).
    try:
        os.close(open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        if path.is_symlink():  # as before: never through a link someone planted
            raise OSError(errno.ELOOP, "the database file is a symbolic link", str(path)) from None
        tighten(path)
    for suffix in ("-wal", "-shm", "-journal"):
        tighten(path.with_name(path.name + suffix))
    return path


def read_record(path: Path | str, uid: int | None = None, dir_fd: int | None = None) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is not a trustworthy record: not a regular file (a FIFO, a
    directory, a link), not owned by `uid` (default: this user), RECORD_MAX_BYTES or more, or not a JSON object
    (including JSON nested deep enough to exhaust the parser). Never blocks and never raises for a bad file.
    With `dir_fd`, `path` is a name inside that open folder (desktop.core.common.nofollow)."""
    read = read_record_at(path, uid, dir_fd)
    return read[0] if read is not None else None


def read_record_at(path: Path | str, uid: int | None = None, dir_fd: int | None = None
                   ) -> tuple[dict[str, Any], tuple[int, int]] | None:
    """`read_record`, with the (device, inode) of the file it read: `remove_record` removes that file only."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)  # of what was opened: no window between a check and the read
        wanted = uid if uid is not None else (os.getuid() if hasattr(os, "getuid") else None)
        if not stat.S_ISREG(st.st_mode) or st.st_size >= RECORD_MAX_BYTES:
            return None
        if wanted is not None and st.st_uid != wanted:
            return None
        data = os.read(fd, RECORD_MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        record = json.loads(data, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return None
    return (record, (st.st_dev, st.st_ino)) if isinstance(record, dict) else None


def _not_json(name: str) -> Any:
    """NaN and Infinity are Python's extensions, not JSON: no record Switchyard writes holds one (a NaN start time
    once passed every pid-reuse check)."""
    raise ValueError(f"{name} is not JSON")


def remove_record(path: Path | str, uid: int | None = None, dir_fd: int | None = None,
                  identity: tuple[int, int] | None = None) -> None:
    """Unlink `path` only when it is a regular file owned by `uid` (default: this user) and, given `identity`,
    the very file that was read (its device and inode): never a folder or a link someone planted, never another
    user's file. With `dir_fd`, `path` is a name inside that open folder, so no link above it is followed."""
    with contextlib.suppress(OSError):
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        wanted = uid if uid is not None else (os.getuid() if hasattr(os, "getuid") else None)
        if identity is not None and (st.st_dev, st.st_ino) != identity:
            return
        if stat.S_ISREG(st.st_mode) and (wanted is None or st.st_uid == wanted):
            os.unlink(path, dir_fd=dir_fd)
