"""How every page names a model: `org/name:Q4_K_M` for a Hub cache snapshot (the repo and the quantization, never
the snapshot's commit hash), `org/name` for a safetensors snapshot, `demo` for the embedded demo pair (whose
vLLM copy lives in a folder called `hf`), the file's name for anything else. One function, so the Serve page's
notices, its model picker, the Models library and the chat all say the same thing."""

from __future__ import annotations

from pathlib import Path

from desktop.core.models.quant_names import quant_from_name

DEMO_NOTE = "random weights: its answers are noise"
DEMO_LABEL = f"demo ({DEMO_NOTE})"


def is_demo(model: str | Path | None) -> bool:
    """`demo` as typed, or one of the demo pair's own paths."""
    if model is None:
        return False
    if str(model) == "demo":
        return True
    from desktop.core.models.demo import GGUF_NAME, HF_DIR_NAME, default_root

    path = Path(model).expanduser().absolute()
    root = default_root().expanduser().absolute()
    return path in (root / GGUF_NAME, root / HF_DIR_NAME, root)


def display_name(model: str | Path | None) -> str:
    """`model` (as typed or as a plan's path) as people name it: `org/name:QUANT`, `org/name`, `demo`, or the
    file's name. A path inside a Hub cache (`models--org--name/snapshots/<commit>/[sub/]file`) names its repo."""
    if model is None or str(model) == "":
        return ""
    if is_demo(model):
        return "demo"
    text = str(model)
    if "/" not in text and "\\" not in text:
        return text  # a repo-less name as typed
    parts = Path(text).parts
    for index, part in enumerate(parts):
        if part.startswith("models--") and index + 1 < len(parts) and parts[index + 1] == "snapshots":
            repo = part.removeprefix("models--").replace("--", "/")
            rest = parts[index + 3:]  # after the commit
            if not rest:
                return repo
            quant = quant_from_name("/".join(rest))
            return f"{repo}:{quant}" if quant else f"{repo}/{'/'.join(rest)}"
    return Path(text).name


def _snapshot_of(path: Path) -> Path | None:
    """The Hub cache snapshot folder (`.../models--org--name/snapshots/<commit>`) holding `path`, if any."""
    parts = path.parts
    for index, part in enumerate(parts):
        if part.startswith("models--") and index + 2 < len(parts) and parts[index + 1] == "snapshots":
            return Path(*parts[:index + 3])
    return None


def counterpart(model: str, engine: str) -> str | None:
    """The same downloaded model in the format `engine` loads, when `model` is in the other one: a Hub repo that
    ships a GGUF beside its safetensors (both variants pulled into one snapshot) serves on llama.cpp from the
    GGUF and on vLLM from the snapshot folder, so a switch moves between them. None when `model` already suits
    `engine`, is not in a Hub cache snapshot, or the snapshot holds no copy for it (the switch's own check then
    says why)."""
    from desktop.core.engines import get_adapter
    from desktop.core.models.gguf_file import gguf_in_folder

    path = Path(model).expanduser()
    snapshot = _snapshot_of(path)
    if snapshot is None or not path.exists():
        return None
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if get_adapter(engine).model_format == "hf":
        has_weights = any(snapshot.glob("*.safetensors"))
        return str(snapshot) if is_gguf and (snapshot / "config.json").is_file() and has_weights else None
    if is_gguf:
        return None
    from desktop.core.common.errors import ModelError

    try:
        found = gguf_in_folder(snapshot)
    except ModelError:  # several quantizations: which one is the person's to pick
        return None
    return str(found) if found is not None else None
