"""What the endpoint's reasoning mirror (desktop/core/serving/reasoning.py) costs per streamed event, in isolation:
the pass-through check every chat chunk gets, and the parse-and-rewrite a chunk that carries reasoning gets, each
against the same bytes forwarded with no check at all. `benchmarks/bench_proxy.py --api chat` measures the whole
endpoint with it in place (an engine without reasoning: only the check).

    .venv/bin/python benchmarks/bench_reasoning_mirror.py [--events 200000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from desktop.core.serving.reasoning import StreamMirror  # noqa: E402


def _event(delta: dict[str, str], index: int) -> bytes:
    chunk = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1764800000 + index,
             "model": "switchyard", "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _per_event_us(events: list[bytes], mirrored: bool) -> float:
    mirror = StreamMirror()
    started = time.perf_counter()
    if mirrored:
        for event in events:
            mirror.feed(event)
    else:
        for event in events:
            bytes(event)  # the no-check baseline: touch the bytes, as forwarding would
    return (time.perf_counter() - started) / len(events) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    content = [_event({"content": " word"}, i) for i in range(args.events)]
    thinking = [_event({"reasoning": " thought"}, i) for i in range(args.events)]
    best = {name: min(_per_event_us(events, mirrored) for _ in range(5))
            for name, events, mirrored in (("baseline", content, False), ("content", content, True),
                                           ("reasoning", thinking, True))}
    result = {"events": args.events, "event_bytes": len(thinking[0]),
              "us_per_event": {k: round(v, 3) for k, v in best.items()},
              "added_us_per_event": {"content": round(best["content"] - best["baseline"], 3),
                                     "reasoning": round(best["reasoning"] - best["baseline"], 3)},
              "load_average_1min": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        added = result["added_us_per_event"]
        print(f"per streamed event ({result['event_bytes']} bytes): pass-through check +{added['content']:.2f} µs, "
              f"reasoning rewrite +{added['reasoning']:.2f} µs (load {result['load_average_1min']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
