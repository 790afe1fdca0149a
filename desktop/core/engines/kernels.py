"""What this machine's CPU taught an engine build: which of its CPU kernels fault here, and the arguments that
avoid them, for every tool of that build the app runs.

Why it exists: llama.cpp built with GGML_NATIVE on a virtual machine that reports AMX dies with SIGILL (or
SIGSEGV) the first time a repacked quantized matrix is multiplied (shared/reference/review/amx-host.md), while an
F16 file serves. Learning that per model (one crash per new model), after the fit was computed, and for
llama-server only left every other path to crash once. So the lesson is a fact of (build, CPU):

- one record per engine build, beside the install (`<root>/kernels.json`) or, for a binary on PATH or configured,
  under the app's data folder; a record whose binary changed (a rebuild in place) is ignored;
- keyed inside by the CPU it was learned on (model name, architecture, instruction-set flags), so the same
  engines folder on a home shared by two machines keeps both answers;
- written by the kernel probe (`runtime.kernelprobe`, which `engines install` and `engines doctor` run once per
  build and CPU) with what each quantized family did, and by a start that crashed in a way the adapter knows
  arguments avoid (`runtime.crashes`);
- read by the planner (every plan for this CPU carries the avoidance, so the fit counts what is really loaded),
  the supervisor (every start) and the quality tool (llama-perplexity).

Written by hand: a small JSON file, one writer at a time under a file lock, replaced atomically."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from desktop.core.common import paths
from desktop.core.engines.base import EngineInstall
from desktop.core.engines.llamacpp_logs import NO_REPACK
from desktop.core.machine.hardware import CpuInfo, this_cpu

log = logging.getLogger("switchyard.engines.kernels")

RECORD_NAME = "kernels.json"
VERSION = 1
AVOIDING = frozenset({NO_REPACK})  # the arguments a record may hold (what the adapters' crash_retry can name)


@dataclass(frozen=True)
class Avoidance:
    """Arguments every tool of a build starts with on this CPU, why (in words a person can check), and who
    learned it: the probe, or a start that crashed."""

    args: tuple[str, ...]
    why: str
    source: str  # "probe" | "crash"


@dataclass(frozen=True)
class FamilyOutcome:
    """What one quantized family did in the probe: served a short generation, or how the engine ended."""

    family: str
    ok: bool
    exit_code: int | None = None
    reason: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "exit_code": self.exit_code, "reason": self.reason, "seconds": self.seconds}


@dataclass(frozen=True)
class ProbeRecord:
    """The probe's findings for one build on one CPU."""

    at: str
    families: tuple[FamilyOutcome, ...]
    avoidance_works: bool | None  # the faulting families served with the avoidance (None: nothing faulted)

    @property
    def faulted(self) -> list[FamilyOutcome]:
        return [f for f in self.families if not f.ok]

    def summary(self) -> str:
        """One line: what faulted and what avoids it, or that every family served."""
        if not self.faulted:
            return f"every probed kernel family served ({', '.join(f.family for f in self.families)})"
        bad = ", ".join(f"{f.family} ({f.reason or f'exit {f.exit_code}'})" for f in self.faulted)
        verdict = ("not checked" if self.avoidance_works is None else
                   "served with the avoidance" if self.avoidance_works else "the avoidance did not help either")
        return f"faulted with repacking on: {bad}; {verdict}"


def cpu_key(cpu: CpuInfo) -> str:
    """The CPU a lesson holds for: model, architecture and the instruction sets the kernels choose by."""
    sets = ",".join(name for name, on in (("avx2", cpu.avx2), ("avx512", cpu.avx512), ("amx", cpu.amx),
                                          ("neon", cpu.neon)) if on)
    return f"{cpu.arch}|{cpu.model}|{sets or 'baseline'}"


def build_id(install: EngineInstall) -> str:
    """The build a record belongs to: version, binary path, size and time (a rebuild in place is another build)."""
    try:
        stat = install.executable.stat()
        stamp = f"{stat.st_size}:{int(stat.st_mtime)}"
    except OSError:
        stamp = "missing"
    return f"{install.version}|{install.executable}|{stamp}"


def record_path(install: EngineInstall) -> Path:
    """Beside a cached build; for a binary on PATH or configured, under the app's data folder by its path."""
    if install.root is not None and install.source == "cache":
        return install.root / RECORD_NAME
    digest = hashlib.sha256(str(install.executable).encode()).hexdigest()[:16]
    return paths.data_dir() / "kernels" / f"{install.engine}-{digest}.json"


def _load(path: Path, install: EngineInstall) -> dict[str, Any]:
    """The record's CPUs for this build; {} when there is none, it is unreadable, or another build wrote it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring the unreadable kernel record %s: %s", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("build") != build_id(install):
        return {}
    cpus = data.get("cpus")
    return cpus if isinstance(cpus, dict) else {}


def _entry(install: EngineInstall, cpu: CpuInfo | None) -> dict[str, Any]:
    entry = _load(record_path(install), install).get(cpu_key(cpu or this_cpu()))
    return entry if isinstance(entry, dict) else {}


def avoidance(install: EngineInstall, cpu: CpuInfo | None = None) -> Avoidance | None:
    """What every tool of `install` starts with on `cpu` (this machine's by default), or None."""
    found = _entry(install, cpu).get("avoid")
    if not isinstance(found, dict):
        return None
    args = found.get("args")
    if not isinstance(args, list) or not args or not all(isinstance(a, str) and a in AVOIDING for a in args):
        return None  # only arguments that avoid a kernel: a record never adds anything else to a command line
    return Avoidance(tuple(args), str(found.get("why") or ""), str(found.get("source") or "crash"))


def probed(install: EngineInstall, cpu: CpuInfo | None = None) -> ProbeRecord | None:
    """The probe's findings for `install` on `cpu`, or None when it has not run here."""
    found = _entry(install, cpu).get("probe")
    if not isinstance(found, dict) or not isinstance(found.get("families"), dict):
        return None
    families = tuple(FamilyOutcome(str(name), bool(f.get("ok")), f.get("exit_code"), str(f.get("reason") or ""),
                                   float(f.get("seconds") or 0.0))
                     for name, f in found["families"].items() if isinstance(f, dict))
    works = found.get("avoidance_works")
    return ProbeRecord(str(found.get("at") or ""), families, works if isinstance(works, bool) else None)


def _update(install: EngineInstall, cpu: CpuInfo | None, changes: Mapping[str, Any]) -> None:
    """Merge `changes` into this CPU's entry of the build's record, under the record's lock."""
    path = record_path(install)
    cpu = cpu or this_cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock", timeout=60):
        cpus = _load(path, install)
        entry = dict(cpus.get(cpu_key(cpu)) or {})
        entry.update({"cpu": cpu.to_json(), "host": platform.node(), **changes})
        cpus[cpu_key(cpu)] = entry
        text = json.dumps({"version": VERSION, "engine": install.engine, "build": build_id(install), "cpus": cpus},
                          indent=2)
        fd, staging = tempfile.mkstemp(prefix=".kernels-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(staging, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise


def remember(install: EngineInstall, args: Iterable[str], why: str, *, source: str = "crash",
             cpu: CpuInfo | None = None) -> None:
    """Every later start of `install` on `cpu` begins with `args` (merged with what it already avoids)."""
    known = avoidance(install, cpu)
    merged = tuple(dict.fromkeys([*(known.args if known else ()), *args]))
    whys = "; ".join(dict.fromkeys(w for w in ((known.why if known else ""), why) if w))
    try:
        _update(install, cpu, {"avoid": {"args": list(merged), "why": whys, "source": source,
                                         "at": time.strftime("%Y-%m-%dT%H:%M:%S")}})
    except (OSError, filelock.Timeout) as exc:
        log.warning("could not store what %s avoids here (%s): the next start may crash once more",
                    install.executable, exc)


def record_probe(install: EngineInstall, families: Iterable[FamilyOutcome], avoid: Avoidance | None,
                 avoidance_works: bool | None, cpu: CpuInfo | None = None) -> ProbeRecord:
    """Store the probe's findings, and its avoidance when a family faulted and the avoidance served it; a probe
    that found nothing faulting leaves a lesson a crash taught in place (the crash was real)."""
    found = tuple(families)
    at = time.strftime("%Y-%m-%dT%H:%M:%S")
    changes: dict[str, Any] = {"probe": {"at": at, "families": {f.family: f.to_json() for f in found},
                                         "avoidance_works": avoidance_works}}
    if avoid is not None:
        known = avoidance(install, cpu)
        args = tuple(dict.fromkeys([*(known.args if known else ()), *avoid.args]))
        changes["avoid"] = {"args": list(args), "why": avoid.why, "source": "probe", "at": at}
    _update(install, cpu, changes)
    return ProbeRecord(at, found, avoidance_works)


def with_avoidance(args: Iterable[str], found: Avoidance | None) -> tuple[str, ...]:
    """`args` with the avoidance's arguments added where missing (the person's own spelling kept first)."""
    have = tuple(args)
    return have + tuple(a for a in (found.args if found else ()) if a not in have)


__all__ = ["RECORD_NAME", "Avoidance", "FamilyOutcome", "ProbeRecord", "avoidance", "build_id", "cpu_key",
           "probed", "record_path", "record_probe", "remember", "with_avoidance"]
