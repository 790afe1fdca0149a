"""Cost from power: recorded NVML power samples give an energy cost per 1M tokens beside the hourly price, in the
A/B's costs and its report; the price per kWh is a setting (schema v4, migrated from v3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_reports import engine

from desktop.core.measure.ab import ABConfig, analyse
from desktop.core.measure.energy import PowerSampler, energy_cost
from desktop.core.measure.reports import write_ab_report
from desktop.core.runtime.telemetry import Sample
from desktop.core.storage import settings as core_settings


def test_energy_is_the_integral_of_power_over_the_window() -> None:
    # 200 W for 1 s then a ramp to 400 W over 1 s: 200 + 300 = 500 J for 1000 tokens
    samples = [(10.0, 200.0), (11.0, 200.0), (12.0, 400.0)]
    cost = energy_cost(samples, 10.0, 12.0, 1000, price_per_kwh=0.36)
    assert cost is not None
    assert cost.joules == pytest.approx(500.0) and cost.mean_power_w == pytest.approx(250.0)
    # 500 J per 1000 tokens = 500,000 J per 1M = 0.13889 kWh -> 0.05 at 0.36 per kWh
    assert cost.cost_per_million_output_tokens == pytest.approx(500_000 / 3.6e6 * 0.36)
    assert cost.wh_per_million_tokens == pytest.approx(500_000 / 3600.0, rel=1e-3)
    # edges held at the nearest sample: a window inside one gap still integrates
    inner = energy_cost(samples, 11.25, 11.75, 10, None)
    assert inner is not None and inner.mean_power_w == pytest.approx(300.0) and inner.cost_per_million_output_tokens is None
    assert energy_cost([], 0.0, 1.0, 10, 0.3) is None and energy_cost(samples, 10.0, 12.0, 0, 0.3) is None


def test_ab_costs_and_report_show_energy_beside_the_hourly_price(tmp_path: Path) -> None:
    a, b = engine("llama.cpp", 10.0, 0.05, 2.0), engine("vllm", 20.0, 0.05, 60.0)
    # recorded power samples (what PowerSampler stores) over every level's window (levels start at t=0 here)
    a.repetitions[0].power = [(0.0, 100.0), (10.0, 100.0)]
    b.repetitions[0].power = [(0.0, 300.0), (10.0, 300.0)]
    config = ABConfig(price_per_hour=2.0, price_per_kwh=0.5, concurrency=(1, 8, 32))
    result = analyse(config, [a, b], 0.0, 1.0)
    row = next(c for c in result.costs if c["engine"] == "vllm" and c["concurrency"] == 8)
    level = b.repetitions[0].sweep.levels[1]  # type: ignore[union-attr]
    seconds, tokens = level.summary.duration, level.summary.total_output_tokens
    expected = 300.0 * seconds / tokens * 1e6 / 3.6e6 * 0.5
    assert row["energy"]["mean_power_w"] == pytest.approx(300.0)
    assert row["energy"]["energy_cost_per_million"] == pytest.approx(expected)
    assert row["steady_state_cost_per_million"] is not None  # the hourly price is still there
    html = write_ab_report(result, tmp_path / "r").html.read_text()
    assert "Cost from power" in html and "energy cost per 1M" in html and "hourly-price cost per 1M" in html
    without = analyse(ABConfig(concurrency=(1, 8, 32)), [engine("llama.cpp", 10.0, 0.05, 2.0),
                                                          engine("vllm", 20.0, 0.05, 60.0)], 0.0, 1.0)
    assert all(c["energy"] is None for c in without.costs)
    assert "no GPU power readings" in write_ab_report(without, tmp_path / "s").html.read_text()


class _FakeNvml:
    unavailable = None

    def __init__(self) -> None:
        self.calls = 0

    def sample_once(self, t: float) -> list[Sample]:
        self.calls += 1
        return [Sample(t, "gpu0", "gpu_power_w", 150.0), Sample(t, "gpu1", "gpu_power_w", 50.0),
                Sample(t, "gpu0", "gpu_util", 90.0)]


def test_power_sampler_sums_the_gpus_power_only() -> None:
    sampler = PowerSampler(gpu=_FakeNvml())
    sampler.sample_once()
    assert [w for _, w in sampler.samples] == [200.0]


def test_price_per_kwh_setting_migrates_from_v3_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"version": 3, "endpoint_port": 9100}))
    loaded = core_settings.load(path)
    assert loaded.price_per_kwh == 0.0 and loaded.endpoint_port == 9100
    assert json.loads(path.read_text())["version"] == core_settings.SCHEMA_VERSION >= 4
    core_settings.save(core_settings.Settings(price_per_kwh=0.31), path)
    assert core_settings.load(path).price_per_kwh == pytest.approx(0.31)
    path.write_text(json.dumps({"version": 4, "price_per_kwh": 1}))  # an int typed by hand is a price too
    assert core_settings.load(path).price_per_kwh == 1.0
    with pytest.raises(Exception, match="price per kWh"):
        core_settings.Settings(price_per_kwh=-1.0).validated()
