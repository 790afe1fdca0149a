"""The severity of an engine's log line, read from the formats the engines write, so a log view can colour and
filter them: llama-server prefixes each line with its elapsed time and a level letter (`0.00.474 I srv ...`,
`W`, `E`, `D`); vLLM uses Python logging (`(APIServer pid=1) WARNING 12-01 05:04:20 [file.py:255] ...`); Python
tracebacks and bare `error:` lines (argument errors, crashes) are errors. Continuation lines (indented, e.g. a
traceback's frames) keep the level of the line before them.
"""

from __future__ import annotations

import re

LEVELS = ("debug", "info", "warning", "error")  # ascending severity

_LLAMA = re.compile(r"^\s*\d+\.\d+\.\d+\.\d+ ([DIWE]) ")
_LLAMA_LEVELS = {"D": "debug", "I": "info", "W": "warning", "E": "error"}
_PYTHON = re.compile(r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\b(?= \d\d-\d\d |:)")
_PYTHON_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warning", "WARN": "warning", "ERROR": "error",
                  "CRITICAL": "error"}
_ERROR = re.compile(r"^(Traceback \(most recent call last\)|[\w.]+(Error|Exception)\b|error\b|fatal\b|terminate called)",
                    re.IGNORECASE)
_WARNING = re.compile(r"^(\S+: )?\w*Warning\b|^warning\b", re.IGNORECASE)


def line_level(line: str, previous: str = "info") -> str:
    """`debug`, `info`, `warning` or `error` for one log line; `previous` is the level of the line before."""
    match = _LLAMA.match(line)
    if match:
        return _LLAMA_LEVELS[match.group(1)]
    match = _PYTHON.search(line[:80])
    if match:
        return _PYTHON_LEVELS[match.group(1)]
    stripped = line.strip()
    if not stripped:
        return previous
    if line[:1] in (" ", "\t") and previous in ("warning", "error"):
        return previous  # a traceback frame, a wrapped message
    if _ERROR.match(stripped):
        return "error"
    if _WARNING.match(stripped):
        return "warning"
    return "info"


def at_least(level: str, minimum: str) -> bool:
    return LEVELS.index(level) >= LEVELS.index(minimum)
