"""vLLM's CPU build with its own process layout (API server, EngineCore, a worker) against the model run inside
EngineCore (`--distributed-executor-backend uni`, VLLM_ENABLE_V1_MULTIPROCESSING=0), which the planner picks where
vLLM computes on one core anyway (engines/vllm.py `worker_in_engine_core`). Same eager demo plan, the layouts in
turn, each started `--repetitions` times: seconds to ready (spawn to a served completion), one request's decode
speed and four requests at once, and the ratios of the two, measured in one run.

    .venv/bin/python benchmarks/bench_vllm_layout.py [--repetitions 2] [--tokens 128]

Writes benchmarks/results/vllm-layout.json with the 1-minute load average before and after each start (rerun
above ~0.5 per core: other work changes these numbers more than the layout does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from desktop.core.engines import get_adapter  # noqa: E402
from desktop.core.engines.base import LaunchPlan  # noqa: E402
from desktop.core.engines.vllm import EXECUTOR_FLAG, MULTIPROCESSING_ENV  # noqa: E402
from desktop.core.models.demo import ensure_demo_model  # noqa: E402
from desktop.core.runtime.supervisor import EngineProcess, start_ready  # noqa: E402

RESULT = Path(__file__).parent / "results" / "vllm-layout.json"


def decode(base: str, tokens: int) -> float:
    """Tokens per second of one completion that runs its whole budget (ignore_eos)."""
    started = time.monotonic()
    answer = httpx.post(f"{base}/v1/completions", timeout=600, trust_env=False, json={
        "model": "switchyard", "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True,
        "temperature": 0})
    answer.raise_for_status()
    return answer.json()["usage"]["completion_tokens"] / (time.monotonic() - started)


def one_start(plan: LaunchPlan, tokens: int) -> dict[str, Any]:
    adapter = get_adapter("vllm")
    install = adapter.find_install()
    assert install is not None, "vLLM is not installed: switchyard engines install vllm"
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    process = start_ready(lambda p: EngineProcess(adapter, p, install, tcp=True), plan, timeout=900)
    ready = time.monotonic() - started
    try:
        decode(process.base_url, 8)  # warm
        single = decode(process.base_url, tokens)
        began = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _i: decode(process.base_url, tokens), range(4)))
        together = 4 * tokens / (time.monotonic() - began)
    finally:
        process.stop()
    return {"ready_s": round(ready, 1), "decode_tok_s": round(single, 1), "four_at_once_tok_s": round(together, 1),
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    model = ensure_demo_model()
    own = LaunchPlan(engine="vllm", model_path=model.hf_dir, ctx_per_request=2048, slots=8, eager=True,
                     dtype="float32")
    in_core = replace(own, extra_args=(EXECUTOR_FLAG, "uni"), env={MULTIPROCESSING_ENV: "0"})
    runs: dict[str, list[dict[str, Any]]] = {"own_layout": [], "in_engine_core": []}
    for _ in range(args.repetitions):
        for name, plan in (("own_layout", own), ("in_engine_core", in_core)):
            runs[name].append(one_start(plan, args.tokens))
            print(name, runs[name][-1], flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    ratios = {key: round(median("in_engine_core", key) / median("own_layout", key), 3)
              for key in ("ready_s", "decode_tok_s", "four_at_once_tok_s")}
    result = {"cores": os.cpu_count(), "model": "demo (SmolLM2-135M-shaped, float32, eager)", "runs": runs,
              "in_engine_core_over_own": ratios, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
