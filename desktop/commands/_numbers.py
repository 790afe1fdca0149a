"""Argument types for every number a user types on the command line, so a bad one (`--parallel -3`, `--port 70000`,
`--gpu-memory-utilization 1.5`, `--timeout nan`) fails in argparse with one clear line, before anything starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

MAX_TCP_PORT = 65535
INT32_MAX = 2**31 - 1  # what the engines parse counts into (llama.cpp's stoi, vLLM's ints)


def whole(minimum: int = 1, maximum: int = INT32_MAX) -> Callable[[str], int]:
    """A whole number in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    parse.__name__ = "whole number"  # argparse names the type in its own messages
    return parse


def number(minimum: float = 0.0, maximum: float = math.inf, *, above_minimum: bool = True
           ) -> Callable[[str], float]:
    """A finite number greater than `minimum` (or equal to it when `above_minimum` is False), at most `maximum`."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < minimum or (above_minimum and value == minimum):
            raise argparse.ArgumentTypeError(
                f"must be {'greater than' if above_minimum else 'at least'} {minimum:g}, got {value:g}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}, got {value:g}")
        return value

    parse.__name__ = "number"
    return parse


count = whole(1)  # slots, sequences, requests, tokens, GPUs, repetitions
non_negative = whole(0)  # warm-up requests, retries, GPU layers
port = whole(1, MAX_TCP_PORT)
port_or_free = whole(0, MAX_TCP_PORT)  # 0 picks a free port
seconds = number(0.0)  # timeouts, durations, lifetimes: > 0
positive = number(0.0)
non_negative_number = number(0.0, above_minimum=False)
fraction = number(0.0, 1.0)  # gpu_memory_utilization: (0, 1]


class OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose errors are one line (what is wrong and where to look), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
