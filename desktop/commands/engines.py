"""`switchyard engines list|install|doctor|prepare`: which build of each engine this machine should run, and installing it."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from desktop.commands._common import LazyChoices, cell, emit_json, stderr_progress
from desktop.core.common.errors import SwitchyardError

if TYPE_CHECKING:  # the engines and hardware probing load when a command runs, not for `--help`
    from desktop.core.engines.base import DoctorFinding, EngineInstall
    from desktop.core.engines.kernels import ProbeRecord as KernelRecord
    from desktop.core.machine.hardware import HardwareSnapshot


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("engines", help="list, install and check inference engines")
    sub = parser.add_subparsers(dest="engines_command", metavar="ACTION", required=True)

    p_list = sub.add_parser("list", help="engines, the build this machine should run, and what is installed")
    _hardware_option(p_list)
    p_list.add_argument("--json", action="store_true")
    p_list.set_defaults(func=cmd_list)

    p_install = sub.add_parser("install", help="provision an engine's build for this machine (cached per user)")
    p_install.add_argument("engine", nargs="+", help="llama.cpp, vllm, or all")
    p_install.add_argument("--variant", choices=LazyChoices("desktop.core.engines.runtimes", "VARIANTS"),
                           metavar="VARIANT",
                           help="a specific backend instead of the one chosen from the hardware: %(choices)s")
    p_install.add_argument("--source", choices=("release", "source"),
                           help="llama.cpp: official release assets or a local source build (default: per platform)")
    p_install.add_argument("--allow-cpu", action="store_true", help="install a CPU-only build even on a GPU machine")
    p_install.add_argument("--dry-run", action="store_true", help="print the build and its source; change nothing")
    p_install.add_argument("--force", action="store_true", help="reinstall even if present")
    _hardware_option(p_install)
    p_install.add_argument("--json", action="store_true")
    p_install.set_defaults(func=cmd_install)

    p_doctor = sub.add_parser("doctor", help="what is missing or wrong for this machine, and how to fix it")
    _hardware_option(p_doctor)
    p_doctor.add_argument("--json", action="store_true")
    p_doctor.add_argument("--probe", action="store_true",
                          help="run the CPU kernel probe again (it runs once per engine build on this machine)")
    p_doctor.set_defaults(func=cmd_doctor)

    from desktop.commands.prepare import register_prepare

    register_prepare(sub)  # `engines prepare vllm --model M` (desktop/commands/prepare.py)


def _hardware_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", metavar="SNAPSHOT",
                        help="answer for a snapshot from `switchyard detect --json` instead of this machine")


def _hardware(args: argparse.Namespace) -> HardwareSnapshot:
    from desktop.core.machine.hardware import HardwareSnapshot, detect

    return HardwareSnapshot.load(args.hardware) if args.hardware else detect()


def cmd_list(args: argparse.Namespace) -> int:
    from desktop.core.engines import ADAPTERS, engine_builds

    builds = engine_builds(_hardware(args))
    rows = [{**build.to_json(), "model_format": ADAPTERS[build.engine].model_format} for build in builds]
    if args.json:
        emit_json(rows)
        return 0
    for build in builds:
        found = build.install
        state = (f"{found.version} ({build.installed_variant or 'unknown'} build, {found.source}: "
                 f"{found.executable})" if found else "not installed")
        print(f"{build.engine:10} {state}")
        if build.build:
            print(f"{'':10} for this machine: {build.build.variant} build ({build.build.source}) - {build.build.reason}")
        else:
            print(f"{'':10} not for this machine: {build.blocker}")
            print(f"{'':10} instead: {build.fix}")
        if build.warning:
            print(f"{'':10} warning: {build.warning}")
            print(f"{'':10} fix: {build.warning_fix}")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from desktop.core.engines import ADAPTERS, get_adapter

    names = list(ADAPTERS) if args.engine == ["all"] else args.engine
    adapters = [get_adapter(name) for name in names]  # validate every name before a long install starts
    hardware = _hardware(args)
    # Every plan first: a blocker for the second engine stops the command before the first one installs.
    plans = [adapter.install_plan(hardware, args.variant, args.source, args.allow_cpu) for adapter in adapters]
    if args.dry_run:
        if args.json:
            emit_json([plan.to_json() for plan in plans])
        else:
            for plan in plans:
                where = " ".join(plan.cmake_flags) if plan.source == "source" else ", ".join(
                    plan.urls() or plan.assets or plan.packages)
                print(f"{plan.engine}: {plan.variant} build from {plan.source}: {where}")
                print(f"  why: {plan.reason}")
        return 0
    if args.hardware:
        raise SwitchyardError("--hardware describes another machine, so nothing can be installed for it here",
                              "add --dry-run to see what would be installed there")
    results = []
    for adapter in adapters:
        install = adapter.install(stderr_progress, force=args.force, hardware=hardware, variant=args.variant,
                                  source=args.source, allow_cpu=args.allow_cpu)
        record = _probe_kernels(install)
        results.append({**install.to_json(), "kernels": _kernels_json(record, install)})
        if not args.json:
            print(f"{adapter.name}: {install.version} ({install.details.get('backend', '?')} build) "
                  f"at {install.executable}")
    if args.json:
        emit_json(results)
    return 0


def _probe_kernels(install: EngineInstall, force: bool = False) -> KernelRecord | None:
    """Run the build's CPU kernels here once (runtime.kernelprobe); a probe that cannot run is a note, never a
    failed install (the first start still retries a faulting kernel at once)."""
    from desktop.core.runtime import kernelprobe

    try:
        return kernelprobe.probe(install, stderr_progress, force=force)
    except (SwitchyardError, OSError) as exc:
        print(f"note: the CPU kernel probe of {install.executable} did not run: {exc}", file=sys.stderr)
        return None


def _kernels_json(record: KernelRecord | None, install: EngineInstall) -> dict[str, Any] | None:
    from desktop.core.engines import kernels

    if record is None:
        return None
    found = kernels.avoidance(install)
    return {"probed_at": record.at, "families": {f.family: f.to_json() for f in record.families},
            "avoidance_works": record.avoidance_works, "avoid": list(found.args) if found else [],
            "why": found.why if found else "", "record": str(kernels.record_path(install))}


def _kernel_finding(engine: str, install: EngineInstall, force: bool) -> DoctorFinding:
    """What the build's CPU kernels did here: probed now the first time (or with --probe)."""
    from desktop.core.engines.base import DoctorFinding
    from desktop.core.runtime import kernelprobe

    record = _probe_kernels(install, force)
    ok = record is None or not record.faulted or bool(record.avoidance_works)
    fix = None if ok else ("this build's repacked CPU kernels fault here even with --no-repack: rebuild it "
                         "(switchyard engines install llama.cpp --force)")
    return DoctorFinding(engine, "CPU kernels", ok, kernelprobe.describe(record, install), fix)


def cmd_doctor(args: argparse.Namespace) -> int:
    from desktop.core.common import paths, unixhttp
    from desktop.core.engines import ADAPTERS
    from desktop.core.engines.base import DoctorFinding

    hardware = _hardware(args)
    findings = [finding for adapter in ADAPTERS.values() for finding in adapter.doctor(hardware)]
    if not args.hardware:  # the kernels of this machine's builds, probed once here (another machine's: no)
        findings += [_kernel_finding(adapter.name, install, args.probe) for adapter in ADAPTERS.values()
                     if adapter.name == "llama.cpp" and (install := adapter.find_install()) is not None]
    listens = unixhttp.listener_summary(paths.run_dir())
    findings += [DoctorFinding(name, "listener", True, listens) for name in ADAPTERS]
    if args.json:
        emit_json(findings)
    else:
        for finding in findings:
            mark = "ok " if finding.ok else "MISSING"
            print(f"[{mark}] {cell(finding.engine)}: {cell(finding.check)}: {cell(finding.detail)}")
            if finding.fix:
                print(f"        fix: {cell(finding.fix)}")
    return 0 if all(f.ok for f in findings) else 1
