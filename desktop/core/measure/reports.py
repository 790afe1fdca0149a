"""Reports a person can open and share: JSON (vllm bench serve's field names), CSV, and one self-contained HTML
file whose plots are inline SVG generated here (no scripts, no CDN, no network). Also records runs in history."""

from __future__ import annotations

import csv
import html
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.measure.ab import REASONING, ABResult
from desktop.core.measure.loadgen import SweepResult
from desktop.core.storage.history import RunRecord, Store

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
CSV_KEYS = ("label", "completed", "failed", "duration", "request_throughput", "output_throughput",
            "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p95_tpot_ms", "median_itl_ms", "median_e2el_ms", "p95_e2el_ms", "error_rate",
            "tokens_estimated", "client_cpu")


@dataclass(frozen=True)
class ReportPaths:
    json: Path
    csv: Path
    html: Path

    def to_json(self) -> dict[str, str]:
        return {"json": str(self.json), "csv": str(self.csv), "html": str(self.html)}


# --- JSON and CSV ---------------------------------------------------------------------------------------
def bench_json(sweep: SweepResult, meta: dict[str, Any], include_requests: bool = False) -> dict[str, Any]:
    return {"kind": "bench", **meta, "created_at": time.time(), "aborted": sweep.aborted,
            **sweep.to_json(include_requests)}


def write_json(data: dict[str, Any], path: Path) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    except OSError as exc:
        raise SwitchyardError(f"cannot write {path}: {exc.strerror or exc}", "pick a writable path") from exc
    return path


def sweep_rows(sweep: SweepResult, engine: str = "") -> list[dict[str, Any]]:
    rows = []
    for level in sweep.levels:
        data = level.to_json()
        rows.append({"engine": engine, "concurrency": level.config.concurrency, "rate": level.config.rate,
                     **{key: data.get(key) for key in CSV_KEYS}})
    return rows


def ab_rows(result: ABResult) -> list[dict[str, Any]]:
    rows = []
    for engine in result.engines:
        for number, rep in enumerate(engine.repetitions, start=1):
            cold = rep.cold_start
            base = {"repetition": number, "t1_health_s": cold.get("t1_health_s"),
                    "t2_first_token_s": cold.get("t2_first_token_s"),
                    "t3_first_request_s": cold.get("t3_first_request_s"),
                    "peak_rss_mib": max(rep.peak_rss_mib.values()) if rep.peak_rss_mib else None}
            for row in sweep_rows(rep.sweep, engine.engine) if rep.sweep else [{"engine": engine.engine}]:
                rows.append({**row, **base})
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return Path(path)


# --- SVG charts -----------------------------------------------------------------------------------------
def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        high = low + 1.0
    step = 10 ** math.floor(math.log10((high - low) / count))
    for factor in (1, 2, 5, 10):
        if (high - low) / (step * factor) <= count:
            step *= factor
            break
    start = math.floor(low / step) * step
    return [start + i * step for i in range(int((high - start) / step) + 2) if start + i * step <= high + 1e-9]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
               *, log_x: bool = False, width: int = 560, height: int = 300,
               dashed: Sequence[str] = ()) -> str:
    """An inline SVG line chart with markers, axes, ticks and a legend."""
    left, right, top, bottom = 64, 16, 34, 46
    points = [p for values in series.values() for p in values if p[1] is not None and math.isfinite(p[1])]
    esc = html.escape
    if not points:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="60" role="img">'
                f'<text x="8" y="30">{esc(title)}: no data</text></svg>')
    xs = [p[0] for p in points]
    fx = (lambda v: math.log2(max(v, 1e-9))) if log_x else (lambda v: v)
    x_low, x_high = fx(min(xs)), fx(max(xs))
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    y_high = max(p[1] for p in points) * 1.1 or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(v: float) -> float:
        return left + (fx(v) - x_low) / (x_high - x_low) * plot_w

    def py(v: float) -> float:
        return top + plot_h - v / y_high * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'font-family="sans-serif" font-size="11"><title>{esc(title)}</title>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{esc(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>']
    for tick in _ticks(0.0, y_high):
        y = py(tick)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(tick)}</text>')
    x_values = sorted(set(xs)) if log_x or len(set(xs)) <= 8 else _ticks(min(xs), max(xs))
    for tick in x_values:
        x = px(tick)
        parts.append(f'<text x="{x:.1f}" y="{top + plot_h + 14}" text-anchor="middle">{_fmt(tick)}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">{esc(xlabel)}</text>')
    parts.append(f'<text x="14" y="{top + plot_h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {top + plot_h / 2})">{esc(ylabel)}</text>')
    for index, (name, values) in enumerate(series.items()):
        color = PALETTE[index % len(PALETTE)]
        clean = sorted((x, y) for x, y in values if y is not None and math.isfinite(y))
        if not clean:
            continue
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in clean)
        dash = ' stroke-dasharray="5,3"' if name in dashed else ""
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        if len(clean) <= 40:
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in clean]
        ly = top + 12 + index * 14
        parts.append(f'<rect x="{left + 8}" y="{ly - 8}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{left + 22}" y="{ly + 1}">{esc(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def phase_chart(title: str, engines: dict[str, dict[str, Any]], width: int = 560) -> str:
    """One stacked bar per engine of its cold-start phases (supervisor.COLD_START_PHASES: process, weights,
    compile, KV cache, warm-up, T1, T2, T3), each segment titled with its duration."""
    from desktop.core.runtime.supervisor import COLD_START_PHASES, phases_of

    colors = {phase.key: phase.color for phase in COLD_START_PHASES}
    esc = html.escape
    left, top, bar, gap = 110, 40 + 16 * ((len(COLD_START_PHASES) + 3) // 4), 18, 30
    height = top + len(engines) * (bar + gap) + 30
    stacked = {name: ([] if values.get("attached") else phases_of(values)) for name, values in engines.items()}
    longest = max([float(p["end_s"]) for phases in stacked.values() for p in phases] + [1e-9])
    scale = (width - left - 70) / longest
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'font-family="sans-serif" font-size="11"><title>{esc(title)}</title>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{esc(title)}</text>']
    for index, known in enumerate(COLD_START_PHASES):
        x, y = 10 + (index % 4) * 135, 26 + 16 * (index // 4)
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{colors[known.key]}"/>'
                     f'<text x="{x + 14}" y="{y + 9}">{esc(known.label)}</text>')
    for row, (name, values) in enumerate(engines.items()):
        y = top + row * (bar + gap) + 8
        parts.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{esc(name)}</text>')
        if values.get("attached"):
            parts.append(f'<text x="{left + 4}" y="{y + 13}" fill="#666">{esc(str(values.get("note") or ""))}</text>')
            continue
        end = 0.0
        for seg in stacked[name]:
            parts.append(f'<rect x="{left + float(seg["start_s"]) * scale:.1f}" y="{y}" '
                         f'width="{max(1.0, float(seg["seconds"]) * scale):.1f}" height="{bar}" '
                         f'fill="{colors.get(seg["phase"], "#999")}"><title>{esc(seg["label"])}: '
                         f'{float(seg["seconds"]):.2f} s</title></rect>')
            end = max(end, float(seg["end_s"]))
        parts.append(f'<text x="{left + end * scale + 4:.1f}" y="{y + 13}">{end:.2f} s</text>')
    parts.append("</svg>")
    return "".join(parts)


def phase_rows(engines: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Table rows: each cold-start phase's duration per engine (first repetition), then the compile cache."""
    from desktop.core.runtime.supervisor import COLD_START_PHASES, phases_of

    seconds = {name: {p["phase"]: float(p["seconds"]) for p in phases_of(values)}
               for name, values in engines.items() if not values.get("attached")}
    rows = [[phase.label, *(_num(seconds.get(name, {}).get(phase.key)) for name in engines)]
            for phase in COLD_START_PHASES if any(phase.key in found for found in seconds.values())]
    if any(values.get("compile_cache") for values in engines.values()):
        rows.append(["compile cache", *(html.escape(str(values.get("compile_cache") or "–"))
                                        for values in engines.values())])
    return rows


# --- HTML -----------------------------------------------------------------------------------------------
STYLE = """body{font-family:sans-serif;max-width:1180px;margin:24px auto;padding:0 16px;color:#222}
table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}.charts{display:flex;flex-wrap:wrap;gap:16px}
.warn{background:#fff4e5;border-left:4px solid #ff9800;padding:6px 10px}.verdict{background:#eef6ff;
border-left:4px solid #1f77b4;padding:6px 10px}small{color:#666}"""


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return html.escape(str(value))


def _spread(cell: dict[str, Any], digits: int = 2) -> str:
    if not cell or cell.get("mean") is None:
        return "–"
    text = _num(cell["mean"], digits)
    if cell.get("n", 0) > 1:
        text += f" <small>({_num(cell['low'], digits)}–{_num(cell['high'], digits)})</small>"
    return text


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}"
            f"<p><small>Generated by Switchyard on {time.strftime('%Y-%m-%d %H:%M:%S')}. Metrics follow "
            "vllm bench serve's definitions (TTFT to the first token-bearing chunk, TPOT = (E2E − TTFT)/(tokens − 1), "
            "ITL per chunk).</small></p></body></html>")


def _sweep_series(sweep: SweepResult, key: str) -> list[tuple[float, float]]:
    return [(float(level.config.concurrency or level.config.rate or 0), float(level.to_json()[key]))
            for level in sweep.levels if level.summary.completed]


def render_bench_html(sweep: SweepResult, meta: dict[str, Any]) -> str:
    name = str(meta.get("engine") or meta.get("endpoint") or "endpoint")
    x_label = "request rate (req/s)" if any(level.config.rate for level in sweep.levels) else "concurrency"
    charts = [
        line_chart("Output throughput", {name: _sweep_series(sweep, "output_throughput")}, x_label, "tokens/s",
                   log_x=True),
        line_chart("TTFT", {f"{name} p50": _sweep_series(sweep, "median_ttft_ms"),
                            f"{name} p95": _sweep_series(sweep, "p95_ttft_ms")}, x_label, "ms", log_x=True,
                   dashed=(f"{name} p95",)),
    ]
    rows = [[html.escape(level.label), _num(level.summary.completed, 0), _num(level.summary.failed, 0),
             _num(level.summary.output_throughput), _num(level.summary.ttft.median), _num(level.summary.ttft.p95),
             _num(level.summary.tpot.median), _num(level.summary.e2el.median), _num(level.client_cpu)]
            for level in sweep.levels]
    warnings = [w for level in sweep.levels for w in level.warnings]
    if sweep.aborted:
        warnings.insert(0, f"aborted: {sweep.aborted}")
    body = (f"<p>{html.escape(json.dumps({k: v for k, v in meta.items() if k != 'settings'}, default=str))}</p>"
            + "".join(f'<p class="warn">{html.escape(w)}</p>' for w in warnings)
            + _table(["load", "completed", "failed", "output tok/s", "TTFT p50 ms", "TTFT p95 ms", "TPOT p50 ms",
                      "E2E p50 ms", "client CPU"], rows)
            + f'<div class="charts">{"".join(charts)}</div>')
    return _page(f"Switchyard benchmark: {name}", body)


def render_ab_html(result: ABResult) -> str:
    a, b = result.engines
    cfg = result.config
    charts = []
    for key, title, unit in (("output_throughput", "Output throughput vs concurrency", "tokens/s"),):
        series = {}
        for engine in result.engines:
            series[engine.engine] = [(float(c), v) for c in cfg.concurrency
                                     if (v := _avg(engine.level_values(c, key))) is not None]
        charts.append(line_chart(title, series, "concurrency", unit, log_x=True))
    ttft: dict[str, list[tuple[float, float]]] = {}
    for engine in result.engines:
        for key, tag in (("median_ttft_ms", "p50"), ("p95_ttft_ms", "p95")):
            ttft[f"{engine.engine} {tag}"] = [(float(c), v) for c in cfg.concurrency
                                              if (v := _avg(engine.level_values(c, key))) is not None]
    charts.append(line_chart("TTFT p50 / p95 vs concurrency", ttft, "concurrency", "ms", log_x=True,
                             dashed=[name for name in ttft if name.endswith("p95")]))
    first_starts = {e.engine: (e.repetitions[0].cold_start if e.repetitions else {}) for e in result.engines}
    charts.append(phase_chart("Cold start (first repetition)", first_starts))
    memory = {e.engine: [(t, mib) for t, mib, _phase in e.repetitions[0].memory] if e.repetitions else []
              for e in result.engines}
    charts.append(line_chart("Engine memory (RSS of the process tree, first repetition)", memory,
                             "seconds since spawn", "MiB"))
    comparison_rows = []
    for row in result.comparison:
        comparison_rows.append([
            str(row["concurrency"]),
            _spread(row["output_throughput"][a.engine]), _spread(row["output_throughput"][b.engine]),
            _spread(row["output_throughput"]["ratio"], 3),
            _spread(row["median_ttft_ms"][a.engine], 1), _spread(row["median_ttft_ms"][b.engine], 1),
            _spread(row["median_ttft_ms"]["ratio"], 3),
            _spread(row["p95_ttft_ms"][a.engine], 1), _spread(row["p95_ttft_ms"][b.engine], 1),
        ])
    cold_rows = [[phase.replace("_s", "").replace("_", " "), _spread(result.cold_start[phase][a.engine]),
                  _spread(result.cold_start[phase][b.engine]), _spread(result.cold_start[phase]["ratio"], 3)]
                 for phase in ("t1_health_s", "t2_first_token_s", "t3_first_request_s")]
    cold_rows.append(["peak RSS (MiB)", _num(result.cold_start["peak_rss_mib"][a.engine], 0),
                      _num(result.cold_start["peak_rss_mib"][b.engine], 0), "–"])
    cost_rows = [[c["engine"], str(c["concurrency"]), _num(c["output_throughput"]),
                  _num(c["steady_state_cost_per_million"], 3), _num(c["cost_per_million_output_tokens"], 3)]
                 for c in result.costs]
    scenario_rows = []
    for s in result.scenarios:
        cells = [s["scenario"] + f"<br><small>{html.escape(s['concern'])}</small>", str(s["concurrency"]),
                 _life(s["lifetime_s"])]
        for engine in (a, b):
            e = s["engines"].get(engine.engine, {})
            cells.append(f"{_num(e.get('cold_start_s'))} s / {_num(e.get('output_throughput'))} tok/s / "
                         f"{_num(e.get('cost_per_million_output_tokens'), 3)}")
        cells.append(html.escape(str(s["winner"] or "–")) + (f"<br><small>leaner: {html.escape(str(s['engines'].get('leaner')))}</small>"
                                                              if s["engines"].get("leaner") else ""))
        scenario_rows.append(cells)
    unit = result.costs[0]["unit"] if result.costs else ""
    settings = (f"model <b>{html.escape(cfg.model)}</b>, {cfg.dtype}, context {cfg.ctx} per request, "
                f"{cfg.slots} slots / max_num_seqs, prefix cache {'on' if cfg.prefix_cache else 'off'} on both, "
                f"{cfg.requests_per_level} requests per level, input {cfg.input_len} / output {cfg.output_len} "
                f"tokens (ignore_eos), {cfg.repetitions} repetition(s); reasoning {REASONING}. "
                f"Machine: {html.escape(result.machine)}.")
    versions = ", ".join(f"{html.escape(e.display_name)} {html.escape(e.version)}" for e in result.engines)
    notes = "".join(f'<p class="warn">{html.escape(e.engine)}: {html.escape(e.note)}. Its memory is not sampled, '
                    "its settings are not matched by Switchyard, and its costs count no cold start.</p>"
                    for e in result.engines if e.note)
    body = (f"<p>{settings}<br>Engines: {versions}</p>" + notes
            + "".join(f'<p class="warn">{html.escape(err)}</p>' for err in result.errors)
            + f'<p class="verdict">{html.escape(result.amortization.get("verdict", ""))}</p>'
            + (f'<p class="warn">Weights: {html.escape(result.quality["line"])}</p>'
               if result.quality and result.quality.get("line") else "")
            + '<div class="charts">' + "".join(charts) + "</div>"
            + "<h2>Throughput and TTFT (ratio = " + html.escape(f"{b.engine} / {a.engine}") + ")</h2>"
            + _table(["concurrency", f"{a.engine} tok/s", f"{b.engine} tok/s", "ratio",
                      f"{a.engine} TTFT p50", f"{b.engine} TTFT p50", "ratio", f"{a.engine} TTFT p95",
                      f"{b.engine} TTFT p95"], comparison_rows)
            + "<h2>Cold start (seconds since spawn)</h2>"
            + _table(["phase", a.engine, b.engine, "ratio"], cold_rows)
            + "<h2>Cold-start phases (first repetition, seconds each)</h2>"
            + _table(["phase", a.engine, b.engine], phase_rows(first_starts))
            + f"<h2>Cost per million output tokens ({html.escape(unit)})</h2>"
            + _table(["engine", "concurrency", "tok/s", "steady state", f"with cold start over {cfg.service_lifetime_h:g} h"],
                     cost_rows)
            + _energy_section(result)
            + _crossover_section(result)
            + _replay_section(result)
            + "<h2>Scenarios on this machine</h2><p><small>cells: cold start / tok/s / cost per 1M tokens "
            "(cold start amortized over the lifetime)</small></p>"
            + _table(["scenario", "concurrency", "lifetime", a.engine, b.engine, "winner"], scenario_rows))
    return _page(f"Switchyard A/B: {a.engine} vs {b.engine}", body)


def _energy_section(result: ABResult) -> str:
    """Cost per 1M output tokens from measured GPU power (NVML) beside the hourly price, where power was read."""
    rows = [[c["engine"], str(c["concurrency"]), _num(c["energy"]["mean_power_w"], 1),
             _num(c["energy"]["wh_per_million_tokens"], 2), _num(c["energy"]["energy_cost_per_million"], 4),
             _num(c["steady_state_cost_per_million"], 3)]
            for c in result.costs if c.get("energy")]
    if not rows:
        return ("<h2>Cost from power</h2><p><small>no GPU power readings (NVML) on this machine: the cost above "
                "uses the hourly price alone</small></p>")
    price = result.config.price_per_kwh
    head = f"price {price:g} per kWh" if price is not None else "no price per kWh set (the energy is shown)"
    return (f"<h2>Cost from power (measured GPU energy, {html.escape(head)})</h2>"
            + _table(["engine", "concurrency", "mean W", "Wh per 1M tokens", "energy cost per 1M",
                      "hourly-price cost per 1M"], rows))


def _crossover_section(result: ABResult) -> str:
    x = result.crossover
    if not x:
        return ""
    tags = "".join(f"<li>{html.escape(c['engine'])}: {html.escape(c['tag'])}; cold start "
                   f"{_num(c['cold_start_s'])} s ({html.escape(c['cold_start_tag'])})</li>" for c in x["curves"])
    cells = [[_num(x.get("crossover_concurrency")), _num(x.get("operating_concurrency"), 0),
              html.escape(str(x.get("faster_at_operating") or "–")), _life_or_dash(x.get("break_even_s"))]]
    return ("<h2>Crossover</h2>" + f'<p class="verdict">{html.escape(x["verdict"])}</p><ul>{tags}</ul>'
            + _table(["crossover concurrency", "operating point", "faster there", "break-even service time"], cells))


def _replay_section(result: ABResult) -> str:
    r = result.replay
    if not r:
        return ""
    sched = r["schedule"]
    rows = []
    for engine, cell in r["engines"].items():
        if not cell:
            rows.append([html.escape(engine), "–", "–", "–", "–", "–", "–"])
            continue
        rows.append([html.escape(engine), _num(cell["completed"], 0), _num(cell["failed"], 0),
                     _num(cell["output_throughput"]), _num(cell["median_ttft_ms"], 1), _num(cell["p95_ttft_ms"], 1),
                     _num(cell["send_lag_p95_ms"], 1)])
    return (f"<h2>Replay of the recorded traffic (open loop, {r['speed']:g}x)</h2><p><small>"
            f"{sched['requests']} requests over {sched['span_s']:g} s from the {html.escape(str(sched['source']))}; "
            f"{sched['captured_bodies']} with captured bodies, the rest random prompts of the recorded lengths; "
            "the closed-loop sweep above is the other half of the picture</small></p>"
            + _table(["engine", "completed", "failed", "output tok/s", "TTFT p50 ms", "TTFT p95 ms",
                      "send lag p95 ms"], rows))


def _life_or_dash(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "–"
    return f"{seconds:.0f} s" if seconds < 120 else _life(float(seconds))


def _avg(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _life(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds / 60:g} min"


# --- writing whole reports ------------------------------------------------------------------------------
def _prepare(directory: Path) -> Path:
    directory = Path(directory).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SwitchyardError(f"cannot create report folder {directory}: {exc.strerror or exc}",
                              "pick a writable folder with --report") from exc
    return directory


def write_bench_report(sweep: SweepResult, meta: dict[str, Any], directory: Path, stem: str = "bench") -> ReportPaths:
    directory = _prepare(directory)
    paths = ReportPaths(directory / f"{stem}.json", directory / f"{stem}.csv", directory / f"{stem}.html")
    write_json(bench_json(sweep, meta), paths.json)
    write_csv(sweep_rows(sweep, str(meta.get("engine") or "")), paths.csv)
    paths.html.write_text(render_bench_html(sweep, meta), encoding="utf-8")
    return paths


def write_ab_report(result: ABResult, directory: Path, stem: str = "ab") -> ReportPaths:
    directory = _prepare(directory)
    paths = ReportPaths(directory / f"{stem}.json", directory / f"{stem}.csv", directory / f"{stem}.html")
    write_json(result.to_json(), paths.json)
    write_csv(ab_rows(result), paths.csv)
    paths.html.write_text(render_ab_html(result), encoding="utf-8")
    return paths


def record_bench(store: Store, sweep: SweepResult, meta: dict[str, Any], report: str | None = None) -> int:
    return store.add_run(RunRecord(kind="bench", engine=meta.get("engine"), engine_version=meta.get("engine_version"),
                                   model=meta.get("model"), settings=dict(meta.get("settings") or {}),
                                   summary=bench_json(sweep, meta), report_path=report,
                                   label=meta.get("endpoint")))


def record_ab(store: Store, result: ABResult, report: str | None = None) -> int:
    a, b = result.engines
    summary = {k: v for k, v in result.to_json().items() if k != "engines"}
    summary["engines"] = [{"engine": e.engine, "version": e.version, "peak_rss_mib": e.peak_rss(), "error": e.error}
                          for e in result.engines]
    return store.add_run(RunRecord(kind="ab", engine=f"{a.engine},{b.engine}",
                                   engine_version=f"{a.version},{b.version}", model=result.config.model,
                                   settings=result.config.to_json(), summary=summary, report_path=report,
                                   label=f"A/B {a.engine} vs {b.engine}", machine=result.machine))
