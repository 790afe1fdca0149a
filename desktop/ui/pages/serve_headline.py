"""The Serve page's three headline figures: generated tokens/s now, TTFT p50 over the last minute and requests in
flight, read off the same telemetry samples the charts plot (only the serving engine's, as the charts do), so the
page answers "is it fast, is it busy" without opening the Charts tab. TTFT is the endpoint's own per request (what
clients wait, on either engine: llama-server reports none of its own), the engine's where no request went through
the endpoint."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from PySide6.QtWidgets import QHBoxLayout, QLabel, QWidget

WINDOW_S = 60.0  # TTFT p50 over the last minute


class Headline(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.tokens_per_s: float | None = None
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=2000)  # (t, seconds): the engine's (vLLM's means)
        self.endpoint_ttfts: deque[tuple[float, float]] = deque(maxlen=2000)  # (t, seconds): one per request
        self.running: float | None = None
        self.waiting: float | None = None
        self.labels = {key: QLabel("–") for key in ("tokens", "ttft", "inflight")}
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for key, caption in (("tokens", "tokens/s"), ("ttft", "TTFT p50 (1 min)"), ("inflight", "in flight")):
            label = self.labels[key]
            label.setObjectName(f"headline_{key}")
            label.setAccessibleName(caption)
            label.setStyleSheet("font-size: 16pt; font-weight: 600;")
            layout.addWidget(label)
            layout.addWidget(QLabel(caption))
            layout.addSpacing(24)
        layout.addStretch(1)

    def push(self, samples: list[Any], serving: str | None) -> None:
        """Take the serving engine's samples (and the endpoint's own), as ServeCharts.push does."""
        for sample in samples:
            if "@" in sample.source and serving is not None and sample.source != serving:
                continue
            if sample.series == "generation_tokens_per_s":
                self.tokens_per_s = sample.value
            elif sample.series == "ttft_s":
                self.ttfts.append((sample.t, sample.value))
            elif sample.series == "proxy_ttft_s":
                self.endpoint_ttfts.append((sample.t, sample.value))
            elif sample.series == "requests_running":
                self.running = sample.value
            elif sample.series == "requests_waiting":
                self.waiting = sample.value
        self.show_figures()

    def show_figures(self) -> None:
        ttfts = self.endpoint_ttfts or self.ttfts
        newest = max(t for t, _value in ttfts) if ttfts else 0.0
        recent = [value for t, value in ttfts if t >= newest - WINDOW_S]
        self.labels["tokens"].setText("–" if self.tokens_per_s is None else f"{self.tokens_per_s:.1f}")
        self.labels["ttft"].setText(f"{statistics.median(recent) * 1000:.0f} ms" if recent else "–")
        inflight = None if self.running is None else self.running + (self.waiting or 0.0)
        self.labels["inflight"].setText("–" if inflight is None else f"{inflight:.0f}")
