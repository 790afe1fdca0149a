"""llama.cpp's own measuring tools beside llama-server: `llama-perplexity` (perplexity, and the KL divergence of a
model's token distributions against a reference's, `--kl-divergence-base/--kl-divergence`) and `llama-quantize`.
They come from the same source build as the server (the same sdist, CMake flags and backend), so a quality figure
is measured by the build that serves. An install made before the tools were built gets them once, from the sdist
kept in the install (a full build: objects are not kept), by `switchyard engines install llama.cpp` or on first
use; an official release build ships them in its archive."""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
from pathlib import Path

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import provision
from desktop.core.engines.base import EngineInstall

TOOLS = ("llama-perplexity", "llama-quantize")
log = logging.getLogger("switchyard.engines.llamacpp")


def tool_path(install: EngineInstall, name: str) -> Path:
    """Where `name` sits in `install`: beside its llama-server."""
    suffix = ".exe" if install.executable.suffix == ".exe" else ""
    return install.executable.parent / f"{name}{suffix}"


def missing_tools(install: EngineInstall) -> list[str]:
    return [name for name in TOOLS if not tool_path(install, name).is_file()]


def can_build_tools(install: EngineInstall) -> bool:
    """Whether `install` is a source build that kept its sdist (what build_tools needs)."""
    return install.root is not None and install.details.get("source", "source") == "source" and \
        any((install.root / "sdist").glob("*.tar.gz"))


def add_missing_tools(install: EngineInstall, progress: ProgressCallback) -> None:
    """What `engines install` does for a ready install without the tools (its caller holds the install lock):
    build them when it can; llama-server itself is fine either way, so a failure is a note, not an error."""
    if not missing_tools(install) or not can_build_tools(install):
        return
    try:
        ensure_tools(install, progress, locked=True)
    except SwitchyardError as exc:
        log.warning("llama.cpp's measuring tools were not built: %s", exc.message)
        progress(ProgressEvent(f"note: llama.cpp's measuring tools were not built ({exc.message})"))


def ensure_tools(install: EngineInstall, progress: ProgressCallback = no_progress, *, locked: bool = False
                 ) -> dict[str, Path]:
    """The tools of `install`, built from its kept sdist when they are missing (`locked`: the caller holds the
    install lock already)."""
    missing = missing_tools(install)
    if not missing:
        return {name: tool_path(install, name) for name in TOOLS}
    if install.root is None or install.details.get("source", "source") != "source":
        raise SwitchyardError(f"{', '.join(missing)} is not beside {install.executable}",
                              "install Switchyard's own build (`switchyard engines install llama.cpp`), or put "
                              "llama.cpp's tools from the same build next to that llama-server")
    if locked:
        build_tools(install.root, install.details.get("cmake_flags", "").split(), progress)
    else:
        with provision.install_lock("llama.cpp"):
            if missing_tools(install):
                build_tools(install.root, install.details.get("cmake_flags", "").split(), progress)
    return {name: tool_path(install, name) for name in TOOLS}


def build_tools(root: Path, flags: list[str], progress: ProgressCallback) -> None:
    """Build TOOLS from the sdist in `root/sdist` with the install's CMake flags into `root/bin`, adding only
    files that are not there (a running llama-server maps the shared libraries there: never overwritten)."""
    log_file = root / "install.log"
    archives = sorted((root / "sdist").glob("*.tar.gz"))
    if not archives:
        raise SwitchyardError(f"the llama.cpp install in {root} kept no source archive",
                              "reinstall it: `switchyard engines install llama.cpp --force`")
    src, build_dir = root / "src", root / "build"
    source_dir = src / archives[-1].name.removesuffix(".tar.gz") / "llama.cpp"
    if not source_dir.is_dir():
        progress(ProgressEvent(f"extracting {archives[-1].name}"))
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(archives[-1]) as archive:
            archive.extractall(src, filter="data")
    provision.run_streamed(["cmake", "-S", str(source_dir), "-B", str(build_dir), *flags], progress,
                           step="configure llama.cpp's tools", log_file=log_file)
    jobs = os.environ.get("SWITCHYARD_BUILD_JOBS", str(os.cpu_count() or 2))
    provision.run_streamed(["cmake", "--build", str(build_dir), "--target", *TOOLS, "-j", jobs], progress,
                           step=f"build {' and '.join(TOOLS)}", log_file=log_file)
    copy_new(build_dir / "bin", root / "bin")
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(build_dir, ignore_errors=True)


def copy_new(built: Path, bin_dir: Path) -> None:
    """Every file of `built` that `bin_dir` lacks (links as links)."""
    for item in sorted(built.iterdir()):
        target = bin_dir / item.name
        if target.exists() or target.is_symlink():
            continue
        if item.is_symlink():
            target.symlink_to(os.readlink(item))
        elif item.is_file():
            shutil.copy2(item, target)
