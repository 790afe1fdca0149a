"""Where a verdict's figures come from, in words, from one place: the crossover picture, the Recommend page and the
hybrid endpoint's decisions (`serve --engine auto`, `status`) all word it here, so that a sentence says "measures"
only over curves measured on this machine, and a verdict that rests on the recommender's default figures says so
and ends with the action that would measure it.

A curve's tag is DEFAULT_TAG, `measured_tag(when)` (an A/B or bench run in this machine's history), or a tag of
its own (a forced crossover). The workload's operating point comes from the user's traffic or from the numbers
they typed (`workload_basis`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

DEFAULT_TAG = "default"
MEASURED_PREFIX = "as measured on this machine on "
NOT_MEASURED = "by default figures, not measured here"
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
    text = f"{sentence} ({curves_basis(tags)})"
    return f"{text}; {MEASURE_IT}" if any(tag == DEFAULT_TAG for _, tag in tags) else text


def faster_everywhere(winner: str, loser: str, levels: Iterable[int], tags: Sequence[tuple[str, str]],
                      consequence: str) -> str:
    """The one wording of "`winner` is faster at every concurrency": "measures faster" only when every curve was
    measured here; otherwise the figures' basis, and the action that measures them."""
    shown = "; ".join(part for part in (", ".join(str(level) for level in levels), curves_basis(tags)) if part)
    if tags and all(is_measured(tag) for _, tag in tags):
        return f"{winner} measures faster at every concurrency ({shown}): {consequence}"
    text = f"{winner} is faster at every concurrency ({shown}): {consequence}"
    return f"{text}; {MEASURE_IT}" if any(tag == DEFAULT_TAG for _, tag in tags) else text


__all__ = ["DEFAULT_TAG", "MEASURED_PREFIX", "MEASURE_IT", "NOT_MEASURED", "curve_basis", "curves_basis",
           "faster_everywhere", "is_measured", "measured_tag", "qualified", "workload_basis"]
