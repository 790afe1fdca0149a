"""Shared provisioning machinery: per-engine install roots, a ready marker written last, an install lock.

An install is "ready" only when its marker file exists, and the marker is the last thing written, so a failed
or interrupted install is never mistaken for a working one. The lock keeps two processes (the GUI and a test
run, say) from building the same engine at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import filelock

from desktop.core.common import paths
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent

log = logging.getLogger("switchyard.engines")

MARKER = "engine.json"


def engines_root(engine: str) -> Path:
    """The folder holding every install of `engine` (one subfolder per version / variant)."""
    return paths.engines_dir() / engine


def install_root(engine: str, version: str) -> Path:
    return engines_root(engine) / version


def read_marker(root: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(root: Path, data: Mapping[str, Any]) -> None:
    """Atomically mark an install ready (write to a temp file, then rename)."""
    tmp = root / (MARKER + ".tmp")
    tmp.write_text(json.dumps(dict(data), indent=2))
    os.replace(tmp, root / MARKER)


def clear_marker(root: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (root / MARKER).unlink()


@contextlib.contextmanager
def install_lock(engine: str) -> Iterator[None]:
    """Hold an exclusive, process-wide lock for installing `engine` (waits for a concurrent install)."""
    with filelock.FileLock(paths.engines_dir() / f".{engine}.lock"):  # flock on POSIX, LockFileEx on Windows
        yield


_BUILD_PERCENT = re.compile(r"^\[\s*(\d+)%\]")
_PIP_PHASES = (("Collecting ", "resolving packages"), ("Downloading ", "downloading packages"),
               ("Building wheel", "building wheels"), ("Installing collected packages", "installing packages"),
               ("Successfully installed", "installed"))


def phase_of(line: str) -> str | None:
    """The phase a build or pip output line belongs to ("compile 40%", "link llama-server", "downloading
    packages"), or None for a line that starts none. A build prints tens of thousands of lines; the user (and a
    CI log) needs one line per phase, and the full output stays in the install log."""
    match = _BUILD_PERCENT.match(line)
    if match:
        if "Linking" in line and "executable" in line:
            return f"link {line.rsplit('/', 1)[-1].strip()}"
        if "Built target" in line:
            return None
        return f"compile {int(match.group(1)) // 10 * 10}%"
    return next((phase for prefix, phase in _PIP_PHASES if line.startswith(prefix)), None)


def run_streamed(
    argv: Sequence[str],
    progress: ProgressCallback,
    *,
    step: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    log_file: Path | None = None,
) -> list[str]:
    """Run a provisioning step: every output line goes to `log_file`, and progress hears one line per phase
    (`phase_of`); on failure, a SwitchyardError carries the output's tail and the log's path."""
    progress(ProgressEvent(f"{step}: {' '.join(argv[:4])}{' …' if len(argv) > 4 else ''}"))
    reported: set[str] = set()  # each phase once: parallel builds and pip interleave their lines
    tail: deque[str] = deque(maxlen=40)
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    sink = open(log_file, "a") if log_file else None  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(  # noqa: S603 - argument list, no shell
            list(argv),
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            if sink:
                sink.write(line + "\n")
            phase = phase_of(line) if line else None
            if phase is not None and phase not in reported:
                reported.add(phase)
                progress(ProgressEvent(f"{step}: {phase}"))
        code = proc.wait()
    except FileNotFoundError as exc:
        raise SwitchyardError(f"{step} failed: {argv[0]} not found", "install it and try again") from exc
    finally:
        if sink:
            sink.close()
    if code != 0:
        detail = "\n".join(list(tail)[-15:])
        raise SwitchyardError(
            f"{step} failed (exit {code}). Last output:\n{detail}",
            f"full log: {log_file}" if log_file else None,
        )
    return list(tail)


def python_executable() -> str:
    """The interpreter used to create engine environments (the app's own, unless overridden).

    A packaged app's sys.executable is the app itself, not a Python, so there a system python3 on PATH is used.
    """
    override = os.environ.get("SWITCHYARD_BASE_PYTHON")
    if override:
        return override
    if not getattr(sys, "frozen", False):
        return sys.executable
    found = shutil.which("python3") or shutil.which("python")
    if found is None:
        raise SwitchyardError("setting up an engine needs Python 3 with pip and venv, and none is on PATH",
                              "install it (Debian/Ubuntu: apt-get install python3-venv python3-pip) "
                              "or set SWITCHYARD_BASE_PYTHON to one")
    return found


def pip_download_sdist(package: str, version: str, dest: Path, progress: ProgressCallback, log_file: Path) -> Path:
    """Fetch one source distribution from the package registry (build dependencies as wheels)."""
    dest.mkdir(parents=True, exist_ok=True)
    existing = sorted(dest.glob("*.tar.gz"))
    if existing:
        return existing[0]
    run_streamed(
        [python_executable(), "-m", "pip", "download", "--no-deps", "--no-binary", package,
         f"{package}=={version}", "-d", str(dest)],
        progress,
        step=f"download {package} {version}",
        log_file=log_file,
    )
    found = sorted(dest.glob("*.tar.gz"))
    if not found:
        raise SwitchyardError(f"pip did not produce a source archive of {package} {version}")
    return found[0]
