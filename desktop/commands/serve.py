"""`switchyard serve`: start a real engine on a model, wait until it really serves, then either stream one
prompt and exit (`--prompt`) or serve until Ctrl-C/SIGTERM. Nothing is left running afterwards."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from desktop.commands._common import emit_json, stderr_progress
from desktop.core.engines import get_adapter
from desktop.core.engines.base import LaunchPlan
from desktop.core.errors import EngineFailed, EngineNotInstalled
from desktop.core.models import resolve_model
from desktop.core.ports import ensure_port_free
from desktop.core.supervisor import EngineProcess, reap_orphans, stream_completion


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="run an engine on a model (OpenAI-compatible, 127.0.0.1)")
    parser.add_argument("--engine", required=True, help="llama.cpp or vllm")
    parser.add_argument("--model", required=True, help="`demo`, a GGUF file, or a Hugging Face folder")
    parser.add_argument("--port", type=int, default=0, help="engine port (default: a free one)")
    parser.add_argument("--ctx", type=int, default=2048, help="context length per request")
    parser.add_argument("--parallel", type=int, default=4, help="concurrent sequences (slots / max_num_seqs)")
    parser.add_argument("--prompt", help="stream one completion for this prompt, print phase times, then stop")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing a missing engine")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=cmd_serve)


class _Terminate(Exception):
    pass


def cmd_serve(args: argparse.Namespace) -> int:
    # Validate everything cheap before anything slow starts.
    adapter = get_adapter(args.engine)
    if args.port:
        ensure_port_free(args.port)
    model_path = resolve_model(args.model, adapter, stderr_progress)
    install = adapter.find_install()
    if install is None:
        if args.no_install:
            raise EngineNotInstalled(f"{adapter.display_name} is not installed",
                                     f"run `switchyard engines install {adapter.name}`")
        print(f"{adapter.display_name} is not installed yet: installing it once (cached for later runs)",
              file=sys.stderr)
        install = adapter.install(stderr_progress)
    reap_orphans()
    plan = LaunchPlan(engine=adapter.name, model_path=model_path, port=args.port, ctx=args.ctx,
                      parallel=args.parallel)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise _Terminate(signum)

    previous = signal.signal(signal.SIGTERM, on_signal)
    engine = EngineProcess(adapter, plan, install)
    try:
        engine.start()
        print(f"starting {adapter.display_name} on {engine.base_url} (log: {engine.log_path})", file=sys.stderr)
        cold = engine.wait_ready(timeout=args.ready_timeout, first_request=args.prompt is None)
        if args.prompt is not None:
            return _prompt_once(args, engine)
        print(f"ready: {engine.base_url}/v1 serving {model_path.name} as '{plan.served_model_name}' "
              f"(T1 {cold.t1_health_s:.2f} s, first token {cold.t2_first_token_s:.2f} s). Ctrl-C to stop.",
              file=sys.stderr)
        stopped = threading.Event()
        engine.subscribe(lambda event: stopped.set() if event.state and event.state.value == "crashed" else None)
        while not stopped.wait(0.5):
            pass
        raise engine.failure()
    except (KeyboardInterrupt, _Terminate):
        print("stopping", file=sys.stderr)
        return 0
    finally:
        engine.stop()
        signal.signal(signal.SIGTERM, previous)


def _prompt_once(args: argparse.Namespace, engine: EngineProcess) -> int:
    cold = engine.cold_start
    t0 = time.monotonic() - engine.elapsed()
    sent = time.monotonic() - t0
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    for delta in stream_completion(engine.base_url, args.prompt, max_tokens=args.max_tokens,
                                   model=engine.plan.served_model_name):
        if delta.error:
            raise EngineFailed(f"the engine answered with an error: {delta.error}")
        if delta.has_token:
            if first is None:
                first = time.monotonic() - t0
            text.append(delta.text)
            if not args.json:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        if delta.usage:
            usage = delta.usage
    done = time.monotonic() - t0
    result = {
        "engine": engine.adapter.name,
        "engine_version": engine.install.version,
        "model": str(engine.plan.model_path),
        "base_url": engine.base_url,
        "prompt": args.prompt,
        "completion": "".join(text),
        "usage": usage,
        "phases_s": {
            "spawn": 0.0,
            "ready": cold.t1_health_s,
            "request_sent": round(sent, 3),
            "first_token": round(first, 3) if first is not None else None,
            "done": round(done, 3),
        },
        "log_markers_s": cold.markers,
        "page_cache_resident": cold.page_cache_resident,
    }
    if args.json:
        emit_json(result)
    else:
        print()
        phases = result["phases_s"]
        print(f"spawn → ready {phases['ready']:.2f} s → first token {phases['first_token'] or float('nan'):.2f} s "
              f"→ done {phases['done']:.2f} s", file=sys.stderr)
    return 0
