"""`switchyard search|variants|pull|models|rm|token`: the model hub from the command line.

Progress goes to stderr; stdout carries only the result (the local path for `pull`, JSON with --json), so
`switchyard serve --model "$(switchyard pull REPO:Q4_K_M)"` works.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from desktop.commands import _numbers as N
from desktop.commands._common import cell, emit_json

if TYPE_CHECKING:  # the hub client (huggingface_hub, httpx) loads when a hub command runs
    from desktop.core.hub.download import DownloadProgress

FORMAT_FLAGS = ("gguf", "safetensors", "awq", "gptq", "fp8")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("search", help="search the Hugging Face Hub")
    p.add_argument("query", nargs="?", default="")
    for fmt in FORMAT_FLAGS:
        p.add_argument(f"--{fmt}", action="store_true", help=f"only {fmt.upper()} repos")
    p.add_argument("--sort", choices=["downloads", "recent", "likes", "trending"], default="downloads")
    p.add_argument("--limit", type=N.count, default=20)
    p.add_argument("--min-params", metavar="N", help="smallest parameter count, e.g. 1B")
    p.add_argument("--max-params", metavar="N", help="largest parameter count, e.g. 14B")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_search)

    p = subparsers.add_parser("variants", help="a repo's quantizations and weight sets, tagged by fit")
    p.add_argument("repo")
    p.add_argument("--revision")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_variants)

    p = subparsers.add_parser("pull", help="download REPO[:QUANT|:FILE] into the HF cache; prints the local path")
    p.add_argument("spec", metavar="REPO[:QUANT|:FILE]")
    p.add_argument("--revision")
    p.add_argument("--stall-timeout", type=N.seconds, default=30.0, help="seconds without data before reconnecting")
    p.add_argument("--retries", type=N.non_negative, default=8, help="consecutive failed attempts before giving up")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pull)

    p = subparsers.add_parser("models", help="models on this disk (HF cache and added folders)")
    p.add_argument("--add", metavar="PATH", type=Path, help="also list a folder of models or a .gguf file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = subparsers.add_parser("rm", help="delete a cached model (added paths are only forgotten)")
    p.add_argument("model", help="a name from `switchyard models`")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_rm)

    p = subparsers.add_parser("token", help="keep a Hugging Face token in the OS keyring (for gated models)")
    p.add_argument("action", choices=["set", "clear", "status"])
    p.set_defaults(func=cmd_token)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def cmd_search(args: argparse.Namespace) -> int:
    from desktop.core.hub.search import search

    formats = [f for f in FORMAT_FLAGS if getattr(args, f)]
    hits = search(
        args.query,
        formats=formats,
        sort=args.sort,
        limit=args.limit,
        min_params=args.min_params,
        max_params=args.max_params,
    )
    if args.json:
        emit_json(hits)
        return 0
    for h in hits:
        gated = " [gated]" if h.gated else ""
        print(f"{cell(h.repo_id):60} {h.downloads:>10} dl  {cell(','.join(h.formats) or '-')}{gated}")
    if not hits:
        print("no matches", file=sys.stderr)
    return 0


def cmd_variants(args: argparse.Namespace) -> int:
    from desktop.core.hub.search import list_variants

    result = list_variants(args.repo, args.revision)
    if args.json:
        emit_json(result)
        return 0
    for v in result.variants:
        mark = "*" if v.recommended else " "
        shards = f" ({v.shards} shards)" if v.shards > 1 else ""
        label = v.quantization or v.dtype or "-"
        kld = f"  KLD {v.mean_kld:.4f}" if v.mean_kld is not None else ""
        sees = f"  sees images (+ {cell(v.projector)})" if v.projector else ""
        print(f"{mark} {cell(v.name):28} {cell(v.format):12} {cell(label):10} {_size(v.size_bytes):>10}  "
              f"fit={cell(v.fit):8} {cell(v.engine)}{shards}{kld}{sees}")
    for v in result.variants:
        if v.recommended:
            print(f"* recommended for this machine: {cell(v.reason)}" if v.reason else "* recommended for this machine",
                  file=sys.stderr)
    return 0


class _StderrProgress:
    """One updating line on a terminal, a line per state change otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last_state = ""
        self.last_print = 0.0

    def __call__(self, event: DownloadProgress) -> None:
        now = time.monotonic()
        changed = event.state != self.last_state
        if not changed and now - self.last_print < (0.2 if self.tty else 2.0):
            return
        self.last_state, self.last_print = event.state, now
        eta = f" ETA {event.eta_s:.0f}s" if event.eta_s is not None else ""
        line = (
            f"[{event.fraction * 100:5.1f}%] {_size(event.done_bytes)}/{_size(event.total_bytes)} "
            f"{_size(event.speed_bps)}/s{eta} {event.state}: {event.message}"
        )
        if self.tty:
            print(f"\r\033[K{line[:160]}", end="" if event.state == "downloading" else "\n", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


def cmd_pull(args: argparse.Namespace) -> int:
    from desktop.core.hub.download import DownloadControl, RetryPolicy, pull

    control = DownloadControl()

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        control.cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        result = pull(
            args.spec,
            revision=args.revision,
            on_progress=_StderrProgress(),
            control=control,
            policy=RetryPolicy(attempts=args.retries, stall_timeout=args.stall_timeout),
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    if args.json:
        emit_json(result)
    else:
        print(result.path)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from desktop.core.hub import cache, library

    if args.add:
        library.add_path(args.add)
    models = library.list_local()
    if args.json:
        emit_json(models)
        return 0
    for m in models:
        print(f"{cell(m.name):60} {cell(m.format):12} {cell(m.quantization or '-'):10} {_size(m.size_bytes):>10}  "
              f"{cell(m.path)}" + ("  (sees images: " + cell(m.projector.name) + ")" if m.projector else ""))
    if not models:
        print(f"no models yet (HF cache: {cache.hf_cache_dir()}); try `switchyard pull`", file=sys.stderr)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from desktop.core.hub import library

    result = library.delete(args.model)
    if args.json:
        emit_json(result)
    elif result.forgotten:
        print(f"forgot {args.model} (files left in place)")
    else:
        print(f"deleted {args.model}: freed {_size(result.freed_bytes)}")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    import getpass

    from desktop.core.hub import tokens

    if args.action == "set":
        value = sys.stdin.readline() if not sys.stdin.isatty() else getpass.getpass("Hugging Face token: ")
        tokens.set_token(value)
        print("token stored in the OS keyring")
    elif args.action == "clear":
        print("token removed" if tokens.clear_token() else "no token was stored")
    else:
        print("a token is configured" if tokens.get_token() else "no token (public repos only)")
    return 0
