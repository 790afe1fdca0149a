"""The Compare page's results in words: an A/B or sweep result (the JSON desktop.core.measure.ab and the sweep
job write) as the rows of its side-by-side tables and its verdict lines. Plain functions of plain data, so the
page and its form share them and tests read them without a window.
"""

from __future__ import annotations

from typing import Any

from desktop.ui.engine_session import engine_choices


def engine_label(name: str) -> str:
    """An engine's display name, from the adapter registry."""
    return dict(engine_choices()).get(name, name)


COLD_PHASES = (("t1_health_s", "Cold start T1: health OK (s)"),
               ("t2_first_token_s", "Cold start T2: first token (s)"),
               ("t3_first_request_s", "Cold start T3: first request done (s)"))
LEVEL_METRICS = (("output_throughput", "output tok/s", 1), ("median_ttft_ms", "TTFT p50 (ms)", 0),
                 ("p95_ttft_ms", "TTFT p95 (ms)", 0), ("request_throughput", "requests/s", 2))
REPLAY_METRICS = (("completed", "completed", 0), ("failed", "failed", 0), ("output_throughput", "output tok/s", 1),
                  ("request_throughput", "requests/s", 2), ("median_ttft_ms", "TTFT p50 (ms)", 0),
                  ("p95_ttft_ms", "TTFT p95 (ms)", 0), ("p95_e2el_ms", "E2E p95 (ms)", 0),
                  ("send_lag_p95_ms", "send lag p95 (ms, late vs the schedule)", 1))


HIGHER_IS_BETTER = {"output_throughput", "request_throughput", "completed"}  # everything else: lower is better


def better(va: Any, vb: Any, a: str, b: str, higher: bool) -> str:
    """Which engine did better on a metric, by its direction (throughput: higher; times, memory: lower)."""
    if va is None or vb is None:
        return "–"
    va, vb = float(va), float(vb)
    if va == vb:
        return "same"
    wins_a = va > vb if higher else va < vb
    arrow = "higher" if higher else "lower"
    return f"{engine_label(a if wins_a else b)} ({arrow} is better)"


def winner_column(headers: list[str], row: list[str]) -> int | None:
    """The column (1: A, 2: B) of the engine a row's Better cell names (as `better` writes it), None on a tie, a
    missing figure or a table without that column: the page marks that engine's figure."""
    if len(headers) < 5 or len(row) < 5:
        return None
    for column in (1, 2):
        if row[4] in (f"{headers[column]} (higher is better)", f"{headers[column]} (lower is better)"):
            return column
    return None


def _mean(cell: dict[str, Any] | None) -> Any:
    return cell.get("mean") if cell else None


def _number(value: Any, digits: int) -> str:
    return "–" if value is None else f"{float(value):.{digits}f}"


def _spread(cell: dict[str, Any] | None, digits: int) -> str:
    """mean, with the range over repetitions when there were several."""
    if not cell or cell.get("mean") is None:
        return "–"
    text = _number(cell["mean"], digits)
    if cell.get("n", 0) > 1:
        text += f" ({_number(cell['low'], digits)}–{_number(cell['high'], digits)})"
    return text


def phase_table_rows(result: dict[str, Any], a: str, b: str) -> list[list[str]]:
    """Each cold-start phase's seconds (first repetition) per engine, named as on the Serve page's bar."""
    from desktop.core.runtime.supervisor import COLD_START_PHASES, phases_of

    seconds: dict[str, dict[str, float]] = {}
    for engine in result.get("engines", []):
        reps = engine.get("repetitions") or []
        cold = reps[0].get("cold_start") if reps else None
        if isinstance(cold, dict) and not cold.get("attached"):
            seconds[engine["engine"]] = {p["phase"]: float(p["seconds"]) for p in phases_of(cold)}
    rows = []
    for phase in COLD_START_PHASES:
        va, vb = seconds.get(a, {}).get(phase.key), seconds.get(b, {}).get(phase.key)
        if va is None and vb is None:
            continue
        rows.append([f"Cold-start phase: {phase.label} (s)", _number(va, 2), _number(vb, 2),
                     _number(vb / va if va and vb else None, 2), better(va, vb, a, b, higher=False)])
    return rows


def ab_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The side-by-side table of an A/B result (its JSON): the engines as columns, B/A as the last one."""
    a, b = (engine["engine"] for engine in result["engines"])
    headers = ["Metric", engine_label(a), engine_label(b), f"{engine_label(b)} / {engine_label(a)}", "Better"]
    rows: list[list[str]] = []
    cold = result.get("cold_start", {})
    for key, label in COLD_PHASES:
        cell = cold.get(key, {})
        rows.append([label, _spread(cell.get(a), 2), _spread(cell.get(b), 2), _spread(cell.get("ratio"), 2),
                     better(_mean(cell.get(a)), _mean(cell.get(b)), a, b, higher=False)])
    rows += phase_table_rows(result, a, b)
    rss = cold.get("peak_rss_mib", {})
    ratio = rss[b] / rss[a] if rss.get(a) and rss.get(b) else None
    rows.append(["Peak memory (MiB, process tree)", _number(rss.get(a), 0), _number(rss.get(b), 0),
                 _number(ratio, 2), better(rss.get(a), rss.get(b), a, b, higher=False)])
    for row in result.get("comparison", []):
        for key, label, digits in LEVEL_METRICS:
            cell = row.get(key, {})
            rows.append([f"concurrency {row['concurrency']}: {label}", _spread(cell.get(a), digits),
                         _spread(cell.get(b), digits), _spread(cell.get("ratio"), 2),
                         better(_mean(cell.get(a)), _mean(cell.get(b)), a, b, higher=key in HIGHER_IS_BETTER)])
    return headers, rows


def winners_by_level(result: dict[str, Any]) -> list[str]:
    """The answer per concurrency, first: the engine with the higher output throughput there, with its TTFT p95
    beside it ("c=8: vLLM, 160 vs 41 tok/s; TTFT p95 90 vs 300 ms")."""
    engines = [engine["engine"] for engine in result.get("engines", [])]
    if len(engines) != 2:
        return []
    a, b = engines
    lines = []
    for row in result.get("comparison", []):
        ta, tb = (_mean(row.get("output_throughput", {}).get(e)) for e in (a, b))
        if ta is None or tb is None:
            continue
        win, lose = (a, b) if float(ta) >= float(tb) else (b, a)
        tput = {a: float(ta), b: float(tb)}
        text = f"c={row['concurrency']}: {engine_label(win)}, {tput[win]:.1f} vs {tput[lose]:.1f} tok/s"
        pa, pb = (_mean(row.get("p95_ttft_ms", {}).get(e)) for e in (a, b))
        if pa is not None and pb is not None:
            p95 = {a: float(pa), b: float(pb)}
            text += f"; TTFT p95 {p95[win]:.0f} vs {p95[lose]:.0f} ms"
        lines.append(text)
    return lines


def sweep_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["Level", "Completed", "Failed", "Req/s", "Output tok/s", "TTFT p50 ms", "TTFT p95 ms",
               "TPOT p50 ms", "E2E p99 ms"]
    rows = [[str(level.get("label")), str(level.get("completed")), str(level.get("failed")),
             _number(level.get("request_throughput"), 2), _number(level.get("output_throughput"), 1),
             _number(level.get("median_ttft_ms"), 0), _number(level.get("p95_ttft_ms"), 0),
             _number(level.get("median_tpot_ms"), 1), _number(level.get("p99_e2el_ms"), 0)]
            for level in result.get("levels", [])]
    return headers, rows


def replay_summary(schedule: dict[str, Any], speed: float) -> str:
    """'12 recorded requests over 5.5 s (none with a captured body): 1.4 s per engine at 4x'."""
    bodies = schedule.get("captured_bodies") or 0
    span = float(schedule.get("span_s") or 0.0)
    return (f"{schedule['requests']} recorded requests over {span:.1f} s "
            f"({bodies if bodies else 'none'} with a captured body; prompts "
            f"{_number(schedule.get('prompt_tokens_mean'), 0)} / outputs {_number(schedule.get('output_tokens_mean'), 0)}"
            f" tokens on average): sent in {span / speed:.1f} s per engine at {speed:g}x")


def replay_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Both engines on the replayed traffic (the A/B result's `replay`), B/A as the last column."""
    replay = result.get("replay") or {}
    a, b = (engine["engine"] for engine in result["engines"])
    headers = ["Replayed traffic", engine_label(a), engine_label(b), f"{engine_label(b)} / {engine_label(a)}",
               "Better"]
    cells = replay.get("engines") or {}
    rows = []
    for key, label, digits in REPLAY_METRICS:
        va, vb = ((cells.get(e) or {}).get(key) for e in (a, b))
        ratio = vb / va if key not in ("completed", "failed") and va and vb is not None else None
        rows.append([label, _number(va, digits), _number(vb, digits), _number(ratio, 2),
                     better(va, vb, a, b, higher=key in HIGHER_IS_BETTER)])
    return headers, rows


def verdict_text(result: dict[str, Any]) -> str:
    lines = []
    verdict = result.get("amortization", {}).get("verdict")
    if verdict:
        lines.append(f"Verdict: {verdict}")
    winners = winners_by_level(result)
    if winners:
        lines.append("Winner per concurrency (the higher output throughput; TTFT p95 beside it):")
        lines += [f"• {line}" for line in winners]
    for scenario in result.get("scenarios", []):
        winner = scenario.get("winner")
        if winner:
            lines.append(f"• {scenario['scenario']} (concurrency {scenario['concurrency']}): "
                         f"{engine_label(winner)}")
    lines += replay_verdict(result)
    return "\n".join(lines)


def replay_verdict(result: dict[str, Any]) -> list[str]:
    """Open loop, both engines get the same arrivals: the one that keeps TTFT p95 lower serves the traffic better."""
    replay = result.get("replay") or {}
    cells = {e: c for e, c in (replay.get("engines") or {}).items() if c and c.get("p95_ttft_ms") is not None}
    if len(cells) != 2:
        return []
    (a, ca), (b, cb) = cells.items()
    best, other = (a, b) if ca["p95_ttft_ms"] <= cb["p95_ttft_ms"] else (b, a)
    lines = [f"• your replayed traffic ({replay['schedule']['requests']} requests at {float(replay['speed']):g}x): "
             f"{engine_label(best)}, TTFT p95 {cells[best]['p95_ttft_ms']:.0f} ms vs "
             f"{cells[other]['p95_ttft_ms']:.0f} ms"]
    lines += [f"  {engine_label(e)}: {w}" for e, c in cells.items() for w in c.get("warnings") or []]
    return lines
