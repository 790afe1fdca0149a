"""Where a verdict's figures come from, in words, from one place: the crossover picture, the Recommend page and the
hybrid endpoint's decisions (`serve --engine auto`, `status`) all word it here, so that a sentence says "measures"
only over curves measured on this machine, and a verdict that rests on the recommender's default figures says so
and ends with the action that would measure it.

A curve's tag is DEFAULT_TAG, `measured_tag(when)` (an A/B or bench run in this machine's history), or a tag of
its own (a forced crossover). The workload's operating point comes from the user's traffic or from the numbers
they typed (`workload_basis`). The recommender's single figures (a cold start, a throughput, vLLM's gain) are
worded by `figure_basis`, and what a partial history measured and what it did not by `history_basis`; the hybrid
endpoint's crossover and cold start by `crossover_at` and `named_basis`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_TAG = "default"
MEASURED_PREFIX = "as measured on this machine on "
NOT_MEASURED = "by default figures, not measured here"
FIGURE_DEFAULT = "default figure, not measured here"
MEASURE_IT = "run a short A/B on the Compare page (or `switchyard ab`) to measure it here"
WORKLOAD_SOURCES = {"traffic": "from your traffic", "typed": "from the numbers you typed"}


def measured_tag(created_at: float) -> str:
    """The tag of a curve measured on this machine by a run at `created_at`."""
    return f"{MEASURED_PREFIX}{time.strftime('%Y-%m-%d', time.localtime(created_at))}"


def is_measured(tag: str) -> bool:
    return tag.startswith(MEASURED_PREFIX)


def curve_basis(tag: str) -> str:
    """One curve's figures in words: "measured here on DATE", "by default figures, not measured here", or the
    curve's own tag (a forced crossover)."""
    if tag == DEFAULT_TAG:
        return NOT_MEASURED
    if is_measured(tag):
        return "measured here on " + tag[len(MEASURED_PREFIX):]
    return tag


def curves_basis(tags: Sequence[tuple[str, str]]) -> str:
    """(engine, tag) pairs in words: one phrase when every curve has the same basis, else one per engine."""
    bases = [curve_basis(tag) for _, tag in tags]
    if len(set(bases)) <= 1:
        return bases[0] if bases else NOT_MEASURED
    return ", ".join(f"{engine} {basis}" for (engine, _), basis in zip(tags, bases, strict=True))


def workload_basis(source: str | None) -> str:
    """Where the operating point came from: "from your traffic", "from the numbers you typed", or nothing."""
    return WORKLOAD_SOURCES.get(source or "", "")


def qualified(sentence: str, tags: Sequence[tuple[str, str]]) -> str:
    """`sentence` with where its figures come from; when any of them is a default, ending with how to measure it."""
    return ends_with_action(f"{sentence} ({curves_basis(tags)})", tags)


def faster_everywhere(winner: str, loser: str, levels: Iterable[int], tags: Sequence[tuple[str, str]],
                      consequence: str) -> str:
    """The one wording of "`winner` is faster at every concurrency": "measures faster" only when every curve was
    measured here; otherwise the figures' basis, and the action that measures them."""
    shown = "; ".join(part for part in (", ".join(str(level) for level in levels), curves_basis(tags)) if part)
    if tags and all(is_measured(tag) for _, tag in tags):
        return f"{winner} measures faster at every concurrency ({shown}): {consequence}"
    return ends_with_action(f"{winner} is faster at every concurrency ({shown}): {consequence}", tags)


def ends_with_action(text: str, tags: Sequence[tuple[str, str]]) -> str:
    """`text`, ending with how to measure its figures when any of them is a default."""
    return f"{text}; {MEASURE_IT}" if any(tag == DEFAULT_TAG for _, tag in tags) else text


def named_basis(name: str, tag: str) -> str:
    """One named figure and where it comes from: "its cold start measured here on DATE", "vLLM's cold start by
    default figures, not measured here"."""
    return f"{name} {curve_basis(tag)}"


def crossover_at(concurrency: float, tags: Sequence[tuple[str, str]]) -> str:
    """The crossover concurrency with its curves' basis: "crossover 4 (measured here on DATE)"."""
    return f"crossover {concurrency:g} ({curves_basis(tags)})"


# --- the recommender's figures (planning.evidence.Figure, or its JSON on the page) -------------------------------
def figure_basis(measured: bool, run_date: str | None = None, run_id: int | None = None,
                 note: str | None = None) -> str:
    """One figure's source: "measured here on DATE, run #N", "measured" (a caller's own figure, said in its note),
    or "default figure, not measured here"; its note (interpolated, nearest model, typical on a CPU) after it."""
    if measured and run_date:
        text = f"measured here on {run_date}" + (f", run #{run_id}" if run_id is not None else "")
    else:
        text = "measured" if measured else FIGURE_DEFAULT
    return f"{text}; {note}" if note else text


def memory_check(check: Mapping[str, Any]) -> str:
    """The fit's prediction beside what the newest launch here measured (`evidence.MemoryCheck.to_json()`):
    "memory, KV cache: predicted 1.00 GiB, measured 1.10 GiB here on DATE (launch #N)"."""
    return (f"memory, {check['what']}: predicted {check['predicted_gib']:.2f} GiB, measured "
            f"{check['measured_gib']:.2f} GiB here on {check['run_date']} (launch #{check['run_id']})")


def history_basis(figures: Sequence[tuple[str, bool, str | None]]) -> str:
    """What this machine's history measured of the figures a verdict used and what it did not, from (name,
    measured, run date) triples: "llama.cpp's cold start was measured here on DATE; vLLM's cold start and ... are
    default figures, not measured here; run a short A/B ..."."""
    measured = [(name, date) for name, is_it, date in figures if is_it and date]
    given = [name for name, is_it, date in figures if is_it and not date]  # a caller's own measurements
    defaults = [name for name, is_it, _ in figures if not is_it]
    parts = []
    if given:
        parts.append(f"{_and(given)} {'was' if len(given) == 1 else 'were'} given as measured by the caller")
    if measured:
        dates = {date for _, date in measured}
        if len(dates) == 1:
            date = next(iter(dates))
            when = f" on {date}"
            names = _and([name for name, _ in measured])
        else:
            when = ""
            names = _and([f"{name} (on {date})" for name, date in measured])
        parts.append(f"{names} {'was' if len(measured) == 1 else 'were'} measured here{when}")
    if defaults:
        what = "is a default figure" if len(defaults) == 1 else "are default figures"
        lead = "nothing was measured here for this model: " if not (measured or given) else ""
        parts.append(f"{lead}{_and(defaults)} {what}, not measured here")
        parts.append(MEASURE_IT)
    return "; ".join(parts)


def _and(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def quality_lines(quality: Mapping[str, Any] | None) -> list[str]:
    """Each measured quantization against its reference (`switchyard quality`), with where it was measured, and
    its figures deep in a long context where those were scored."""
    if not quality:
        return []
    reference = Path(str(quality.get("reference", ""))).name
    long = quality.get("long_context") or {}
    lines = []
    for v in quality.get("variants") or []:
        line = (f"quality {v['variant']} against {reference}: mean KLD {v['mean_kld']:.4f}, p99 {v['kld_p99']:.4f}, "
                f"same top token {v['same_top']:.1%}, perplexity x{v['ppl_ratio']:.3f} (measured here on "
                f"{quality.get('run_date')}, run #{quality.get('run_id')}, {v['tokens']} tokens)")
        deep = (long.get("variants") or {}).get(v["variant"])
        if deep:
            line += (f"; at positions {long.get('positions')} of {long.get('ctx')}-token chunks: mean KLD "
                     f"{deep['mean_kld']:.4f}, same top token {deep['same_top']:.1%} ({deep['tokens']} tokens)")
        lines.append(line)
    notes = [quality.get("reference_note"), long.get("note")]
    return lines + [str(note) for note in notes if note]


__all__ = ["DEFAULT_TAG", "FIGURE_DEFAULT", "MEASURED_PREFIX", "MEASURE_IT", "NOT_MEASURED", "crossover_at",
           "curve_basis", "curves_basis", "ends_with_action", "faster_everywhere", "figure_basis", "history_basis",
           "is_measured", "measured_tag", "memory_check", "named_basis", "qualified", "quality_lines",
           "workload_basis"]
