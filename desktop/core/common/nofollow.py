"""Opening a folder in another user's home, as root, without following a link that user could have planted.

The .deb's prerm runs `--uninstall-stop-engines --all-users` as root over every user's data folder. A path
resolved the usual way follows whatever links the user put there (their run folder pointed at another owner's,
their engines folder at `/`), so root would read, delete and judge processes by files that are not the app's.
Here each component is opened relative to the folder before it (`openat` with O_NOFOLLOW|O_DIRECTORY), so
nothing can be swapped between a check and its use; a link is followed only when it belongs to root or to the
user running this (an administrator's `/home -> /var/home`, or one's own links when not root), and the folder's
path is built from what was really opened, never resolved again. What lies inside is then read and removed
relative to the open folder's descriptor (desktop.core.common.private's `dir_fd` arguments).

Written by hand: neither the standard library nor psutil or platformdirs walk a path without following links
(systemd's `chase()` with CHASE_SAFE is the model). POSIX only: Windows has no `dir_fd`.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
MAX_LINKS = 32


@dataclass
class OpenedFolder:
    """A folder held open: `fd` for `dir_fd` calls, `path` as it was really reached, `st` its owner and inode."""

    fd: int
    path: Path
    st: os.stat_result

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenedFolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def trusted_link_owners() -> frozenset[int]:
    """Whose links may be followed: root's, and this user's own (following one's own link harms nobody else)."""
    return frozenset({0, os.geteuid()})


def open_folder(path: str | Path) -> OpenedFolder:
    """Open the absolute folder `path`, following only links owned by `trusted_link_owners()`.

    Raises OSError: ELOOP naming the link and its owner for a link someone else owns, ENOTDIR for a file."""
    if not os.path.isabs(path):
        raise ValueError(f"{path} is not an absolute path")
    trusted = trusted_link_owners()
    fd = os.open("/", _DIR_FLAGS)
    reached: list[str] = []
    pending = [part for part in Path(path).parts[1:]]
    links = 0
    try:
        while pending:
            name = pending.pop(0)
            if name in ("", "."):
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                where = "/" + "/".join([*reached, name])
                if not stat.S_ISLNK(st.st_mode):
                    raise OSError(errno.ENOTDIR, "not a folder", where) from None
                if st.st_uid not in trusted:
                    raise OSError(errno.ELOOP, f"a link owned by uid {st.st_uid}, not followed", where) from None
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many links", where) from None
                target = os.readlink(name, dir_fd=fd)
                if os.path.isabs(target):  # start again from / with the link's target
                    os.close(fd)
                    fd = os.open("/", _DIR_FLAGS)
                    reached = []
                pending[:0] = list(Path(target).parts[1:] if os.path.isabs(target) else Path(target).parts)
                continue
            os.close(fd)
            fd = child
            if name == "..":
                if reached:
                    reached.pop()
            else:
                reached.append(name)
        return OpenedFolder(fd, Path("/", *reached), os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise


def open_child(folder: OpenedFolder, name: str) -> OpenedFolder:
    """Open the folder `name` inside `folder`, never through a link."""
    if name in ("", ".", "..") or "/" in name:
        raise ValueError(f"{name!r} is not a folder name")
    fd = os.open(name, _DIR_FLAGS, dir_fd=folder.fd)
    return OpenedFolder(fd, folder.path / name, os.fstat(fd))
