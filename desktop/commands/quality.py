"""`switchyard quality MODEL --variants Q8_0,Q4_K_M [--reference R] [--prompts FILE] [--ctx N] [--json]`: how far
each quantization's answers move from a higher-precision reference, measured here by llama.cpp's own
llama-perplexity (mean and p99 KL divergence, same top token, perplexity ratio), kept in history.

MODEL (a GGUF file, a folder holding one, or `demo`) is the reference unless --reference names another. A variant
is a GGUF file, or a quantization type (Q8_0, Q6_K, Q4_K_M, ...) that the pinned llama-quantize writes from the
reference into the app's cache (once; later runs reuse it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from desktop.commands import _numbers as N
from desktop.commands._common import emit_json


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("quality", help="measure how far quantizations move a model's answers (KL divergence)")
    p.add_argument("model", help="the reference: a .gguf file, a folder holding one, or demo")
    p.add_argument("--variants", required=True,
                   help="comma-separated GGUF files or quantization types (Q8_0, Q4_K_M ...) to write from it")
    p.add_argument("--reference", help="another, higher-precision GGUF as the reference (default: MODEL)")
    p.add_argument("--prompts", help="a text file to score on, or `traffic`: the prompts the endpoint captured "
                                     "(serve --capture-bodies); default: the shipped corpus of code and prose")
    p.add_argument("--ctx", type=N.count, default=256, help="tokens per scored chunk (default 256)")
    p.add_argument("--long-ctx", type=N.whole(0), default=None,
                   help="also score positions deep in chunks of this many tokens, reported apart (default 2048 when "
                        "the model's context and the corpus allow; 0: not)")
    p.add_argument("--engine", default="llama.cpp", choices=("llama.cpp", "vllm"),
                   help="vllm: MODEL is a Hugging Face folder (or demo), each variant (and --reference) a plan "
                        "setting such as dtype=bfloat16 or quantization=fp8, scored by prompt_logprobs")
    p.add_argument("--top", type=int, default=20,
                   help="vllm: log-probabilities per position (default 20, an estimate; -1: the whole vocabulary, "
                        "exact, for small vocabularies)")
    p.add_argument("--eager", action="store_true",
                   help="vllm: each load with --enforce-eager (no torch.compile: starts sooner on a CPU; the same "
                        "outputs, scored alike for reference and variants)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_quality)


def cmd_quality(args: argparse.Namespace) -> int:
    from desktop.core.common.progress import ProgressEvent
    from desktop.core.measure.quality_job import parse_variants, run_quality

    def progress(event: ProgressEvent) -> None:
        print(event.message, file=sys.stderr, flush=True)

    if args.engine == "vllm":
        return _vllm(args, progress)
    report, run_id = run_quality(args.model, parse_variants(args.variants), reference=args.reference,
                                 prompts=args.prompts, ctx=args.ctx, long_ctx=args.long_ctx, progress=progress)
    return _report(args, report, "llama.cpp", run_id)


def _setting(text: str) -> dict[str, object]:
    """`dtype=bfloat16` as plan settings ({} for an empty text)."""
    from desktop.core.common.errors import SwitchyardError

    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split("+"))):
        key, sep, value = part.partition("=")
        if not sep:
            raise SwitchyardError(f"{part} is not a setting", "write it as NAME=VALUE, e.g. dtype=bfloat16")
        out[key.strip()] = value.strip()
    return out


def _vllm(args: argparse.Namespace, progress: Any) -> int:
    from desktop.core.common.errors import SwitchyardError
    from desktop.core.measure.quality_job import corpus_for, parse_variants, record
    from desktop.core.measure.quality_vllm import measure_vllm

    if args.top == 0 or args.top < -1:
        raise SwitchyardError(f"--top {args.top}: give a number of log-probabilities per position (20 is vLLM's "
                              "default limit) or -1 for the whole vocabulary")
    reference = _setting(args.reference or "dtype=float32")
    variants = {v: _setting(v) for v in parse_variants(args.variants)}
    report = measure_vllm(args.model, reference, variants, corpus_for(args.prompts), ctx=args.ctx, top=args.top,
                          eager=args.eager, progress=progress)
    return _report(args, report, "vllm", record(report, args.model, "vllm", args.ctx))


def _report(args: argparse.Namespace, report: Any, engine: str, run_id: int) -> int:
    """Print a measured (and already recorded) report: a table, or --json."""
    if args.json:
        emit_json({"run_id": run_id, **report.to_json(), "seconds_per_1k_tokens": report.seconds_per_1k_tokens})
        return 0
    print(f"reference {Path(report.reference).name}, corpus {Path(report.corpus).name}, {args.ctx} tokens per "
          f"chunk ({'llama-perplexity' if engine == 'llama.cpp' else 'prompt_logprobs'}, {report.engine_version})")
    print(f"{'variant':<14}{'mean KLD':>10}{'p99 KLD':>10}{'same top':>10}{'PPL ratio':>11}{'tokens':>8}")
    for v in report.variants:
        print(f"{v.variant:<14}{v.mean_kld:>10.5f}{v.kld_p99:>10.5f}{v.same_top:>9.1%}{v.ppl_ratio:>11.4f}"
              f"{v.tokens:>8}")
    long = getattr(report, "long_context", None) or {}
    if long.get("variants"):
        print(f"deep in {long['ctx']}-token chunks (positions {long['positions']}):")
        for name, v in long["variants"].items():
            print(f"{name:<14}{v['mean_kld']:>10.5f}{v['kld_p99']:>10.5f}{v['same_top']:>9.1%}{v['ppl_ratio']:>11.4f}"
                  f"{v['tokens']:>8}")
    for note in (getattr(report, "reference_note", ""), long.get("note")):
        if note:
            print(note)
    print(f"{report.seconds_per_1k_tokens:.2f} s per 1,000 tokens scored; kept in history as run {run_id}")
    return 0
