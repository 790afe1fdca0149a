"""Load generator for any OpenAI-compatible endpoint, measuring like `vllm bench serve`."""

from __future__ import annotations

from desktop.core.measure.loadgen.client import Target, check_target, send_request
from desktop.core.measure.loadgen.metrics import (
    SLO,
    BenchmarkSummary,
    Distribution,
    LiveBucket,
    RequestResult,
    summarize,
)
from desktop.core.measure.loadgen.runner import (
    DEFAULT_CONCURRENCY,
    LoadConfig,
    LoadResult,
    SweepResult,
    run_load,
    run_load_sync,
    run_sweep,
    run_sweep_sync,
    sweep_levels,
)
from desktop.core.measure.loadgen.workload import (
    JsonlWorkload,
    RandomWorkload,
    RequestSpec,
    SharedPrefixWorkload,
    Workload,
    generate,
    tokenizer_counter,
    write_jsonl,
)

__all__ = [
    "DEFAULT_CONCURRENCY", "SLO", "BenchmarkSummary", "Distribution", "JsonlWorkload", "LiveBucket", "LoadConfig",
    "LoadResult", "RandomWorkload", "RequestResult", "RequestSpec", "SharedPrefixWorkload", "SweepResult", "Target",
    "Workload", "check_target", "generate", "run_load", "run_load_sync", "run_sweep", "run_sweep_sync", "send_request",
    "summarize", "sweep_levels", "tokenizer_counter", "write_jsonl",
]
