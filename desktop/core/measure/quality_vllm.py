"""The quality figures of measure.quality for Hugging Face variants served by vLLM, where llama.cpp's tool does
not apply: each variant is served in turn (one in memory at a time) and asked, for every chunk of the corpus,
for `prompt_logprobs`, the log-probabilities its model gives at every prompt position (vLLM 0.32
entrypoints/openai/completion: `prompt_logprobs: -1` is the whole vocabulary, which `--max-logprobs -1` allows).

Written by hand because vLLM has no KL-divergence tool; the sums are llama-perplexity's definitions, applied to
the same positions it scores (the second half of each chunk of `ctx` tokens):
- KLD at a position: sum over tokens t of p_ref(t) * (log p_ref(t) - log p_var(t));
- same top: the most likely token is the same for both;
- perplexity ratio: exp(mean(-log p_var(actual)) - mean(-log p_ref(actual))), the actual token being the
  corpus's next one.
With the whole vocabulary these are exact; with a top-k answer (a model whose vocabulary is too large to return
whole) the tokens outside the reference's top k are one remainder bucket on both sides, and a token outside the
variant's top k gets the variant's k-th probability at most (an estimate, said in the report's `exact` field).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.measure.quality import QualityReport, VariantQuality

Position = tuple[dict[int, float], int]  # (log-probabilities by token id, the corpus's actual token id)


@dataclass(frozen=True)
class Figures:
    mean_kld: float
    kld_p99: float
    same_top: float
    ppl_ratio: float
    tokens: int
    exact: bool


def chunks(token_ids: Sequence[int], ctx: int) -> Iterator[list[int]]:
    """Whole chunks of `ctx` tokens (a last partial chunk is left out, as llama-perplexity does)."""
    for start in range(0, len(token_ids) - ctx + 1, ctx):
        yield list(token_ids[start:start + ctx])


def scored_positions(base_url: str, model: str, chunk: list[int], top: int, client: httpx.Client) -> list[Position]:
    """The log-probabilities at the scored positions of one chunk (its second half), as vLLM answers them."""
    answer = client.post(f"{base_url}/v1/completions", json={
        "model": model, "prompt": chunk, "max_tokens": 1, "temperature": 0, "prompt_logprobs": top})
    if answer.status_code != 200:
        raise SwitchyardError(f"vLLM refused prompt_logprobs ({answer.status_code}): {answer.text[:300]}",
                              "it needs --max-logprobs at least the number asked (-1: the whole vocabulary)")
    per_token: list[Any] = answer.json()["choices"][0]["prompt_logprobs"]
    first = len(chunk) // 2
    positions = []
    for index in range(first, len(chunk)):  # position `index` predicts chunk[index] from what precedes it
        entry = per_token[index] or {}
        positions.append(({int(t): float(v["logprob"]) for t, v in entry.items()}, chunk[index]))
    return positions


def compare(reference: Sequence[Position], variant: Sequence[Position], exact: bool) -> Figures:
    """The figures of `variant` against `reference`, position by position (same corpus, same tokenizer)."""
    if len(reference) != len(variant) or not reference:
        raise SwitchyardError("the variant was scored on other positions than the reference",
                              "both must use the same tokenizer and corpus")
    klds, same, nll_ref, nll_var = [], 0, 0.0, 0.0
    for (ref, actual), (var, actual_var) in zip(reference, variant, strict=True):
        if actual != actual_var:
            raise SwitchyardError("the variant tokenized the corpus differently from the reference")
        klds.append(_kld(ref, var))
        same += max(ref, key=ref.__getitem__) == max(var, key=var.__getitem__)
        nll_ref -= ref.get(actual, _floor(ref))
        nll_var -= var.get(actual, _floor(var))
    klds.sort()
    n = len(klds)
    return Figures(mean_kld=sum(klds) / n, kld_p99=klds[min(n - 1, math.ceil(0.99 * n) - 1)], same_top=same / n,
                   ppl_ratio=math.exp((nll_var - nll_ref) / n), tokens=n, exact=exact)


def _floor(logprobs: Mapping[int, float]) -> float:
    """At most this for a token a top-k answer left out: the smallest it returned."""
    return min(logprobs.values())


def _kld(ref: Mapping[int, float], var: Mapping[int, float]) -> float:
    total = 0.0
    ref_mass = var_mass = 0.0
    for token, logp in ref.items():
        p = math.exp(logp)
        q_log = var.get(token, _floor(var))
        total += p * (logp - q_log)
        ref_mass += p
        var_mass += math.exp(q_log)
    rest_ref, rest_var = 1.0 - ref_mass, 1.0 - var_mass
    if rest_ref > 1e-9 and rest_var > 1e-9:  # a top-k answer: what lies outside it, as one bucket
        total += rest_ref * (math.log(rest_ref) - math.log(rest_var))
    return max(total, 0.0)


def measure_vllm(model: str, reference: Mapping[str, Any], variants: Mapping[str, Mapping[str, Any]],
                 corpus: Path, *, ctx: int = 256, top: int = 20, timeout: float = 900.0, eager: bool = False,
                 progress: ProgressCallback = no_progress) -> QualityReport:
    """Every variant (plan settings: `{"dtype": "bfloat16"}`, `{"quantization": "fp8"}` ...) against the
    `reference` settings of the same Hugging Face model on vLLM, each launched by a plan the fit checked, one at a
    time. `top`: log-probabilities per position (-1: the whole vocabulary, exact; a model with a vocabulary of
    150k tokens answers 150k numbers per position then, so the default is vLLM's own limit, 20). `eager`: every
    load without torch.compile (the same outputs; it starts sooner), the reference's and the variants' alike."""
    from desktop.core.engines import get_adapter, require_install
    from desktop.core.machine.hardware import detect
    from desktop.core.planning.planner import plan_launch
    from desktop.core.runtime.supervisor import EngineProcess

    adapter = get_adapter("vllm")
    install = require_install(adapter)
    hardware = detect()
    report = QualityReport(model=model, reference=f"{model} {_settings(reference)}", corpus=str(corpus), ctx=ctx,
                           engine_version=f"vLLM {install.version}")
    text = corpus.read_text()
    scored: dict[str, list[Position]] = {}
    for label, settings in [("reference", reference), *variants.items()]:
        asked = {**settings, "ctx_per_request": max(ctx, 512), "slots": 1,
                 "extra_args": ("--max-logprobs", str(top)), **({"eager": True} if eager else {})}
        checked = plan_launch("vllm", model, hardware, asked, progress=progress)
        progress(ProgressEvent(f"vLLM with {_settings(settings)}: starting"))
        started = time.monotonic()
        process = EngineProcess(adapter, checked.plan, install, tcp=True)
        try:
            process.start()
            process.wait_ready(timeout=timeout)
            with httpx.Client(trust_env=False, timeout=timeout) as client:
                tokens = client.post(f"{process.base_url}/tokenize", json={"model": checked.plan.served_model_name,
                                                                            "prompt": text}).json()["tokens"]
                positions: list[Position] = []
                for chunk in chunks(tokens, ctx):
                    positions += scored_positions(process.base_url, checked.plan.served_model_name, chunk, top,
                                                  client)
        finally:
            process.stop()
        if not positions:
            raise SwitchyardError(f"the corpus has fewer than {ctx} tokens", "give a longer --prompts file")
        scored[label] = positions
        if label == "reference":
            report.reference_seconds = round(time.monotonic() - started, 2)
            continue
        figures = compare(scored["reference"], positions, exact=top == -1)
        report.variants.append(VariantQuality(
            variant=label, path=f"{model} {_settings(settings)}", mean_kld=figures.mean_kld,
            kld_p99=figures.kld_p99, same_top=figures.same_top, ppl_ratio=figures.ppl_ratio, tokens=figures.tokens,
            seconds=round(time.monotonic() - started, 2)))
    return report


def _settings(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items()) or "as loaded"
