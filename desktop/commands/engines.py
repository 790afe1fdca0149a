"""`switchyard engines list|install|doctor`."""

from __future__ import annotations

import argparse
from typing import Any

from desktop.commands._common import emit_json, stderr_progress


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("engines", help="list, install and check inference engines")
    sub = parser.add_subparsers(dest="engines_command", metavar="ACTION", required=True)

    p_list = sub.add_parser("list", help="engines and whether they are installed")
    p_list.add_argument("--json", action="store_true")
    p_list.set_defaults(func=cmd_list)

    p_install = sub.add_parser("install", help="provision an engine (cached per user)")
    p_install.add_argument("engine", nargs="+", help="llama.cpp, vllm, or all")
    p_install.add_argument("--force", action="store_true", help="reinstall even if present")
    p_install.add_argument("--json", action="store_true")
    p_install.set_defaults(func=cmd_install)

    p_doctor = sub.add_parser("doctor", help="what is missing and how to fix it")
    p_doctor.add_argument("--json", action="store_true")
    p_doctor.set_defaults(func=cmd_doctor)


def cmd_list(args: argparse.Namespace) -> int:
    from desktop.core.engines import ADAPTERS

    rows: list[dict[str, Any]] = []
    for adapter in ADAPTERS.values():
        install = adapter.find_install()
        rows.append({
            "name": adapter.name,
            "display_name": adapter.display_name,
            "model_format": adapter.model_format,
            "installed": install is not None,
            "install": install.to_json() if install else None,
        })
    if args.json:
        emit_json(rows)
    else:
        for row in rows:
            found = row["install"]
            state = f"{found['version']} ({found['source']}: {found['executable']})" if found else "not installed"
            print(f"{row['name']:10} {state}")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from desktop.core.engines import ADAPTERS, get_adapter

    names = list(ADAPTERS) if args.engine == ["all"] else args.engine
    adapters = [get_adapter(name) for name in names]  # validate every name before a long install starts
    results = []
    for adapter in adapters:
        install = adapter.install(stderr_progress, force=args.force)
        results.append(install.to_json())
        if not args.json:
            print(f"{adapter.name}: {install.version} at {install.executable}")
    if args.json:
        emit_json(results)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from desktop.core.engines import ADAPTERS

    findings = [finding for adapter in ADAPTERS.values() for finding in adapter.doctor()]
    if args.json:
        emit_json(findings)
    else:
        for finding in findings:
            mark = "ok " if finding.ok else "MISSING"
            print(f"[{mark}] {finding.engine}: {finding.check}: {finding.detail}")
            if finding.fix:
                print(f"        fix: {finding.fix}")
    return 0 if all(f.ok for f in findings) else 1
