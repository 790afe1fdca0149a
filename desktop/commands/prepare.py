"""`switchyard engines prepare vllm --model M`: one start of the plan the endpoint would launch, through its first
request, so vLLM's compile cache for that model and plan is warm and the real first start is short."""

from __future__ import annotations

import argparse
import sys

from desktop.commands import _numbers as N
from desktop.commands._common import emit_json, stderr_progress
from desktop.core.common.defaults import DEFAULT_CTX_PER_REQUEST, DEFAULT_SLOTS


def register_prepare(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("prepare", help="start an engine once on a model so its compile cache is warm "
                                            "(vLLM: the real first start then loads instead of compiling)")
    parser.add_argument("engine", choices=("vllm",), help="the engine to prepare (vLLM compiles; llama.cpp "
                                                          "does not need it)")
    parser.add_argument("--model", required=True, help="`demo`, or a Hugging Face model folder")
    parser.add_argument("--ctx", type=N.count, default=DEFAULT_CTX_PER_REQUEST, help="context per request, as you will serve it")
    parser.add_argument("--parallel", type=N.count, default=DEFAULT_SLOTS, help="requests at once, as you will serve it")
    parser.add_argument("--eager", action="store_true", help="the plan runs --enforce-eager (nothing to compile)")
    parser.add_argument("--ready-timeout", type=N.seconds, default=1800.0)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from desktop.core.planning.planner import ask
    from desktop.core.serving.prepare import prepare

    asked = ask(args.engine, args.model, {"ctx_per_request": args.ctx, "slots": args.parallel})
    done = prepare(asked, eager=args.eager, progress=stderr_progress, ready_timeout=args.ready_timeout)
    if args.json:
        emit_json(done.to_json())
        return 0
    phases = ", ".join(f"{p['label']} {p['seconds']:.1f} s" for p in done.cold_start.get("phases") or [])
    print(f"prepared {args.engine} on {args.model}: compile cache {done.compile_cache or 'not reported'} "
          f"({'was already warm' if done.was_warm else 'filled now'}) in {done.cache_dir}", file=sys.stderr)
    print(f"this start: {phases}", file=sys.stderr)
    return 0
