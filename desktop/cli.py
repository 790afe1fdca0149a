"""`switchyard`: no arguments opens the GUI; subcommands are the headless CLI over the same core.

Every subcommand lives in a module of `desktop.commands` that exposes `register(subparsers)`; each parser sets
`func(args) -> int`. A SwitchyardError becomes one clear line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from desktop import __version__
from desktop.core.common.errors import SwitchyardError

COMMAND_MODULES = (
    "desktop.commands.engines",
    "desktop.commands.serve",
    "desktop.commands.requests",
    "desktop.commands.launch",
    "desktop.commands.profile",
    "desktop.commands.machine",
    "desktop.commands.calibrate",
    "desktop.commands.hub",
    "desktop.commands.bench",
    "desktop.commands.quality",
    "desktop.commands.export",
    "desktop.commands.gui",
)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser; its errors (a bad number, a missing option) are one line each, exit code 2."""
    from desktop.commands._numbers import OneLineErrors

    parser = OneLineErrors(
        prog="switchyard",
        description="Pick, launch, watch and A/B llama.cpp and vLLM on this machine. No arguments opens the app.",
    )
    parser.add_argument("--version", action="version", version=f"switchyard {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output to stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a command module not written yet
                continue
            raise
        module.register(subparsers)
    return parser


def _parse(parser: argparse.ArgumentParser, arguments: list[str]) -> argparse.Namespace:
    """argparse, except that a command declaring `passthrough` (launch: the agent's own arguments) gets what
    follows `--` whole: argparse hands it to no positional once one (the agent's name) came before the options."""
    if "--" in arguments:
        cut = arguments.index("--")
        head = parser.parse_args(arguments[:cut])
        if getattr(head, "passthrough", None):
            setattr(head, head.passthrough, arguments[cut + 1:])
            return head
    return parser.parse_args(arguments)


def main(argv: Sequence[str] | None = None) -> int:
    from desktop.core.common.private import apply_umask

    apply_umask()  # 077: history, logs, pidfiles and sockets (and what engines write) are this user's only
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--engine-watchdog"]:  # a frozen app starting an engine's watchdog (see core.watchdog)
        from desktop.core.runtime import watchdog

        return watchdog.main(arguments[1:])
    parser = build_parser()
    args = _parse(parser, arguments)
    import logging  # after parsing: `--version` and `--help` answer without it

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    if args.command is None:
        args = parser.parse_args(["gui"]) if "desktop.commands.gui" in sys.modules else args
        if args.command is None:
            parser.print_help()
            return 0
    try:
        return int(args.func(args) or 0)
    except SwitchyardError as exc:
        print(f"switchyard: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"switchyard: hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("switchyard: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
