"""The Serve page's live charts: throughput, latency, requests, KV cache, utilization and memory of the engine
that serves, fed from the session's telemetry samples (plain data, on the GUI thread) through one ChartBoard that
redraws on its own timer; a pause box; a mark where the serving engine changed.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QGridLayout, QGroupBox, QVBoxLayout, QWidget

from desktop.ui.charts import ChartBoard, LiveChart, pause_checkbox

CHARTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("Throughput", "tokens/s", {"generation_tokens_per_s": "generated", "prompt_tokens_per_s": "prompt"}),
    ("Latency", "ms", {"ttft_ms": "TTFT", "tpot_ms": "TPOT / ITL", "proxy_ttft_ms": "TTFT at endpoint"}),
    ("Requests", "requests", {"requests_running": "running", "requests_waiting": "waiting"}),
    ("KV cache", "%", {"kv_cache_percent": "KV cache used"}),
    # One unit per chart, so a series in GiB is not flattened under one in percent.
    ("Utilization", "%", {"cpu_percent": "engine CPU (100 = one core)", "gpu_util": "GPU"}),
    ("Memory", "GiB", {"rss_gib": "engine RSS (process tree)", "gpu_mem_used_gib": "GPU memory used"}),
)
# telemetry series -> (chart series, scale)
SERIES_MAP: dict[str, tuple[str, float]] = {
    "generation_tokens_per_s": ("generation_tokens_per_s", 1.0),
    "prompt_tokens_per_s": ("prompt_tokens_per_s", 1.0),
    "ttft_s": ("ttft_ms", 1000.0),
    "itl_s": ("tpot_ms", 1000.0),
    "proxy_ttft_s": ("proxy_ttft_ms", 1000.0),
    "requests_running": ("requests_running", 1.0),
    "requests_waiting": ("requests_waiting", 1.0),
    "kv_cache_usage": ("kv_cache_percent", 100.0),
    "gpu_util": ("gpu_util", 1.0),
    "gpu_mem_used_bytes": ("gpu_mem_used_gib", 1.0 / 1024**3),
    "cpu_percent": ("cpu_percent", 1.0),
    "rss_bytes": ("rss_gib", 1.0 / 1024**3),
}


class ServeCharts(QGroupBox):
    """The "Live" box: the charts in a grid of three columns under the pause box."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Live", parent)
        self.board = ChartBoard(self)
        self.charts: dict[str, LiveChart] = {}
        grid = QGridLayout()
        for index, (title, unit, series) in enumerate(CHARTS):
            chart = self.board.add(LiveChart(title, unit), series)
            self.charts[title] = chart
            grid.addWidget(chart, index // 3, index % 3)
        self.pause_box = pause_checkbox(self.board)
        charts_layout = QVBoxLayout(self)
        charts_layout.addWidget(self.pause_box)
        charts_layout.addLayout(grid)

    def push(self, samples: list[Any], serving: str | None) -> int:
        """Plot the samples of `serving` (the upstream that serves; a sample of an engine that is starting or
        draining is left out) and of the endpoint itself; how many points were taken."""
        taken = 0
        for sample in samples:
            if "@" in sample.source and serving is not None and sample.source != serving:
                continue  # an engine that is starting or draining: the charts show the one that serves
            route = SERIES_MAP.get(sample.series)
            if route is not None and self.board.push(route[0], sample.value * route[1], sample.t):
                taken += 1
        return taken

    def say_no_gpu(self) -> None:
        """Title the GPU charts so an empty GPU series reads as 'no telemetry', not as an idle GPU."""
        for title in ("Utilization", "Memory"):
            self.charts[title].plot.getPlotItem().setTitle(f"{title} (no GPU telemetry)")
