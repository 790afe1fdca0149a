"""/metrics without an engine: one schema from request records, parsed back with prometheus_client's parser;
served on the endpoint's port behind its guard; the Grafana dashboard asks only for metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from desktop.core.runtime.ports import find_free_port
from desktop.core.serving import control
from desktop.core.serving.metering import RequestRecord
from desktop.core.serving.metrics import EndpointMetrics
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.requestlog import RequestLog
from desktop.core.storage.history import RunRecord

DASHBOARD = Path(__file__).resolve().parents[1] / "resources" / "grafana" / "switchyard-dashboard.json"


def _record(seq: int, engine: str, status: int = 200, tokens: int = 11) -> RequestRecord:
    return RequestRecord(t=1000.0 + seq, method="POST", path="/v1/completions", upstream="u", status=status,
                         streamed=True, ttft_s=0.1, e2e_s=1.1, output_tokens=tokens, prompt_tokens=5,
                         model="switchyard", engine=engine, seq=seq)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class _History:
    def __init__(self, runs: list[RunRecord]) -> None:
        self._runs = runs

    def runs(self, limit: int = 100, kind: str | None = None) -> list[RunRecord]:
        return [r for r in self._runs if kind is None or r.kind == kind][:limit]


def test_one_schema_for_both_engines_counts_tokens_latency_switches_and_decisions() -> None:
    log = RequestLog()
    launch = RunRecord(kind="launch", engine="vllm", created_at=2000.0, id=7,
                       summary={"cold_start": {"t1_health_s": 40.0, "t2_first_token_s": 41.0,
                                               "t3_first_request_s": 42.0}})
    metrics = EndpointMetrics(log, _History([launch]), started_at=1500.0)
    for seq, engine in enumerate(("llama.cpp", "llama.cpp", "vllm"), start=1):
        log.started(_record(seq, engine))
        log.finished(_record(seq, engine))
    log.finished(_record(4, "vllm", status=502, tokens=0))
    log.started(_record(5, "vllm"))  # still in flight at the scrape
    metrics.observe_switch("llama.cpp", "vllm", "warm", 0.0)
    metrics.observe_decision("start_standby")
    got = _samples(metrics.render().decode())
    lab = lambda **kw: tuple(sorted(kw.items()))  # noqa: E731
    assert got[("switchyard_requests_total", lab(model="switchyard", engine="llama.cpp", status="200"))] == 2
    assert got[("switchyard_requests_total", lab(model="switchyard", engine="vllm", status="200"))] == 1
    assert got[("switchyard_requests_total", lab(model="switchyard", engine="vllm", status="502"))] == 1
    assert got[("switchyard_output_tokens_total", lab(model="switchyard", engine="llama.cpp"))] == 22
    assert got[("switchyard_output_tokens_total", lab(model="switchyard", engine="vllm"))] == 11  # not the 502
    assert got[("switchyard_ttft_seconds_count", lab(model="switchyard", engine="vllm"))] == 2
    # mean inter-token gap of each request: (1.1 - 0.1) / 10 = 0.1 s, in the 0.16 bucket, not in the 0.08 one
    assert got[("switchyard_inter_token_latency_seconds_bucket", lab(model="switchyard", engine="llama.cpp",
                                                                     le="0.16"))] == 2
    assert got[("switchyard_inter_token_latency_seconds_bucket", lab(model="switchyard", engine="llama.cpp",
                                                                     le="0.08"))] == 0
    assert got[("switchyard_requests_in_flight", ())] == 1
    assert got[("switchyard_switches_total", lab(from_engine="llama.cpp", to_engine="vllm", kind="warm"))] == 1
    assert got[("switchyard_autopilot_decisions_total", lab(action="start_standby"))] == 1
    assert got[("switchyard_cold_start_seconds_sum", lab(engine="vllm", phase="t3_first_request"))] == 42.0
    again = _samples(metrics.render().decode())  # a launch is counted once, however often it is scraped
    assert again[("switchyard_cold_start_seconds_count", lab(engine="vllm", phase="t1_health"))] == 1


def test_the_grafana_dashboard_asks_only_for_metrics_the_endpoint_serves() -> None:
    metrics = EndpointMetrics(RequestLog())
    metrics.observe_request(_record(1, "llama.cpp"))
    metrics.observe_switch(None, "llama.cpp", "warm", 1.0)
    metrics.observe_decision("stay")
    metrics.observe_cold_start("llama.cpp", {"t1_health_s": 1.0})
    served = {s.name for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    served |= {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    dashboard = json.loads(DASHBOARD.read_text())
    asked = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"switchyard_[a-z_]+", target["expr"])}
    assert asked and asked <= served | {n + "_bucket" for n in served}, asked - served


def test_metrics_route_on_the_endpoint_port_behind_the_api_key() -> None:
    proxy = ProxyServer(port=find_free_port(), model_name="stable", api_key="sekret")
    log = RequestLog()
    log.attach(proxy)
    proxy.add_routes(control.request_routes(log, control.new_token()))
    proxy.start()
    try:
        assert httpx.get(proxy.url + "/metrics", trust_env=False).status_code == 401
        answer = httpx.get(proxy.url + "/metrics", headers={"Authorization": "Bearer sekret"}, trust_env=False)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
        assert "switchyard_requests_in_flight 0.0" in answer.text
        foreign = httpx.get(proxy.url + "/metrics", headers={"Authorization": "Bearer sekret", "Host": "evil.com"},
                            trust_env=False)
        assert foreign.status_code == 403
    finally:
        proxy.stop()
        log.stop()
