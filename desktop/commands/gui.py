"""`switchyard gui` (also what `switchyard` with no arguments runs): open the desktop app.

`--screenshots DIR` renders every page offscreen with real data (it starts the demo model on llama.cpp for the
Serve page) and saves one PNG per page, then exits. Qt is imported only when the command runs, so the headless
CLI stays fast and works without a display.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("gui", help="open the desktop app (the default with no command)")
    parser.add_argument("--screenshots", type=Path, metavar="DIR",
                        help="render each page offscreen with real data, save one PNG per page into DIR, and exit")
    parser.add_argument("--quit-when-ready", action="store_true",
                        help="print the time to an interactive window and exit (start-up measurement)")
    parser.add_argument("--run-job", metavar="JSON", help=argparse.SUPPRESS)  # the GUI's benchmark child process
    parser.set_defaults(func=cmd_gui)


def cmd_gui(args: argparse.Namespace) -> int:
    if args.run_job is not None:
        from desktop.core.measure.jobs import main

        return main(args.run_job)
    from desktop.ui.app import run

    if args.screenshots is None:
        return run(quit_when_ready=args.quit_when_ready)
    out: Path = args.screenshots
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from desktop.ui.screenshots import take_screenshots  # the driver: desktop.ui.app does not import it

    return run(quit_when_ready=args.quit_when_ready, with_window=lambda window: take_screenshots(window, out))
