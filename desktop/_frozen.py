"""Entry point of the packaged app (the PyInstaller bundle) and the uninstall hook all three installers call.

Two things differ when Switchyard runs from a bundle instead of a virtual environment:

- PyInstaller's bootloader points LD_LIBRARY_PATH (Linux) at the bundle's private libraries. Engines, the system
  Python that provisions vLLM, cmake and pip must not inherit that (they would load the bundle's libssl or Qt
  instead of their own), so the original value is restored before anything is spawned. The running process is not
  affected: the dynamic loader read the variable when the process started.
- Uninstallers (the .deb's prerm, Inno Setup's [UninstallRun], the macOS "Uninstall Switchyard" script) call
  `switchyard --uninstall-stop-engines` before removing files, so no engine keeps running (and holding VRAM) from
  an app that no longer exists. It reads the pidfiles the supervisor writes (`<data dir>/run/engine-*.json`),
  checks each pid still is the recorded process (pids are reused), and stops the engines of this installation:
  orphans, and those owned by a running app of this bundle (which is stopped first). Engines that another live
  Switchyard supervises (a source checkout, a pip install) are left alone. With `--all-users` (the .deb's prerm
  runs as root) it walks every local user's default data dir too. User data (settings, history, models, engines)
  is kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

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


def _matches(pid: int, created: object) -> psutil.Process | None:
    """The live process `pid` if it is the one recorded (same start time), else None."""
    try:
        proc = psutil.Process(pid)
        started = proc.create_time()
    except (psutil.Error, ValueError):
        return None
    if not isinstance(created, int | float) or abs(started - float(created)) >= 1.0:
        return None
    return proc


def _terminate_tree(proc: psutil.Process, grace: float) -> None:
    """SIGTERM the process, its process group (engines run in their own session) and its descendants; SIGKILL
    whatever is left after `grace` seconds."""
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        members = [proc]
    with contextlib.suppress(OSError):
        if os.name == "posix" and os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGTERM)
    for member in members:
        with contextlib.suppress(psutil.Error):
            member.terminate()
    _gone, alive = psutil.wait_procs(members, timeout=grace)
    for member in alive:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(alive, timeout=grace)


def _is_this_bundle(proc: psutil.Process) -> bool:
    if not getattr(sys, "frozen", False):
        return False
    try:
        return Path(proc.exe()).resolve() == Path(sys.executable).resolve()
    except (psutil.Error, OSError):
        return False


def stop_recorded_engines(run_dirs: Iterable[Path], grace: float = GRACE_SECONDS) -> list[StoppedEngine]:
    """Stop the engines recorded in the pidfiles under `run_dirs` that belong to this installation, and remove
    their pidfiles: orphans (their owner is gone) and those owned by this very bundle, whose app is stopped first
    so it cannot restart them. Engines supervised by another live Switchyard (a source checkout, a pip install)
    are left alone: that app is not being uninstalled."""
    stopped: list[StoppedEngine] = []
    for run_dir in run_dirs:
        for pidfile in sorted(Path(run_dir).glob("engine-*.json")):
            try:
                record = json.loads(pidfile.read_text())
                pid = int(record["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                pidfile.unlink(missing_ok=True)
                continue
            owner = _matches(int(record.get("owner_pid") or 0), record.get("owner_created"))
            if owner is not None and owner.pid != os.getpid():
                if not _is_this_bundle(owner):
                    continue  # a live Switchyard from elsewhere (a checkout, a pip install) still runs it
                _terminate_tree(owner, grace)
            engine = _matches(pid, record.get("created"))
            if engine is not None:
                _terminate_tree(engine, grace)
                stopped.append(StoppedEngine(pid, str(record.get("engine", "?")), str(pidfile)))
            pidfile.unlink(missing_ok=True)
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
