"""The load generator against a real llama-server on the demo model."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from desktop.core.engines import get_adapter
from desktop.core.engines.base import LaunchPlan
from desktop.core.measure.loadgen import (
    SLO,
    LoadConfig,
    RandomWorkload,
    SharedPrefixWorkload,
    Target,
    run_load_sync,
    run_sweep_sync,
    sweep_levels,
    tokenizer_counter,
)
from desktop.core.runtime.supervisor import EngineProcess

pytestmark = [pytest.mark.engine, pytest.mark.llamacpp]


def test_closed_loop_against_llama_server(llama_server: Any, demo_model: Any) -> None:
    counter = tokenizer_counter(demo_model.hf_dir / "tokenizer.json")
    target = Target(llama_server.base_url)
    seen: list[Any] = []
    result = run_load_sync(target, RandomWorkload(input_len=24, output_len=8), LoadConfig(concurrency=4, num_requests=8),
                           token_counter=counter, slo=SLO(ttft_ms=60_000), on_bucket=seen.append)
    s = result.summary
    assert (s.completed, s.failed) == (8, 0), [r.error for r in result.requests]
    assert s.total_output_tokens == 64 and not s.tokens_estimated  # ignore_eos + usage from the server
    for request in result.requests:
        assert request.output_tokens == 8 and len(request.itl) == 7  # one token per chunk
        assert 0 < request.ttft < request.latency <= request.elapsed
        assert 20 <= request.prompt_tokens <= 25  # the demo tokenizer fitted prompts to 24 tokens (+BOS)
    assert s.request_goodput == pytest.approx(s.request_throughput)
    assert 4 <= s.max_concurrent_requests <= 8  # vllm bench counts requests active in each 1-s bucket
    assert s.ttft.p95 >= s.ttft.median > 0 and s.tpot.median > 0
    assert result.model == "switchyard"
    assert result.client_cpu < 0.85 and not result.warnings


def test_chat_and_shared_prefix_against_llama_server(llama_server: Any) -> None:
    target = Target(llama_server.base_url, api="chat")
    workload = SharedPrefixWorkload(num_prefixes=2, prefix_len=32, suffix_len=4, output_len=4)
    result = run_load_sync(target, workload, LoadConfig(concurrency=2, num_requests=4))
    assert result.summary.completed == 4, [r.error for r in result.requests]
    assert result.summary.total_output_tokens == 16


def test_real_server_killed_mid_sweep(llama_install: Any, demo_model: Any) -> None:
    adapter = get_adapter("llama.cpp")
    plan = LaunchPlan(engine=adapter.name, model_path=demo_model.gguf_path, ctx_per_request=256, slots=2)
    with EngineProcess(adapter, plan, llama_install) as engine:
        engine.start()
        engine.wait_ready(timeout=120, first_request=False)
        some_done = threading.Event()

        def on_bucket(bucket: Any) -> None:
            if bucket.completed:
                some_done.set()

        def kill_when_running() -> None:
            if some_done.wait(120):
                assert engine.pid is not None
                os.kill(engine.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_running)
        killer.start()
        levels = sweep_levels(LoadConfig(num_requests=400), concurrency=[2, 4])
        sweep = run_sweep_sync(Target(engine.base_url), RandomWorkload(input_len=8, output_len=16), levels,
                               on_bucket=on_bucket,
                               abort_check=lambda: None if engine.is_running() else "llama-server died")
        some_done.set()
        killer.join()
    assert len(sweep.levels) == 1 and sweep.aborted is not None
    level = sweep.levels[0]
    assert level.summary.completed >= 1  # partial results kept
    assert level.summary.failed >= 1
    assert len(level.requests) < 400  # it stopped instead of hammering a dead port


def test_bench_endpoint_sizes_prompts_with_the_servers_tokenize(llama_server: Any) -> None:
    """No local tokenizer for a URL: prompts are sized with llama-server's /tokenize, and the server's own count
    of what was sent (usage.prompt_tokens) is within 5% of the asked 128 tokens (one token per word gave ~294)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-m", "desktop", "bench", "--endpoint", llama_server.base_url,
                          "--input-len", "128", "--output-len", "4", "--concurrency", "4", "--requests", "8",
                          "--json", "-", "--no-history"], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    level = json.loads(out.stdout)["levels"][0]
    assert level["completed"] == 8 and level["prompt_tokens_source"] == "server /tokenize"
    assert abs(level["mean_prompt_tokens"] - 128) <= 0.05 * 128, level["mean_prompt_tokens"]
    assert abs(level["sent_prompt_tokens"] - 128) <= 1


def test_server_token_counter_speaks_llama_servers_tokenize(llama_server: Any, demo_model: Any) -> None:
    from desktop.core.measure.loadgen.client import server_token_counter

    counter = server_token_counter(Target(llama_server.base_url), None)
    assert counter is not None
    local = tokenizer_counter(demo_model.hf_dir / "tokenizer.json")
    try:
        for text in ("hello world", "the of and to in is that it for was on are as with his they at be"):
            assert counter(text) == local(text)  # special tokens (BOS) left out on both
    finally:
        counter.close()
