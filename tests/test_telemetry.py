"""Telemetry: Prometheus text → adapter mapping → common series; /slots KV usage; GPU degradation without NVML;
the process tree; the 1 Hz hub with listeners and a WAL SQLite history; and real engines under load."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from desktop.core.engines import get_adapter
from desktop.core.runtime.supervisor import stream_completion
from desktop.core.runtime.telemetry import (
    EngineScraper,
    GpuSampler,
    MetricsDeriver,
    ProcessTree,
    Sample,
    SqliteSamples,
    Telemetry,
    parse_metrics,
    slots_summary,
)

LLAMA_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt}
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {generated}
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 0
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {running}
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="switchyard"}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="switchyard"}} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="switchyard"}} 0.25
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="switchyard"}} {generated}
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="switchyard"}} 10.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="switchyard"}} {preempted}
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="switchyard"}} 1.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="switchyard"}} {ttft_count}
vllm:time_to_first_token_seconds_count{{engine="0",model_name="switchyard"}} {ttft_count}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="switchyard"}} {ttft_sum}
"""


def test_llamacpp_metrics_become_common_series() -> None:
    adapter = get_adapter("llama.cpp")
    deriver = MetricsDeriver()
    first = adapter.map_metrics(parse_metrics(LLAMA_METRICS.format(prompt=100, generated=50, running=2)))
    assert deriver.update(10.0, first) == {"requests_running": 2.0, "requests_waiting": 1.0}
    second = adapter.map_metrics(parse_metrics(LLAMA_METRICS.format(prompt=300, generated=250, running=4)))
    values = deriver.update(12.0, second)
    assert values["prompt_tokens_per_s"] == pytest.approx(100.0)
    assert values["generation_tokens_per_s"] == pytest.approx(100.0)
    assert values["requests_running"] == 4.0


def test_vllm_histogram_deltas_give_the_interval_mean() -> None:
    adapter = get_adapter("vllm")
    deriver = MetricsDeriver()
    text = VLLM_METRICS.format(generated=100, preempted=0, ttft_count=2, ttft_sum=0.4)
    deriver.update(0.0, adapter.map_metrics(parse_metrics(text)))
    text = VLLM_METRICS.format(generated=400, preempted=3, ttft_count=6, ttft_sum=2.4)
    values = deriver.update(1.0, adapter.map_metrics(parse_metrics(text)))
    assert values["ttft_s"] == pytest.approx(0.5)  # (2.4 - 0.4) / (6 - 2)
    assert values["generation_tokens_per_s"] == pytest.approx(300.0)
    assert values["preemptions"] == 3.0
    assert values["kv_cache_usage"] == 0.25
    assert values["requests_waiting"] == 2.0


def test_counter_reset_skips_one_interval_instead_of_going_negative() -> None:
    deriver = MetricsDeriver()
    deriver.update(0.0, {"generation_tokens_total": 500.0})
    assert "generation_tokens_per_s" not in deriver.update(1.0, {"generation_tokens_total": 10.0})
    assert deriver.update(2.0, {"generation_tokens_total": 30.0})["generation_tokens_per_s"] == 20.0


def test_slots_give_kv_usage_and_inflight_tokens() -> None:
    slots: list[dict[str, Any]] = [
        {"id": 0, "n_ctx": 1000, "is_processing": True, "n_prompt_tokens": 300,
         "next_token": [{"has_next_token": True, "n_decoded": 40}]},
        {"id": 1, "n_ctx": 1000, "is_processing": False, "n_prompt_tokens": 100,
         "next_token": [{"n_decoded": 99}]},
        {"id": 2, "n_ctx": 1000, "is_processing": False},
    ]
    summary = slots_summary(slots)
    assert summary["kv_cache_usage"] == pytest.approx(400 / 3000)
    assert summary["inflight_generated_tokens"] == 40  # only slots still decoding count
    assert slots_summary({"error": "not a list"}) == {}
    # In-flight tokens make the generation rate move before requests finish.
    deriver = MetricsDeriver()
    deriver.update(0.0, {"generation_tokens_total": 0.0, "inflight_generated_tokens": 0.0})
    assert deriver.update(1.0, {"generation_tokens_total": 0.0, "inflight_generated_tokens": 40.0}
                          )["generation_tokens_per_s"] == 40.0


def test_gpu_telemetry_degrades_with_a_reason_without_nvml() -> None:
    sampler = GpuSampler()
    if sampler.unavailable is None:
        pytest.skip("this machine has an NVIDIA GPU")
    assert "GPU" in sampler.unavailable
    assert sampler.sample_once() == []


def test_process_tree_counts_children() -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],  # noqa: S603
                             stdin=subprocess.PIPE)
    try:
        alone = ProcessTree(child.pid).sample()["rss_bytes"]
        with_children = ProcessTree(os.getpid()).sample()
        assert with_children["rss_bytes"] > alone > 0
        assert "cpu_percent" in with_children
    finally:
        child.communicate(b"")
    assert ProcessTree(child.pid).sample() == {}


def test_process_tree_walks_the_machine_once_in_ten_samples_and_still_finds_a_new_child(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Walking every process each second was most of the endpoint's own CPU at c=1 (issue 59): the members are
    read every sample, the tree walked again every ten, or at once when a member has gone."""
    import subprocess
    import sys

    import psutil

    walks = []
    real_children = psutil.Process.children

    def counted(self: psutil.Process, recursive: bool = False) -> list[psutil.Process]:
        walks.append(self.pid)
        return real_children(self, recursive=recursive)

    monkeypatch.setattr(psutil.Process, "children", counted)
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; sys.stdin.readline(); "  # noqa: S603
                               "c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
                               "stdin=subprocess.PIPE); print(c.pid, flush=True); sys.stdin.readline(); "
                               "c.communicate(b'')"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdin is not None and parent.stdout is not None
    try:
        tree = ProcessTree(parent.pid)
        alone = tree.sample()["rss_bytes"]
        parent.stdin.write("\n")
        parent.stdin.flush()
        child = psutil.Process(int(parent.stdout.readline()))
        samples = [tree.sample()["rss_bytes"] for _ in range(ProcessTree.RESCAN_EVERY)]
        assert len(walks) == 2, "one walk to start, one after ten samples"
        assert samples[-1] >= alone + child.memory_info().rss * 0.5, "the new child is counted after the walk"
        parent.stdin.write("\n")
        parent.stdin.flush()
        child.wait(timeout=30)
        tree.sample()  # reads a member that has gone: the next sample walks again
        walks.clear()
        tree.sample()
        assert walks == [parent.pid]
    finally:
        parent.communicate("")


def test_hub_fans_out_and_keeps_history_in_wal_sqlite(tmp_path: Path) -> None:
    sink = SqliteSamples(tmp_path / "history.sqlite")
    hub = Telemetry(sink=sink, gpu=False)
    got: list[list[Sample]] = []
    hub.subscribe(got.append)
    hub.subscribe(lambda _s: (_ for _ in ()).throw(RuntimeError("broken listener")))  # must not stop others
    hub.publish([Sample(1.0, "proxy", "proxy_ttft_s", 0.12), Sample(1.0, "proxy", "proxy_output_tokens", 8)])
    assert len(got) == 1 and got[0][0].series == "proxy_ttft_s"
    assert [s.value for s in sink.read("proxy_ttft_s")] == [0.12]
    with sqlite3.connect(tmp_path / "history.sqlite") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 2
    assert {s.series for s in hub.latest()} == {"proxy_ttft_s", "proxy_output_tokens"}
    sink.close()


def test_hub_writes_into_the_app_store(tmp_path: Path) -> None:
    from desktop.core.storage.history import Store

    with Store(tmp_path / "history.sqlite3") as store:
        hub = Telemetry(sink=store, gpu=False)
        hub.publish([Sample(5.0, "llama.cpp@1", "requests_running", 2.0)])
        assert [(s.ts, s.value) for s in store.samples("llama.cpp@1", "requests_running")] == [(5.0, 2.0)]


def _load(base_url: str, clients: int, max_tokens: int, until: threading.Event) -> list[threading.Thread]:
    """`clients` streaming clients that send request after request until `until` is set: a fast engine may
    finish one round between two scrapes, so the load lasts until the series have seen it."""
    def client() -> None:
        while not until.is_set():
            list(stream_completion(base_url, "Tell me a story", model="switchyard", max_tokens=max_tokens,
                                   extra={"ignore_eos": True}))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def _collect_during_load(server: Any, tmp_path: Path, max_tokens: int) -> dict[str, list[float]]:
    sink = SqliteSamples(tmp_path / "samples.sqlite")
    hub = Telemetry(sink=sink, interval=0.25, gpu=False)
    by_series: dict[str, list[float]] = {}
    seen_running = threading.Event()

    def listen(samples: list[Sample]) -> None:
        for sample in samples:
            by_series.setdefault(sample.series, []).append(sample.value)
            if sample.series == "requests_running" and sample.value > 0:
                seen_running.set()

    hub.subscribe(listen)
    hub.watch(EngineScraper("engine", server.adapter, server.base_url, server.pid))
    stop = threading.Event()
    threads = _load(server.base_url, 4, max_tokens, until=stop)
    seen = seen_running.wait(120)
    stop.set()
    for thread in threads:
        thread.join(300)
    assert seen, by_series
    hub.stop()
    assert sink.read("rss_bytes"), "samples reach the SQLite history"
    sink.close()
    return by_series


@pytest.mark.engine
@pytest.mark.llamacpp
def test_real_llama_server_series_move_under_load(llama_server: Any, tmp_path: Path) -> None:
    series = _collect_during_load(llama_server, tmp_path, max_tokens=400)
    assert max(series["requests_running"]) >= 1
    assert max(series["generation_tokens_per_s"]) > 0
    assert max(series["kv_cache_usage"]) > 0  # from /slots: llama-server no longer exports it
    assert max(series["rss_bytes"]) > 10 * 2**20 and "cpu_percent" in series


@pytest.mark.engine
@pytest.mark.vllm
def test_real_vllm_series_move_under_load(vllm_server: Any, tmp_path: Path) -> None:
    series = _collect_during_load(vllm_server, tmp_path, max_tokens=64)
    assert max(series["requests_running"]) >= 1
    assert max(series["generation_tokens_per_s"]) > 0
    assert "kv_cache_usage" in series and "ttft_s" in series
    assert max(series["rss_bytes"]) > 100 * 2**20  # the api server plus its engine core process
