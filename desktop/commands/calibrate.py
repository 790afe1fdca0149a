"""`switchyard calibrate [--model M]`: ask each installed engine how much memory it really takes here.

Each installed engine is launched briefly at a small context (llama-server with its memory lines on, vLLM as the
app launches it), its own memory report is read, and the predicted and measured bytes per component are stored
for this machine's accelerator set; `switchyard fit` (and the Machine page) then correct by them.
"""

from __future__ import annotations

import argparse
import sys

from desktop.commands import _numbers as N
from desktop.commands._common import emit_json
from desktop.core.runtime.calibrate import CALIBRATE_CTX, calibrate, describe


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("calibrate", help="measure the engines' real memory here and correct the fit by it")
    p.add_argument("--model", default="demo", help="a .gguf file (llama.cpp), a Hugging Face folder (vLLM), or demo "
                                                  "(default: both formats of the demo model)")
    p.add_argument("--engine", help="only this engine (llama.cpp or vllm); default: every installed one")
    p.add_argument("--ctx", type=N.count, default=CALIBRATE_CTX, help="context per request of the probe launch")
    p.add_argument("--timeout", type=N.seconds, default=900.0, help="seconds to wait for each engine")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from desktop.core.engines import engine_names
    from desktop.core.planning.fit import normalise_engine

    engines = [normalise_engine(args.engine)] if args.engine else engine_names()
    results = [calibrate(engine, args.model, args.ctx, args.timeout) for engine in engines]
    if args.json:
        emit_json({"results": results})
    else:
        for found in results:
            print("\n".join(describe(found)))
    measured = [r for r in results if r.get("started")]
    if not measured:
        reasons = "; ".join(f"{r['engine']}: {r.get('skipped') or r.get('error')}" for r in results)
        print(f"calibrate: nothing measured ({reasons})", file=sys.stderr)
        return 1
    return 0
