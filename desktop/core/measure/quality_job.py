"""One quality measurement from a model name to a history run (issue 56): what `switchyard quality` and the app's
"Measure quality" action both call, so the model is resolved, the corpus picked and the run recorded the same way
wherever it starts. The figures themselves come from measure.quality (llama-perplexity) or measure.quality_vllm.
"""

from __future__ import annotations

from pathlib import Path

from desktop.core.common import paths
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, no_progress
from desktop.core.measure import quality
from desktop.core.measure.quality import DEFAULT_CTX, QualityReport

DEFAULT_VARIANTS = "Q8_0,Q4_K_M"


def parse_variants(text: str) -> list[str]:
    """`Q8_0, Q4_K_M,` as a list of variants (blanks dropped), as --variants is read."""
    return [v.strip() for v in text.split(",") if v.strip()]


def corpus_for(prompts: str | None) -> Path:
    """The text to score on: None is the shipped corpus, `traffic` the prompts the endpoint captured, else a file."""
    if prompts == "traffic":
        return quality.traffic_corpus(paths.cache_dir() / "quality" / "traffic-corpus.txt")
    corpus = Path(prompts).expanduser() if prompts else quality.SHIPPED_CORPUS
    if not corpus.is_file():
        raise SwitchyardError(f"{corpus} is not a text file", "give --prompts FILE, or --prompts traffic")
    return corpus


def record(report: QualityReport, model: str, engine: str, ctx: int) -> int:
    """Keep a measured report in history as a `quality` run (the one place that writes one; planning.evidence
    reads the newest back for the Recommend page). Returns the run's id."""
    from desktop.core.storage.history import RunRecord, Store

    with Store() as store:
        return store.add_run(RunRecord(kind="quality", engine=engine, engine_version=report.engine_version,
                                       model=model, settings={"reference": report.reference,
                                                              "corpus": report.corpus, "ctx": ctx},
                                       summary=report.to_json(), created_at=report.created_at))


def run_quality(model: str, variants: list[str], *, reference: str | None = None, prompts: str | None = None,
                ctx: int = DEFAULT_CTX, long_ctx: int | None = None, progress: ProgressCallback = no_progress
                ) -> tuple[QualityReport, int]:
    """Measure each variant of `model` (a GGUF, a folder holding one, or `demo`) against `reference` (default:
    the model itself) with llama.cpp's tools, and record the run. Returns the report and its run id."""
    from desktop.core.engines import get_adapter, require_install
    from desktop.core.engines.model_path import resolve_model

    if not variants:
        raise SwitchyardError("no variants to measure", f"give quantization types or GGUF files, e.g. {DEFAULT_VARIANTS}")
    adapter = get_adapter("llama.cpp")
    install = require_install(adapter)
    reference_path = resolve_model(reference or model, adapter, progress)
    corpus = corpus_for(prompts)
    files = quality.variant_files(install, reference_path, variants, adapter, progress)
    report = quality.measure(install, model, reference_path, files, corpus, ctx=ctx, long_ctx=long_ctx,
                             progress=progress)
    return report, record(report, model, "llama.cpp", ctx)


def result_lines(report: QualityReport) -> list[str]:
    """Each variant's figures in one line (and deep in a long context, where scored), as the app shows them."""
    long = report.long_context or {}
    deep = long.get("variants") or {}
    lines = []
    for v in report.variants:
        line = (f"{v.variant}: mean KLD {v.mean_kld:.4f}, p99 {v.kld_p99:.4f}, same top token {v.same_top:.1%}, "
                f"{v.tokens} tokens")
        if v.variant in deep:
            line += (f"; at positions {long.get('positions')}: mean KLD {deep[v.variant]['mean_kld']:.4f}, "
                     f"same top token {deep[v.variant]['same_top']:.1%}")
        lines.append(line)
    notes = [report.reference_note, long.get("note")]
    return lines + [str(note) for note in notes if note]
