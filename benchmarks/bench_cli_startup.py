"""How long the quick CLI commands take to answer, from process start to exit (goal: <= 0.2 s each).

    .venv/bin/python benchmarks/bench_cli_startup.py [--runs 15]

Each command runs N times as a fresh `python -m desktop.cli ...` process; the median, min and max wall times are
printed next to a bare `python -c pass` (the interpreter's own start-up) and the 1-minute load average before and
after: on a shared machine the load changes these numbers more than anything else. `status` runs against a port with
no endpoint, the common "is anything running?" case. Nothing is written to disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 0.2
COMMANDS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "switchyard --version": ["-m", "desktop.cli", "--version"],
    "switchyard --help": ["-m", "desktop.cli", "--help"],
    "switchyard status": ["-m", "desktop.cli", "status", "--port", "1"],
}


def time_once(args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,  # noqa: S603
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs per command (the median is reported)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    print(f"{'command':<24}{'median s':>10}{'min s':>8}{'max s':>8}{'vs goal':>9}")
    for label, command in COMMANDS.items():
        time_once(command)  # warm the OS file cache; not counted
        times = [time_once(command) for _ in range(args.runs)]
        median = statistics.median(times)
        print(f"{label:<24}{median:>10.3f}{min(times):>8.3f}{max(times):>8.3f}{median / GOAL_S:>8.2f}x")
    print(f"runs per command: {args.runs}; load average (1 min) before {load_before:.2f}, after "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
