"""Which quantization: how far a quantized model's token distributions move from a higher-precision reference's,
measured on this machine with llama.cpp's own `llama-perplexity` (issue 56).

The figures are the ones quant makers publish and llama.cpp users compare: the mean KL divergence of the
variant's next-token distribution from the reference's over every scored position, its 99th percentile, how often
both put the same token on top ("same top p"), and the ratio of their perplexities. They are read from the tool's
own report (tools/perplexity/perplexity.cpp `kl_divergence`), not recomputed here: the reference's log-probabilities
are written once (`--kl-divergence-base FILE`), then each variant is scored against that file (`--kl-divergence`),
one model in memory at a time. Positions scored: the second half of every chunk of `ctx` tokens (the tool skips
the first half so that every scored token has context), i.e. chunks x (ctx - 1 - ctx/2).

The corpus is a text file: the user's own prompts (captured traffic) or the shipped one (code and prose,
resources/quality/corpus.txt).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from desktop.core.common import paths
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import kernels
from desktop.core.engines.base import EngineAdapter, EngineInstall
from desktop.core.engines.llamacpp_logs import NO_REPACK
from desktop.core.engines.llamacpp_tools import ensure_tools

SHIPPED_CORPUS = Path(__file__).resolve().parents[3] / "resources" / "quality" / "corpus.txt"
DEFAULT_CTX = 256
DEFAULT_LONG_CTX = 2048
TOOL_TIMEOUT_S = 3600
# How a faulting CPU kernel ends a tool run (subprocess's negative signal numbers).
_KERNEL_FAULTS = frozenset(-int(s) for s in (signal.SIGILL, signal.SIGSEGV, getattr(signal, "SIGBUS", signal.SIGSEGV)))
log = logging.getLogger("switchyard.quality")
_FLOAT = r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"
_FIGURES = {
    "mean_kld": re.compile(r"^Mean\s+KLD:\s*" + _FLOAT, re.M),
    "kld_p99": re.compile(r"^99\.0%\s+KLD:\s*" + _FLOAT, re.M),
    "same_top_percent": re.compile(r"^Same top p:\s*" + _FLOAT, re.M),
    "ppl_ratio": re.compile(r"^Mean PPL\(Q\)/PPL\(base\)\s*:\s*" + _FLOAT, re.M),
    "ppl": re.compile(r"^Mean PPL\(Q\)\s*:\s*" + _FLOAT, re.M),
    "ppl_base": re.compile(r"^Mean PPL\(base\)\s*:\s*" + _FLOAT, re.M),
}
_QUANT = re.compile(r"[A-Za-z][A-Za-z0-9_]{1,15}")
_CHUNKS = re.compile(r"computing over (\d+) chunks, n_ctx=(\d+)")
_TOO_SHORT = re.compile(r"you need at least (\d+) tokens to evaluate perplexity.*?tokenizes to only (\d+) tokens",
                        re.S)


@dataclass(frozen=True)
class VariantQuality:
    """One variant against the reference, as llama-perplexity reported it."""

    variant: str
    path: str
    mean_kld: float
    kld_p99: float
    same_top: float  # fraction of scored positions where both models' most likely token is the same
    ppl_ratio: float
    tokens: int  # positions scored
    seconds: float


@dataclass
class QualityReport:
    model: str
    reference: str
    corpus: str
    ctx: int
    engine_version: str
    variants: list[VariantQuality] = field(default_factory=list)
    reference_seconds: float = 0.0
    reference_note: str = ""  # set when the given reference did not fit and a variant took its place
    # the same figures in chunks of `ctx` tokens, positions ctx/2 .. ctx-1 (deep in the context), per variant; or a
    # note saying why not (measure's long_ctx)
    long_context: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def seconds_per_1k_tokens(self) -> float:
        """The cost: tool time (reference pass and every variant) per 1,000 positions scored per variant."""
        tokens = sum(v.tokens for v in self.variants)
        total = self.reference_seconds * len(self.variants) + sum(v.seconds for v in self.variants)
        return 1000 * total / tokens if tokens else 0.0


def parse_kld_report(text: str) -> dict[str, float]:
    """The figures of a `llama-perplexity --kl-divergence` run's report (its stdout and stderr)."""
    found: dict[str, float] = {}
    for name, pattern in _FIGURES.items():
        match = pattern.search(text)
        if match:
            found[name] = float(match.group(1))
    missing = [name for name in ("mean_kld", "kld_p99", "same_top_percent", "ppl_ratio") if name not in found]
    if missing:
        raise SwitchyardError(f"llama-perplexity's report has no {', '.join(missing)}",
                              "see its output above; the model may be too small for the context")
    chunks = _CHUNKS.search(text)
    if chunks:
        n_chunk, n_ctx = int(chunks.group(1)), int(chunks.group(2))
        found["tokens"] = n_chunk * (n_ctx - 1 - n_ctx // 2)
    return found


def traffic_corpus(out: Path, limit: int = 5000) -> Path:
    """The user's own prompts as a corpus: the text of the requests the endpoint captured (`serve
    --capture-bodies`), newest `limit`, one after another."""
    from desktop.core.measure.profile import prompt_text
    from desktop.core.storage.history import Store

    with Store() as store:
        rows = store.requests_between(0.0)[-limit:]
    texts = [text for text in (prompt_text(row.get("request_body")) for row in rows) if text]
    if not texts:
        raise SwitchyardError("no request bodies were captured, so there are no prompts of yours to score on",
                              "serve with --capture-bodies for a while, or give --prompts FILE")
    staging = out.with_name(f"{out.name}.{os.getpid()}.part")  # another run may be reading or writing it
    try:
        staging.write_text("\n\n".join(texts))
        staging.replace(out)
    except OSError:
        staging.unlink(missing_ok=True)  # a full disk leaves no half-written copy
        raise
    return out


def quantize(install: EngineInstall, source: Path, quant: str, out: Path,
             progress: ProgressCallback = no_progress) -> Path:
    """`source` (a GGUF) written as `quant` (Q8_0, Q4_K_M, ...) by the install's own llama-quantize."""
    tools = ensure_tools(install, progress)
    progress(ProgressEvent(f"quantizing {source.name} to {quant}"))
    _run([str(tools["llama-quantize"]), str(source), str(out), quant], install, f"llama-quantize {quant}")
    return out


def variant_files(install: EngineInstall, reference: Path, variants: list[str], adapter: EngineAdapter,
                  progress: ProgressCallback = no_progress) -> dict[str, Path]:
    """Each variant as a GGUF file: a path as given, a quantization type written from `reference` by the pinned
    llama-quantize into the app's cache (kept per reference file, its size and time: a later run reuses it)."""
    from desktop.core.engines.model_path import resolve_model

    files: dict[str, Path] = {}
    for variant in variants:
        given = Path(variant).expanduser()
        if given.exists():
            files[given.name] = resolve_model(str(given), adapter)
            continue
        if not _QUANT.fullmatch(variant):
            raise SwitchyardError(f"{variant} is neither a file nor a quantization type",
                                  "give GGUF files or types llama-quantize writes, e.g. Q8_0,Q6_K,Q4_K_M")
        stat = reference.stat()
        key = hashlib.sha256(f"{reference.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        folder = paths.cache_dir() / "quality" / f"{reference.stem}-{key}"
        target = folder / f"{variant.upper()}.gguf"
        if not target.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            # a name of this process's own: two runs (the app's and a shell's) quantizing the same variant at once
            # each write whole, and the last rename wins with a complete file
            drop_stale_parts(target)
            partial = target.with_name(f"{target.stem}.{os.getpid()}.part")
            try:
                quantize(install, reference, variant.upper(), partial, progress)
            except SwitchyardError:
                partial.unlink(missing_ok=True)  # a refused type or a full disk leaves no half-written copy
                raise
            partial.replace(target)
        files[variant.upper()] = target
    return files


def drop_stale_parts(target: Path) -> list[Path]:
    """Delete the half-written copies of `target` (`<stem>.<pid>.part`) whose writer is gone (a run killed while
    quantizing): each may be as large as the model. A live writer's copy stays. Returns what was deleted."""
    import psutil

    dropped = []
    for part in target.parent.glob(f"{target.stem}.*.part"):
        pid = part.name[len(target.stem) + 1:-len(".part")]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            part.unlink(missing_ok=True)
            dropped.append(part)
    return dropped


def weights_bytes(path: Path) -> int:
    """Bytes of a GGUF on disk: every shard of a split set (llama-perplexity loads them all)."""
    from desktop.core.models.gguf_file import read_gguf_model

    try:
        return sum(shard.stat().st_size for shard in read_gguf_model(path).shards)
    except (OSError, SwitchyardError):
        return path.stat().st_size


def reference_that_fits(reference: Path, variants: Mapping[str, Path], fits: Callable[[int], bool]
                        ) -> tuple[Path, dict[str, Path], str]:
    """The reference to score against, the variants left to score, and what was changed, in words. A reference
    that does not fit this machine (`fits(bytes)`: the one sizing function's verdict) gives way to the largest
    variant that does (the most bits per weight: the closest to the original); that one is then no longer
    scored, and the note says so. Models are loaded one at a time, so each need fit only alone."""
    if fits(weights_bytes(reference)):
        return reference, dict(variants), ""
    gib = weights_bytes(reference) / (1 << 30)
    for label, path in sorted(variants.items(), key=lambda kv: weights_bytes(kv[1]), reverse=True):
        if not fits(weights_bytes(path)):
            continue
        rest = {name: other for name, other in variants.items() if name != label}
        if not rest:
            break
        note = (f"the reference {reference.name} ({gib:.1f} GiB) does not fit this machine's free memory: {label}, "
                "the highest-precision variant that does, is the reference instead; figures are against it")
        return path, rest, note
    raise SwitchyardError(f"the reference {reference.name} ({gib:.1f} GiB) does not fit this machine's free memory, "
                          "and no variant that does is left to score against another",
                          "free memory (close other programs or stop the engine), or give --reference a smaller, "
                          "higher-precision file than the variants (e.g. Q8_0 for Q4_K_M)")


def fits_here(hardware: Any = None) -> Callable[[int], bool]:
    """llama-perplexity's memory need, by the one sizing function (planning.fit.quick_verdict: the weights and
    their overhead, in free VRAM and RAM), against `hardware` (default: this machine as detected now)."""
    from desktop.core.machine.hardware import detect
    from desktop.core.planning.fit import quick_verdict

    snapshot = hardware or detect()
    return lambda size: quick_verdict("llama.cpp", max(size, 1), None, snapshot) != "no"


def measure(install: EngineInstall, model: str, reference: Path, variants: Mapping[str, Path], corpus: Path, *,
            ctx: int = DEFAULT_CTX, threads: int | None = None, progress: ProgressCallback = no_progress,
            fits: Callable[[int], bool] | None = None, long_ctx: int | None = None) -> QualityReport:
    """Every variant against `reference` on `corpus`, one model loaded at a time; a reference that does not fit
    (`fits`, default: this machine) replaced by the largest variant that does (`reference_that_fits`).

    Long context apart: the same passes again in chunks of `long_ctx` tokens (default DEFAULT_LONG_CTX, 0: not),
    whose scored positions (the second half of each chunk) all have at least long_ctx/2 tokens before them; skipped,
    with a note, when the model's own context or the corpus is shorter."""
    reference, variants, reference_note = reference_that_fits(reference, variants, fits or fits_here())
    if reference_note:
        progress(ProgressEvent(reference_note))
    tools = ensure_tools(install, progress)
    report = QualityReport(model=model, reference=str(reference), corpus=str(corpus), ctx=ctx,
                           engine_version=install.version, reference_note=reference_note)
    passes = _Passes(str(tools["llama-perplexity"]), install, reference, corpus, threads, progress)
    report.reference_seconds, figures = passes.run(ctx, variants)
    for label, (found, seconds) in figures.items():
        report.variants.append(VariantQuality(
            variant=label, path=str(variants[label]), mean_kld=found["mean_kld"], kld_p99=found["kld_p99"],
            same_top=found["same_top_percent"] / 100, ppl_ratio=found["ppl_ratio"],
            tokens=int(found.get("tokens", 0)), seconds=seconds))
    long_ctx = DEFAULT_LONG_CTX if long_ctx is None else long_ctx
    if long_ctx > ctx:
        report.long_context = _long_context(passes, reference, variants, long_ctx, report)
    return report


def _long_context(passes: _Passes, reference: Path, variants: Mapping[str, Path], long_ctx: int,
                  report: QualityReport) -> dict[str, Any]:
    """The figures at positions long_ctx/2 .. long_ctx-1 per variant, or why there are none."""
    trained = _trained_context(reference)
    first = long_ctx // 2
    out: dict[str, Any] = {"ctx": long_ctx, "positions": f"{first}-{long_ctx - 1}", "variants": {}}
    if trained is not None and trained < long_ctx:
        out["note"] = f"the model's own context is {trained} tokens: no {long_ctx}-token chunks to score"
        return out
    try:
        seconds, figures = passes.run(long_ctx, variants)
    except _CorpusTooShort as exc:
        out["note"] = f"long-context positions not scored: {exc.message}; give --prompts a longer text"
        return out
    out["reference_seconds"] = seconds  # apart: the cost per 1k tokens is the main pass's
    for label, (found, took) in figures.items():
        out["variants"][label] = {"mean_kld": found["mean_kld"], "kld_p99": found["kld_p99"],
                                  "same_top": found["same_top_percent"] / 100, "ppl_ratio": found["ppl_ratio"],
                                  "tokens": int(found.get("tokens", 0)), "seconds": took}
    return out


def _trained_context(path: Path) -> int | None:
    """The context length the GGUF says its model was trained for (`<arch>.context_length`)."""
    from desktop.core.models.gguf_file import read_gguf_header

    try:
        metadata = read_gguf_header(path).metadata
    except (OSError, SwitchyardError):
        return None
    value = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    return value if isinstance(value, int) and value > 0 else None


class _CorpusTooShort(SwitchyardError):
    pass


@dataclass
class _Passes:
    """llama-perplexity's two steps at one chunk size: the reference's log-probabilities written once, then each
    variant scored against them."""

    perplexity: str
    install: EngineInstall
    reference: Path
    corpus: Path
    threads: int | None
    progress: ProgressCallback

    def run(self, ctx: int, variants: Mapping[str, Path]) -> tuple[float, dict[str, tuple[dict[str, float], float]]]:
        common = ["-f", str(self.corpus), "-c", str(ctx), "-b", str(max(ctx, 512))]
        if self.threads:
            common += ["-t", str(self.threads)]
        figures: dict[str, tuple[dict[str, float], float]] = {}
        with tempfile.TemporaryDirectory(prefix="switchyard-quality-") as scratch:
            base = Path(scratch) / "reference.kld"
            self.progress(ProgressEvent(f"reference: {self.reference.name} ({ctx}-token chunks)"))
            started = time.monotonic()
            written = _run([self.perplexity, "-m", str(self.reference), *common, "--kl-divergence-base", str(base)],
                           self.install, "llama-perplexity (reference)", multiplies=True)
            short = _TOO_SHORT.search(written)  # the tool says so and exits 0, writing an empty base file
            if short:
                raise _CorpusTooShort(f"{self.corpus.name} is {short.group(2)} tokens long; {ctx}-token chunks need "
                                      f"at least {short.group(1)}",
                                      "give --prompts a longer text, or a smaller --ctx")
            reference_seconds = round(time.monotonic() - started, 2)
            for label, path in variants.items():
                self.progress(ProgressEvent(f"scoring {label} against the reference ({ctx}-token chunks)"))
                started = time.monotonic()
                found = _scored([self.perplexity, "-m", str(path), *common, "--kl-divergence-base", str(base),
                                 "--kl-divergence"], self.install, f"llama-perplexity ({label})")
                figures[label] = (found, round(time.monotonic() - started, 2))
        return reference_seconds, figures


def _run(argv: list[str], install: EngineInstall, what: str, *, multiplies: bool = False) -> str:
    """Run one of the tools; its whole output (written to a file: with pipes it lost more), or an error that
    quotes its last lines. `multiplies`: the tool runs the model (llama-perplexity), so it starts with what this
    build avoids on this CPU (engines.kernels), and a run killed by a faulting CPU kernel (SIGILL, SIGSEGV, SIGBUS
    without --no-repack) is run again at once with --no-repack, which the build then keeps here when it works."""
    if multiplies:
        argv = list(kernels.with_avoidance(argv, kernels.avoidance(install)))
    code, text = _exec(argv, install, what)
    if multiplies and code in _KERNEL_FAULTS and NO_REPACK not in argv:
        killed = -code
        log.warning("%s was killed by signal %d: running it again with %s", what, killed, NO_REPACK)
        code, text = _exec([*argv, NO_REPACK], install, what)
        if code == 0:
            kernels.remember(install, (NO_REPACK,), f"{Path(argv[0]).name} was killed by signal {killed} with "
                             f"its repacked CPU kernels and ran with {NO_REPACK}", source="crash")
    if code != 0:
        tail = " | ".join(line for line in text.strip().splitlines()[-4:])
        raise SwitchyardError(f"{what} failed (exit {code}): {tail}")
    return text


def _exec(argv: list[str], install: EngineInstall, what: str) -> tuple[int, str]:
    """The tool's exit code and whole output."""
    libraries = os.pathsep.join(filter(None, (str(install.executable.parent), os.environ.get("LD_LIBRARY_PATH"))))
    env = {**os.environ, "LD_LIBRARY_PATH": libraries}
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=TOOL_TIMEOUT_S,  # noqa: S603
                                  env=env, check=False)
        except subprocess.TimeoutExpired as exc:
            raise SwitchyardError(f"{what} did not finish within {TOOL_TIMEOUT_S} s") from exc
        out.seek(0)
        return done.returncode, out.read()


def _scored(argv: list[str], install: EngineInstall, what: str, attempts: int = 3) -> dict[str, float]:
    """A variant's figures. llama.cpp's logger can drop the last lines of a tool's output at exit (common/log.cpp
    leaks its logging thread on purpose, ggml-org/llama.cpp#22142): seen here in 1 run of 6 with the output in a
    file, so a report without its figures is run again, at most `attempts` times in all."""
    for attempt in range(attempts):
        text = _run(argv, install, what, multiplies=True)
        try:
            return parse_kld_report(text)
        except SwitchyardError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
