"""Turn what the user typed as a model (`demo`, a GGUF file, a Hugging Face folder) into a path the engine can
load, or a clear error saying why not and what to pick instead."""

from __future__ import annotations

import os
from pathlib import Path

from desktop.core.common.errors import ModelError
from desktop.core.common.progress import ProgressCallback, no_progress
from desktop.core.engines.base import EngineAdapter
from desktop.core.models.gguf_file import SHARD_NAME, gguf_in_folder, shard_name

GGUF_MAGIC = b"GGUF"
DEMO = "demo"


def detect_format(path: Path) -> str | None:
    """'gguf' for a GGUF file or a folder holding one GGUF model (a Hub cache snapshot of a GGUF repo), 'hf' for a
    folder with config.json, None for anything else."""
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        return "gguf" if gguf_in_folder(path) is not None else None
    if path.is_file():
        with open(path, "rb") as handle:
            return "gguf" if handle.read(4) == GGUF_MAGIC else None
    return None


def resolve_model(spec: str, adapter: EngineAdapter, progress: ProgressCallback = no_progress) -> Path:
    if spec == DEMO:
        from desktop.core.models.demo import ensure_demo_model

        return ensure_demo_model(progress).path_for(adapter.model_format)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(f"model path does not exist: {path}",
                         "give a GGUF file, a Hugging Face model folder, or `demo`")
    fmt = detect_format(path)
    if fmt == "hf" and adapter.model_format == "gguf" and gguf_in_folder(path) is not None:
        fmt = "gguf"  # a GGUF repo that also ships its config.json
    if fmt is None:
        if path.is_dir():
            raise ModelError(f"{path} is not a model folder (no config.json, no .gguf file)",
                             "point at a Hugging Face model folder, a .gguf file or a folder holding one")
        raise ModelError(f"{path} is not a model file (not GGUF)",
                         "pick a .gguf file for llama.cpp, or a Hugging Face folder for vLLM")
    if fmt != adapter.model_format:
        wanted = "a GGUF file" if adapter.model_format == "gguf" else "a Hugging Face model folder (config.json + safetensors)"
        other = "vllm" if fmt == "hf" else "llama.cpp"
        raise ModelError(f"{adapter.display_name} needs {wanted}, but {path.name} is {'GGUF' if fmt == 'gguf' else 'a Hugging Face folder'}",
                         f"use --engine {other} for this model, or `--model demo`")
    if fmt == "gguf":
        file = gguf_in_folder(path) if path.is_dir() else path
        return first_shard(absolute(file or path))
    return absolute(path)


def absolute(path: Path) -> Path:
    """`path` made absolute without following symlinks: a Hub cache snapshot's files are links to blobs named by
    hash, and only the snapshot's names say which shards make a set (llama-server opens the others by name) and
    which repo a model is (`model_label`)."""
    return Path(os.path.abspath(path))


def first_shard(path: Path) -> Path:
    """The file llama-server must be given for a GGUF shard: the first of its set (it opens the others by name).
    Whether the set is whole is the facts' check (`models.gguf_file.read_gguf_model`)."""
    name = SHARD_NAME.match(path.name)
    if name is None or int(name["index"]) == 1:
        return path
    return path.with_name(shard_name(name["stem"], 1, int(name["count"])))


def cache_repo(path: str) -> str | None:
    """The Hub repo (`org/name`) whose cache snapshot holds `path` (`.../models--org--name/snapshots/<sha>/...`)."""
    if "models--" not in path:
        return None
    parts = Path(path).parts
    for index, part in enumerate(parts):
        if part.startswith("models--") and index + 2 < len(parts) and parts[index + 1] == "snapshots":
            return part.removeprefix("models--").replace("--", "/")
    return None


def model_label(model: str) -> str:
    """What a client may see of a model: its name, never its absolute path (that names the user's home folder
    and cache layout, and /v1/models answers any local process and local web page). A Hugging Face cache
    snapshot (`.../models--org--name/snapshots/<sha>[/file]`) shows as `org/name[/file]`."""
    if not model or ("/" not in model and "\\" not in model):
        return model
    parts = Path(model).parts
    for index, part in enumerate(parts):
        if part.startswith("models--") and index + 2 < len(parts) and parts[index + 1] == "snapshots":
            repo = part.removeprefix("models--").replace("--", "/")
            rest = parts[index + 3:]
            return "/".join((repo, *rest))
    return Path(model).name
