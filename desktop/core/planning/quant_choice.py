"""Which quantization, within a quality budget (issue 56): the smallest variant whose mean KL divergence from a
higher-precision reference, measured on this machine by `switchyard quality`, is at or under the budget; the bits
rule (the most bits per weight that fits, at most 8.5) only where nothing within the budget was measured.

The budget is a mean KLD (settings `kld_budget`, default DEFAULT_KLD_BUDGET; why that number: docs/quality.md).
Every choice says where it comes from, in the words of planning/basis.py: "measured here on DATE" or "by the bits
rule, not measured here", and names the action that would measure what was not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from desktop.core.models.quant_names import quant_from_name

DEFAULT_KLD_BUDGET = 0.05
BITS_RULE = "by the bits rule, not measured here"

T = TypeVar("T")


@dataclass(frozen=True)
class MeasuredQuant:
    """One quantization's figures from the newest `switchyard quality` run of the model here."""

    quant: str
    mean_kld: float
    same_top: float | None
    reference: str  # the reference file's name
    run_id: int | None
    run_date: str

    @property
    def basis(self) -> str:
        return f"measured here on {self.run_date}"


@dataclass(frozen=True)
class QuantChoice(Generic[T]):
    pick: T | None
    basis: str  # "measured here on DATE" | BITS_RULE | "" (nothing to choose from)
    reason: str


def quant_key(label: str) -> str:
    """A variant's label or file name as the quantization it names (`Foo-Q4_K_M.gguf` -> Q4_K_M)."""
    return quant_from_name(label) or label.strip().upper()


def measured_quants(quality: Mapping[str, Any] | None) -> dict[str, MeasuredQuant]:
    """Quantization -> its measured figures, from a quality run's summary (planning.evidence `Evidence.quality`).
    The reference's own quantization, when its file name says it, is in the table at KLD 0: it is the yardstick."""
    if not quality:
        return {}
    reference = Path(str(quality.get("reference") or "")).name
    run_id, run_date = quality.get("run_id"), str(quality.get("run_date") or "")
    out: dict[str, MeasuredQuant] = {}
    ref_quant = quant_from_name(reference) if reference else None
    if ref_quant:
        out[ref_quant] = MeasuredQuant(ref_quant, 0.0, 1.0, reference, run_id, run_date)
    for row in quality.get("variants") or []:
        try:
            kld = float(row["mean_kld"])
        except (KeyError, TypeError, ValueError):
            continue
        if kld != kld:  # NaN: not a figure
            continue
        key = quant_key(str(row.get("variant") or row.get("path") or ""))
        same_top = row.get("same_top")
        out[key] = MeasuredQuant(key, kld, float(same_top) if isinstance(same_top, (int, float)) else None,
                                 reference, run_id, run_date)
    return out


def choose(candidates: Sequence[T], quant_of: Callable[[T], str | None], size_of: Callable[[T], float],
           bits_rule: Callable[[Sequence[T]], T | None], measured: Mapping[str, MeasuredQuant],
           budget: float = DEFAULT_KLD_BUDGET, model: str = "MODEL") -> QuantChoice[T]:
    """Among `candidates` (all of which fit), the smallest measured within `budget`; else the bits rule's pick
    among those not measured over it (all of them when every one is over). `model` is how the action names it."""
    if not candidates:
        return QuantChoice(None, "", "")
    figures = {id(c): measured.get(quant_key(quant_of(c) or "")) for c in candidates}
    within = [c for c in candidates if (m := figures[id(c)]) is not None and m.mean_kld <= budget]
    over = [c for c in candidates if (m := figures[id(c)]) is not None and m.mean_kld > budget]
    unmeasured = [c for c in candidates if figures[id(c)] is None]
    if within:
        pick = min(within, key=size_of)
        m = figures[id(pick)]
        assert m is not None
        smaller_over = [c for c in over if size_of(c) < size_of(pick)]
        reason = (f"{_name(pick, quant_of)}: mean KLD {m.mean_kld:.4f} against {m.reference}, within the "
                  f"{budget:g} quality budget ({m.basis}, run #{m.run_id})")
        if smaller_over:
            reason += "; smaller ones are over it: " + ", ".join(
                f"{_name(c, quant_of)} {_kld(figures[id(c)])}" for c in sorted(smaller_over, key=size_of))
        smaller_unmeasured = [c for c in unmeasured if size_of(c) < size_of(pick)]
        if smaller_unmeasured:
            names = ",".join(_name(c, quant_of) for c in sorted(smaller_unmeasured, key=size_of))
            reason += (f"; {names} not measured: `switchyard quality {model} --variants {names}` tells whether a "
                       "smaller one is within it")
        return QuantChoice(pick, m.basis, reason)
    over_ids = {id(c) for c in over}
    by_bits = bits_rule([c for c in candidates if id(c) not in over_ids] or list(candidates))
    if by_bits is None:
        return QuantChoice(None, "", "")
    reason = f"{_name(by_bits, quant_of)} {BITS_RULE}"
    if over:
        reason += "; measured over the " + f"{budget:g} budget: " + ", ".join(
            f"{_name(c, quant_of)} {_kld(figures[id(c)])}" for c in sorted(over, key=size_of))
    if unmeasured:
        names = ",".join(_name(c, quant_of) for c in sorted(unmeasured, key=size_of))
        reason += f"; `switchyard quality {model} --variants {names}` measures how far each moves the answers"
    return QuantChoice(by_bits, BITS_RULE, reason)


def _name(candidate: Any, quant_of: Callable[[Any], str | None]) -> str:
    return quant_of(candidate) or str(getattr(candidate, "name", candidate))


def _kld(m: MeasuredQuant | None) -> str:
    return f"(mean KLD {m.mean_kld:.4f}, {m.run_date})" if m is not None else ""
