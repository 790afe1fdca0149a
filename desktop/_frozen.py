"""Entry point of the packaged app (the PyInstaller bundle) and the uninstall hook all three installers call.

Two things differ when Switchyard runs from a bundle instead of a virtual environment:

- PyInstaller's bootloader points LD_LIBRARY_PATH (Linux) at the bundle's private libraries. Engines, the system
  Python that provisions vLLM, cmake and pip must not inherit that (they would load the bundle's libssl or Qt
  instead of their own), so the original value is restored before anything is spawned. The running process is not
  affected: the dynamic loader read the variable when the process started.
- Uninstallers (the .deb's prerm, Inno Setup's [UninstallRun], the macOS "Uninstall Switchyard" script) call
  `switchyard --uninstall-stop-engines` before removing files, so no engine keeps running (and holding VRAM) from
  an app that no longer exists. It reads the pidfiles the supervisor writes (`<data dir>/run/engine-*.json`),
  checks each pid still is the recorded process (pids are reused), is owned by the user whose pidfile it is and
  runs a program from that user's engines folder (pidfiles are user-writable; this runs as root), and stops the
  engines of this installation (their whole process group and tree, desktop.core.runtime.proctree):
  orphans, and those owned by a running app of this bundle (which is stopped first). Engines that another live
  Switchyard supervises (a source checkout, a pip install) are left alone. With `--all-users` (the .deb's prerm
  runs as root) it walks every local user's default data dir too, following no link a user owns
  (desktop.core.common.nofollow) and removing only the pidfile it read, relative to the open folder. User data
  (settings, history, models, engines) is kept.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from desktop.core.common import nofollow, private
from desktop.core.runtime import proctree

log = logging.getLogger("switchyard.uninstall")

STOP_ENGINES_FLAG = "--uninstall-stop-engines"
ALL_USERS_FLAG = "--all-users"
GRACE_SECONDS = 5.0


@dataclass(frozen=True)
class StoppedEngine:
    pid: int
    engine: str
    pidfile: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def restore_child_environment() -> None:
    """Give child processes the library path the user had, not the bundle's (see the module docstring)."""
    if not getattr(sys, "frozen", False):
        return
    for name in ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH"):
        original = os.environ.pop(f"{name}_ORIG", None)
        if original is not None:
            os.environ[name] = original
        else:
            os.environ.pop(name, None)


def self_command() -> list[str]:
    """The argv prefix that runs this Switchyard's CLI in a child process, from a bundle or from a checkout
    (in a bundle sys.executable is the app itself and has no `-m`)."""
    return [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "desktop"]


def default_run_dirs(all_users: bool) -> list[Path]:
    """The pidfile folders to sweep: this user's (honouring SWITCHYARD_HOME) and, with all_users, every local
    user's default data dir (XDG default on Linux, Application Support on macOS)."""
    import platformdirs

    home = os.environ.get("SWITCHYARD_HOME")  # the same override desktop.core.common.paths honours; nothing is created
    dirs = [(Path(home).expanduser() if home else Path(platformdirs.user_data_dir("switchyard"))) / "run"]
    if all_users and sys.platform != "win32":
        import pwd

        relative = "Library/Application Support/switchyard/run" if sys.platform == "darwin" else \
            ".local/share/switchyard/run"
        for entry in pwd.getpwall():
            candidate = Path(entry.pw_dir) / relative
            if candidate.is_dir() and candidate not in dirs:
                dirs.append(candidate)
    return dirs


def _engine_roots(run_dir: Path, uid: int) -> list[Path]:
    """Where the engines of the user owning `run_dir` live: beside it (<data dir>/engines) and, for the user
    running this, the engines folder the app itself uses (SWITCHYARD_ENGINES_DIR or the default).

    `run_dir` is the path really reached (nofollow.open_folder), and the folder beside it is not resolved: a
    process's program (the kernel's own path of it) must lie under it as written, so an engines folder the user
    made a link (to `/`) vouches for nothing."""
    roots = [run_dir.parent / "engines"]
    if os.name != "posix" or uid == os.getuid():
        import platformdirs

        override = os.environ.get("SWITCHYARD_ENGINES_DIR")
        roots.append((Path(override).expanduser() if override else
                      Path(platformdirs.user_data_dir("switchyard")) / "engines").resolve())
    return roots


_runs_from = proctree.runs_from  # whether a process's program lives under one of the engines roots


def _owned_by(proc: psutil.Process, uid: int | None) -> bool:
    if uid is None:
        return True
    try:
        return int(proc.uids().real) == uid and int(proc.uids().effective) == uid
    except (psutil.Error, AttributeError):
        return False


def _is_this_bundle(proc: psutil.Process) -> bool:
    if not getattr(sys, "frozen", False):
        return False
    try:
        return Path(proc.exe()).resolve() == Path(sys.executable).resolve()
    except (psutil.Error, OSError):
        return False


@dataclass
class _RunFolder:
    """A run folder being swept: its descriptor (POSIX; None on Windows), the path reached and its owner."""

    fd: int | None
    path: Path
    uid: int | None

    def names(self) -> list[str]:
        listed = os.listdir(self.fd) if self.fd is not None else os.listdir(self.path)
        return sorted(name for name in listed if fnmatch.fnmatchcase(name, "engine-*.json"))

    def where(self, name: str) -> str | Path:
        """What the record functions open: a name inside the open folder, or a path (Windows)."""
        return name if self.fd is not None else self.path / name


def _open_run_folder(run_dir: Path) -> tuple[_RunFolder, nofollow.OpenedFolder | None]:
    """The run folder, opened without following a link its user could have planted (POSIX)."""
    if os.name != "posix":
        return _RunFolder(None, run_dir, None), None
    opened = nofollow.open_folder(Path(os.path.abspath(run_dir)))
    return _RunFolder(opened.fd, opened.path, opened.st.st_uid), opened


def stop_recorded_engines(run_dirs: Iterable[Path], grace: float = GRACE_SECONDS) -> list[StoppedEngine]:
    """Stop the engines recorded in the pidfiles under `run_dirs` that belong to this installation, and remove
    their pidfiles: orphans (their owner is gone) and those owned by this very bundle, whose app is stopped first
    so it cannot restart them. Engines supervised by another live Switchyard (a source checkout, a pip install)
    are left alone: that app is not being uninstalled.

    Pidfiles are written by their user and read here as root, so nothing in them is trusted, nor any path the
    user controls: the run folder is opened without following the user's links (a folder reached through one is
    skipped, with a log line), its pidfiles are read and removed relative to it (the very file read, by device
    and inode), a pidfile counts only if the folder's owner owns it and its numbers are what Switchyard writes,
    and only processes of that user are touched: the recorded engine must still be the recorded process (same
    start time and command line) and run a program from that user's engines folder."""
    stopped: list[StoppedEngine] = []
    for run_dir in run_dirs:
        try:
            folder, opened = _open_run_folder(Path(run_dir))
        except (OSError, ValueError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("skipped %s: %s", run_dir, exc)
            continue
        try:
            roots = _engine_roots(folder.path, folder.uid if folder.uid is not None else -1)
            for name in folder.names():
                try:  # one bad file (a FIFO, a folder, hostile JSON, a vanished process) never ends the sweep
                    stopped += _stop_one(folder, name, roots, grace)
                except Exception:  # noqa: BLE001 - the uninstaller must go on with the next file
                    continue
        except OSError as exc:
            log.warning("skipped %s: %s", run_dir, exc)
        finally:
            if opened is not None:
                opened.close()
    return stopped


def _owner_of(record: dict[str, object]) -> psutil.Process | None | bool:
    """The live app that wrote the record, None when it is gone, False when its fields are not valid."""
    if not proctree.valid_owner(record):
        return False
    owner_pid, owner_created = record.get("owner_pid"), proctree.valid_time(record.get("owner_created"))
    return proctree.same_process(owner_pid, owner_created) if isinstance(owner_pid, int) else None


def _stop_one(folder: _RunFolder, name: str, roots: Sequence[Path], grace: float) -> list[StoppedEngine]:
    uid, where = folder.uid, folder.where(name)
    read = private.read_record_at(where, uid, folder.fd)
    if read is None:  # not a trustworthy record: never trusted; removed only if it is the user's own regular file
        log.warning("skipped %s: not a regular file of uid %s under 64 KiB holding a JSON object", folder.path / name,
                    uid)
        private.remove_record(where, uid, folder.fd)
        return []
    record, identity = read
    engine_record = proctree.recorded_from(record)
    owner = _owner_of(record)

    def remove() -> None:
        private.remove_record(where, uid, folder.fd, identity)

    if engine_record is None or owner is False or engine_record.created is None:
        log.warning("dropped %s: a field is missing or out of range", folder.path / name)
        remove()
        return []
    if engine_record.created < psutil.boot_time():
        remove()  # from before this boot: its pid and group id are someone else's now
        return []
    if isinstance(owner, psutil.Process) and owner.pid != os.getpid():
        if not (_is_this_bundle(owner) and _owned_by(owner, uid)):
            return []  # a live Switchyard from elsewhere (a checkout, a pip install) still runs it
        proctree.stop_pid(owner.pid, grace, uid=uid)
    stopped: list[StoppedEngine] = []
    pid = engine_record.pid
    engine = proctree.same_process(pid, engine_record.created, engine_record.cmdline)
    if engine is not None and _owned_by(engine, uid) and _runs_from(engine, roots):
        proctree.stop(engine_record, grace, uid=uid, programs=roots)
        stopped.append(StoppedEngine(pid, str(record.get("engine", "?")), str(folder.path / name)))
    elif engine is None and engine_record.pgid == pid:
        # the leader died; its group's leftovers go, if they run an engine (a reused group id is someone else's)
        proctree.stop(engine_record, grace, uid=uid, programs=roots)
    remove()
    return stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    restore_child_environment()
    if STOP_ENGINES_FLAG in args:
        stopped = stop_recorded_engines(default_run_dirs(ALL_USERS_FLAG in args))
        for item in stopped:
            print(f"stopped {item.engine} engine (pid {item.pid})")
        print(f"switchyard: {len(stopped)} running engine(s) stopped")
        return 0
    from desktop.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
