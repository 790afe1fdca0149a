"""The library as the Models page's "On this machine" table shows it: one row per runnable model, named as people
name it (`org/name:Q4_K_M`, `demo`), with the engine that serves its format, what the Serve form takes to serve
it, and how much disk a Delete would free. Qt-free, so the page stays a table over these rows."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from desktop.core.hub import cache
from desktop.core.hub.library import LocalModel, list_local
from desktop.core.hub.names import DEMO_NOTE, display_name

ENGINE_LABELS = {"llama.cpp": "llama.cpp", "vllm": "vLLM"}
USER_PATH_NOTE = "added by you: Delete forgets it, its files stay"
DEMO_CANNOT_DELETE = "The demo model is built into Switchyard and generated again on use: there is nothing to delete."


class LibraryRow(TypedDict):
    name: str  # as shown: "org/name:Q4_K_M", "demo (llama.cpp)", a user file's name
    format: str  # "gguf" | "safetensors"
    quantization: str
    size_bytes: int
    engine: str  # the engine that serves this format: "llama.cpp" | "vllm"
    notes: str
    path: str
    serve_model: str  # what the Serve form takes: the path, or "demo"
    delete_name: str | None  # what hub.delete takes; None: nothing to delete (the demo)
    forget_only: bool  # a path the user added: Delete drops it from the list, its files stay
    freed_bytes: int  # disk a Delete frees now


def engine_for(path: str | Path) -> str:
    """The engine that loads this model: a GGUF file → llama.cpp, a safetensors folder → vLLM."""
    return "llama.cpp" if str(path).lower().endswith(".gguf") else "vllm"


def _normal(path: Path) -> Path:
    """One spelling per cache entry (the scanner may resolve the cache folder, a caller may not)."""
    return path.parent.resolve() / path.name


def freed_bytes(model: LocalModel, cache_dir: Path | None = None) -> int:
    """The bytes hub.delete(model.name) frees: the blobs only this model's snapshot links use (a blob another
    snapshot or variant also links stays), or the copies in a cache made without symlinks. A path the user added
    is only forgotten: 0."""
    if model.source != "hf-cache" or model.repo_id is None:
        return 0
    storage = cache.storage_folder(model.repo_id, cache_dir or cache.hf_cache_dir())
    blobs = (storage / "blobs").resolve()
    own = {_normal(p) for p in model.files}
    linked_elsewhere = {p.resolve() for p in (storage / "snapshots").rglob("*")
                        if p.is_symlink() and _normal(p) not in own}
    counted: set[Path] = set()
    total = 0
    for pointer in model.files:
        if pointer.is_symlink():
            blob = pointer.resolve()
            if blob.parent == blobs and blob.exists() and blob not in linked_elsewhere and blob not in counted:
                counted.add(blob)
                total += blob.stat().st_size
        elif pointer.exists():
            total += pointer.stat().st_size
    return total


def _demo_rows() -> list[LibraryRow]:
    from desktop.core.models.demo import ensure_demo_model

    demo = ensure_demo_model()
    rows: list[LibraryRow] = []
    for engine, fmt, path, weights in (("llama.cpp", "gguf", demo.gguf_path, demo.gguf_path),
                                       ("vllm", "safetensors", demo.hf_dir, demo.hf_dir / "model.safetensors")):
        rows.append(LibraryRow(name=f"demo ({ENGINE_LABELS[engine]})", format=fmt, quantization="F32",
                               size_bytes=weights.stat().st_size, engine=engine, notes=DEMO_NOTE, path=str(path),
                               serve_model="demo", delete_name=None, forget_only=False, freed_bytes=0))
    return rows


def _row(model: LocalModel, cache_dir: Path | None) -> LibraryRow:
    in_cache = model.source == "hf-cache"
    notes = USER_PATH_NOTE if not in_cache else ("an older revision" if "@" in model.name else "")
    if model.projector is not None:  # the pair is one model that takes images
        notes = "; ".join(filter(None, [f"sees images ({model.projector.name})", notes]))
    return LibraryRow(
        name=model.name if in_cache else display_name(model.path),
        format=model.format, quantization=model.quantization or "", size_bytes=model.size_bytes,
        engine="llama.cpp" if model.format == "gguf" else "vllm", notes=notes, path=str(model.path),
        serve_model=str(model.path), delete_name=model.name, forget_only=not in_cache,
        freed_bytes=freed_bytes(model, cache_dir))


def library_rows(cache_dir: Path | None = None) -> list[LibraryRow]:
    """The embedded demo pair (always there) and then every model on disk (hub.list_local's order)."""
    return _demo_rows() + [_row(m, cache_dir) for m in list_local(cache_dir)]


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def delete_question(row: LibraryRow) -> str:
    """What the confirmation says before a Delete: the disk it frees, or that a user's path is only forgotten."""
    if row["forget_only"]:
        return (f"Forget {row['name']}?\n\nIt was added from {row['path']}; Switchyard drops it from this list and "
                "leaves its files where they are (nothing is deleted, no disk is freed).")
    freed = row["freed_bytes"]
    exact = f" ({freed:,} bytes)" if freed >= 1024 else ""
    return (f"Delete {row['name']} from the Hugging Face cache?\n\nThis frees {human_bytes(freed)}{exact} of disk. "
            "Files another downloaded model also uses are kept. Downloading it again takes as long as the first "
            "time.")
