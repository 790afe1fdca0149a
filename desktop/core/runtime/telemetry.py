"""Live telemetry at 1 Hz: engine /metrics (through the adapter's mapping), the engine's process tree, the GPU
(NVML), and samples others push (the proxy's per-request TTFT/tokens), as one plain Python stream of `Sample`s.

One scraper per server: llama-server resets some gauges on every /metrics read, so two readers would each see
half. Counters are turned into per-second rates and histogram sum/count pairs into interval means here, so every
consumer (GUI, history, reports) sees the same common series whatever the engine.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from desktop.core.common import private, unixhttp
from desktop.core.engines.base import EngineAdapter

log = logging.getLogger("switchyard.telemetry")


@dataclass(frozen=True)
class Sample:
    """One value of one series at wall-clock time `t` (epoch seconds) from `source` (engine id, gpu0, proxy)."""

    t: float
    source: str
    series: str
    value: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


SampleListener = Callable[[list[Sample]], None]


SampleRow = tuple[float, str, str, float]  # (t, source, series, value): what history sinks take


class SampleSink(Protocol):
    """Where samples are kept for history (`desktop.core.storage.history.Store` satisfies it)."""

    def add_samples(self, rows: Sequence[SampleRow]) -> object: ...


class SqliteSamples:
    """A minimal WAL-mode SQLite sample table for tools and tests that do not want the app's `Store`."""

    def __init__(self, path: Path) -> None:
        private.private_database(path)  # 0600 whatever the umask
        self._db = sqlite3.connect(str(path), check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS samples (t REAL, source TEXT, series TEXT, value REAL)")
            self._db.commit()

    def add_samples(self, rows: Sequence[SampleRow]) -> int:
        with self._lock:
            self._db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?)", list(rows))
            self._db.commit()
        return len(rows)

    def read(self, series: str | None = None) -> list[Sample]:
        query = "SELECT t, source, series, value FROM samples"
        with self._lock:
            if series is None:
                rows = self._db.execute(query + " ORDER BY t").fetchall()
            else:
                rows = self._db.execute(query + " WHERE series = ? ORDER BY t", (series,)).fetchall()
        return [Sample(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


# --- parsing and deriving ----------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text → {sample name: {label string: value}}, the shape `EngineAdapter.map_metrics` takes.

    Sample names keep their suffixes (`_total`, `_sum`, `_count`, `_bucket`), which the adapters map by.
    """
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[labels] = float(sample.value)
    return out


def slots_summary(slots: object) -> dict[str, float]:
    """KV-cache usage and in-flight generated tokens from llama-server's /slots (it no longer exports KV usage).

    Usage = tokens held in the slots' caches ÷ total slot context. In-flight tokens let generation speed move
    while requests run (llama-server's token counters only move when a request finishes).
    """
    if not isinstance(slots, list) or not slots or not all(isinstance(s, dict) for s in slots):
        return {}
    capacity = sum(float(s.get("n_ctx") or 0) for s in slots)
    held = sum(float(s.get("n_prompt_tokens") or 0) for s in slots)
    decoding = 0.0
    for slot in slots:
        if not slot.get("is_processing"):
            continue
        next_token = slot.get("next_token")
        first = next_token[0] if isinstance(next_token, list) and next_token else next_token
        if isinstance(first, dict):
            decoding += float(first.get("n_decoded") or 0)
    out = {"inflight_generated_tokens": decoding}
    if capacity > 0:
        out["kv_cache_usage"] = min(1.0, held / capacity)
    return out


class MetricsDeriver:
    """Turns successive mapped snapshots (cumulative counters, gauges) into the common per-interval series."""

    GAUGES = ("requests_running", "requests_waiting", "kv_cache_usage")
    RATES = (("prompt_tokens_total", "prompt_tokens_per_s"), ("generation_tokens_total", "generation_tokens_per_s"))
    MEANS = (("ttft_seconds", "ttft_s"), ("itl_seconds", "itl_s"))

    def __init__(self) -> None:
        self._previous: dict[str, float] | None = None
        self._previous_t = 0.0

    def update(self, t: float, mapped: Mapping[str, float]) -> dict[str, float]:
        current = dict(mapped)
        if "inflight_generated_tokens" in current and "generation_tokens_total" in current:
            current["generation_tokens_total"] += current["inflight_generated_tokens"]
        out = {name: current[name] for name in self.GAUGES if name in current}
        previous, dt = self._previous, t - self._previous_t
        if previous is not None and dt > 0:
            for counter, series in self.RATES:
                delta = _delta(previous, current, counter)
                if delta is not None:
                    out[series] = delta / dt
            for stem, series in self.MEANS:
                count = _delta(previous, current, f"{stem}_count")
                total = _delta(previous, current, f"{stem}_sum")
                if count and total is not None:
                    out[series] = total / count
            preemptions = _delta(previous, current, "preemptions_total")
            if preemptions is not None:
                out["preemptions"] = preemptions
        self._previous, self._previous_t = current, t
        return out


def _delta(previous: Mapping[str, float], current: Mapping[str, float], key: str) -> float | None:
    if key not in previous or key not in current:
        return None
    delta = current[key] - previous[key]
    return delta if delta >= 0 else None  # a counter going back means the engine restarted: skip one interval


# --- scrapers ----------------------------------------------------------------------------------------------
class ProcessTree:
    """CPU% and RSS of a process and all its descendants (vLLM forks an engine core).

    Finding the descendants walks every process on the machine (psutil reads each /proc/<pid>/stat: 1.7 ms a tick
    with 66 processes here, ~10 ms on a desktop with hundreds), the largest part of the endpoint's own CPU at c=1
    (issue 59's profile). An engine's tree changes when it starts and when a worker goes, so it is walked again
    every RESCAN_EVERY samples or as soon as a member has gone; in between only the known members are read.
    """

    RESCAN_EVERY = 10

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._known: dict[int, psutil.Process] = {}
        self._until_rescan = 0

    def sample(self) -> dict[str, float]:
        known_root = self._known.get(self.pid)
        if self._until_rescan <= 0 or known_root is None or not known_root.is_running():  # (a reused pid is not)
            try:
                root = psutil.Process(self.pid)
                found = [root, *root.children(recursive=True)]
            except psutil.Error:
                self._known = {}
                return {}
            members = [self._known.get(proc.pid, proc) for proc in found]  # cpu_percent needs the same object
            self._until_rescan = self.RESCAN_EVERY
        else:
            members = list(self._known.values())
        self._until_rescan -= 1
        cpu = rss = 0.0
        alive: dict[int, psutil.Process] = {}
        for proc in members:
            try:
                cpu += proc.cpu_percent(None)
                rss += proc.memory_info().rss
            except psutil.Error:
                self._until_rescan = 0  # a member went: walk the tree again next time
                continue
            alive[proc.pid] = proc
        self._known = alive
        if self.pid not in alive:
            return {}
        return {"cpu_percent": cpu, "rss_bytes": rss}


class EngineScraper:
    """The one scraper of one engine server: /metrics (+ /slots where served) and the process tree."""

    def __init__(self, source: str, adapter: EngineAdapter, base_url: str, pid: int | None,
                 api_key: str | None = None, timeout: float = 2.0) -> None:
        self.source = source
        self.adapter = adapter
        self.base_url = base_url
        self._deriver = MetricsDeriver()
        self._tree = ProcessTree(pid) if pid else None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = unixhttp.client(base_url, timeout=httpx.Timeout(timeout))  # the engine's socket, or TCP
        self._url = unixhttp.http_url(base_url)
        self._slots_served: bool | None = None  # unknown until asked once
        self.last_error: str | None = None

    def sample_once(self, t: float | None = None) -> list[Sample]:
        t = time.time() if t is None else t
        values: dict[str, float] = {}
        mapped = self._scrape_metrics()
        if mapped is not None:
            if "kv_cache_usage" not in mapped and self._slots_served is not False:
                mapped.update(self._scrape_slots())
            values.update(self._deriver.update(t, mapped))
        if self._tree is not None:
            values.update(self._tree.sample())
        return [Sample(t, self.source, name, float(value)) for name, value in values.items()]

    def _scrape_metrics(self) -> dict[str, float] | None:
        try:
            response = self._client.get(self._url + self.adapter.metrics_path, headers=self._headers)
            response.raise_for_status()
            mapped = self.adapter.map_metrics(parse_metrics(response.text))
        except (httpx.HTTPError, ValueError) as exc:
            self.last_error = f"metrics unavailable: {exc}"
            return None
        self.last_error = None
        return dict(mapped)

    def _scrape_slots(self) -> dict[str, float]:
        try:
            response = self._client.get(self._url + "/slots", headers=self._headers)
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            self._slots_served = False
            return {}
        try:
            summary = slots_summary(response.json())
        except ValueError:
            summary = {}
        self._slots_served = bool(summary)
        return summary

    def close(self) -> None:
        self._client.close()


class GpuSampler:
    """Utilization, memory, power and temperature of every NVIDIA GPU through NVML.

    Without NVML (no driver, no GPU) it yields nothing and `unavailable` says why, instead of failing.
    """

    def __init__(self) -> None:
        self.unavailable: str | None = None
        self._handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml: Any = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            if not self._handles:
                self.unavailable = "NVML reports no GPU"
        except Exception as exc:  # pynvml raises its own NVMLError subclasses, or ImportError
            self.unavailable = f"no NVIDIA GPU telemetry: {exc}"

    def sample_once(self, t: float | None = None) -> list[Sample]:
        if self.unavailable:
            return []
        t = time.time() if t is None else t
        nvml = self._nvml
        samples: list[Sample] = []
        for index, handle in enumerate(self._handles):
            source = f"gpu{index}"
            readers: dict[str, Callable[[Any], float]] = {
                "gpu_util": lambda h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                "gpu_mem_used_bytes": lambda h: float(nvml.nvmlDeviceGetMemoryInfo(h).used),
                "gpu_power_w": lambda h: float(nvml.nvmlDeviceGetPowerUsage(h)) / 1000.0,
                "gpu_temp_c": lambda h: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            }
            for series, read in readers.items():
                with contextlib.suppress(Exception):  # a counter the board lacks (power on some) is skipped
                    samples.append(Sample(t, source, series, read(handle)))
        return samples


# --- the hub -----------------------------------------------------------------------------------------------
class Telemetry:
    """Runs one 1 Hz thread per engine scraper plus one for the GPUs; fans samples out to listeners and the sink."""

    def __init__(self, sink: SampleSink | None = None, interval: float = 1.0, gpu: bool = True) -> None:
        self.interval = interval
        self._sink = sink
        self._listeners: list[SampleListener] = []
        self._threads: dict[str, tuple[threading.Thread, threading.Event]] = {}
        self._lock = threading.Lock()
        self.gpu = GpuSampler() if gpu else None
        self._latest: dict[tuple[str, str], Sample] = {}

    def subscribe(self, listener: SampleListener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: SampleListener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def publish(self, samples: list[Sample]) -> None:
        """Deliver samples (scraped, or pushed by the proxy) to listeners and history."""
        if not samples:
            return
        with self._lock:
            for sample in samples:
                self._latest[(sample.source, sample.series)] = sample
        for listener in list(self._listeners):
            try:
                listener(samples)
            except Exception:  # a broken subscriber must not stop telemetry
                log.exception("telemetry listener failed")
        if self._sink is not None:
            try:
                self._sink.add_samples([(s.t, s.source, s.series, s.value) for s in samples])
            except Exception:
                log.exception("could not store telemetry samples")

    def latest(self) -> list[Sample]:
        with self._lock:
            return list(self._latest.values())

    def start(self) -> None:
        if self.gpu is not None and not self.gpu.unavailable:
            self._run("gpu", self.gpu.sample_once, None)

    def watch(self, scraper: EngineScraper) -> None:
        """Scrape this engine at the telemetry interval until `unwatch(scraper.source)`."""
        self._run(scraper.source, scraper.sample_once, scraper.close)

    def unwatch(self, source: str) -> None:
        with self._lock:
            entry = self._threads.pop(source, None)
        if entry:
            entry[1].set()
            entry[0].join(timeout=5)

    def _run(self, name: str, sample_once: Callable[[], list[Sample]], close: Callable[[], None] | None) -> None:
        self.unwatch(name)
        stop = threading.Event()

        def loop() -> None:
            next_tick = time.monotonic()
            while not stop.is_set():
                try:
                    self.publish(sample_once())
                except Exception:
                    log.exception("telemetry sampling of %s failed", name)
                next_tick += self.interval
                stop.wait(max(0.0, next_tick - time.monotonic()))
            if close:
                close()

        thread = threading.Thread(target=loop, name=f"telemetry-{name}", daemon=True)
        with self._lock:
            self._threads[name] = (thread, stop)
        thread.start()

    def stop(self) -> None:
        with self._lock:
            names = list(self._threads)
        for name in names:
            self.unwatch(name)
