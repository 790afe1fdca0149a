"""The engine flags that make a server an embedder or a reranker (issue 57), for a models.yaml entry's `kind`.

Read in the pinned engines' own help and source (the ground truth):
- llama-server b11434: `--embedding/--embeddings` restricts a server to embeddings; `--rerank/--reranking` turns on
  /v1/rerank and needs `--pooling rank`; `--pooling {none,mean,cls,last,rank}` defaults to the model's own
  (`<arch>.pooling_type` in the GGUF) and, when the GGUF names none, a decoder's is `none`, which /v1/embeddings
  refuses ("not OAI compatible"): such a model gets `mean`. An input is embedded in one physical batch (pooling
  cannot split it, server-context.cpp: "input (N tokens) is too large to process. increase the physical batch
  size"), and the physical batch defaults to 512 tokens (`-ub`), the logical one to 2048 (`-b`, which must hold
  it): both are raised to the entry's context so that every input the context takes is embedded, not refused.
- vLLM 0.32: `--runner pooling` serves /v1/embeddings, /pooling, /score and /rerank with the model's own pooler.

A flag the person gave in the entry's `args` (any spelling) is never added again or overridden.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import get_adapter
from desktop.core.engines.flag_spelling import flag_name

KINDS = ("chat", "embedding", "rerank")
LLAMA_DEFAULT_BATCH = 2048  # llama-server's -b when not given
LLAMA_DEFAULT_UBATCH = 512  # its -ub


# Each flag these entries add, under every name the engine's parser takes for it (llama-server --help, vLLM 0.32).
_ALIASES = {
    "llama.cpp": {"--embedding": "--embeddings", "--embeddings": "--embeddings", "--rerank": "--reranking",
                  "--reranking": "--reranking", "--pooling": "--pooling", "-ub": "--ubatch-size",
                  "--ubatch-size": "--ubatch-size", "-b": "--batch-size", "--batch-size": "--batch-size"},
    "vllm": {"--runner": "--runner"},
}


def task_args(engine: str, kind: str, ctx: int, given: Sequence[str], model_path: Path | None = None) -> list[str]:
    """The flags a `kind` entry adds to its engine's argv before the person's own `given` args."""
    if kind == "chat":
        return []
    if kind not in KINDS:
        raise SwitchyardError(f"unknown kind {kind!r}", f"choose one of: {', '.join(KINDS)}")
    named = named_flags(engine, given)
    out: list[str] = []
    if _family(engine) == "vllm":
        return [] if "--runner" in named else ["--runner", "pooling"]
    switch = "--embeddings" if kind == "embedding" else "--reranking"
    if switch not in named:
        out.append(switch)
    if "--pooling" not in named:
        pooling = "rank" if kind == "rerank" else None if model_pooling(model_path) else "mean"
        if pooling:
            out += ["--pooling", pooling]
    if ctx > LLAMA_DEFAULT_UBATCH and "--ubatch-size" not in named:
        out += ["--ubatch-size", str(ctx)]
    if ctx > LLAMA_DEFAULT_BATCH and "--batch-size" not in named:
        out += ["--batch-size", str(ctx)]
    return out


def args_kind(engine: str, args: Sequence[str], model_path: Path | None = None) -> str:
    """What a server launched with `args` serves: "embedding", "rerank" or "chat". llama-server says it in its
    switches; vLLM's `--runner pooling` serves what the model's head does: a *ForSequenceClassification
    checkpoint (a cross-encoder) reranks, anything else embeds."""
    named = named_flags(engine, args)
    if _family(engine) == "vllm":
        if not _runs_pooling(args):
            return "chat"
        return "rerank" if _classifies(model_path) else "embedding"
    return "embedding" if "--embeddings" in named else "rerank" if "--reranking" in named else "chat"


def _runs_pooling(args: Sequence[str]) -> bool:
    tokens = [str(a) for a in args]
    return any(t == "--runner=pooling" or (t == "--runner" and tokens[i + 1:i + 2] == ["pooling"])
               for i, t in enumerate(tokens))


def _classifies(model_path: Path | None) -> bool:
    """Whether the Hugging Face folder's config names a sequence-classification head."""
    import json

    config = model_path / "config.json" if model_path is not None and model_path.is_dir() else None
    try:
        data = json.loads(config.read_text(encoding="utf-8")) if config is not None else {}
    except (OSError, ValueError):
        return False
    names = data.get("architectures") if isinstance(data, dict) else None
    return isinstance(names, list) and any(str(n).endswith("ForSequenceClassification") for n in names)


def named_flags(engine: str, given: Sequence[str]) -> set[str]:
    """The flags among `given` this module adds, by their one name, whatever the person's spelling."""
    adapter = get_adapter(engine)
    aliases = _ALIASES.get(_family(engine), {})  # an engine of neither family has none of these flags
    return {aliases[name] for arg in given if arg.startswith("-")
            if (name := flag_name(adapter, arg)[0]) in aliases}


def _family(engine: str) -> str:
    """Whose flags an engine takes: its adapter's sizing family (llama.cpp or vllm), else its own name."""
    adapter = get_adapter(engine)
    return adapter.sizing or adapter.name


def model_pooling(model_path: Path | None) -> int | None:
    """The pooling a GGUF names for itself (`<arch>.pooling_type`), None when it names none or cannot be read."""
    if model_path is None or model_path.suffix != ".gguf":
        return None
    from desktop.core.models.gguf_file import read_gguf_header

    try:
        metadata = read_gguf_header(model_path).metadata
    except Exception:  # noqa: BLE001 - unreadable here: the engine reads it and says what is wrong
        return None
    value = metadata.get(f"{metadata.get('general.architecture')}.pooling_type")
    return value if isinstance(value, int) and value > 0 else None
