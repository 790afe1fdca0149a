"""Models on this disk: the HF cache (shared with every HF tool), folders the user added, and single GGUF files.

Each entry is one runnable unit (a GGUF quant with all its shards, or a safetensors folder) with its format,
quantization and size, under a name `switchyard rm` accepts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from desktop.core.common import paths
from desktop.core.common.errors import ModelError
from desktop.core.hub import cache
from desktop.core.hub.variants import RemoteFile, Variant, group_variants
from desktop.core.models.projector import NotVision, projector_beside, read_projector

log = logging.getLogger(__name__)


@dataclass
class LocalModel:
    name: str  # "owner/name:Q4_K_M", "owner/name" (safetensors), or the path of a user-added model
    source: str  # "hf-cache" | "folder" | "file"
    format: str  # "gguf" | "safetensors"
    quantization: str | None
    size_bytes: int
    path: Path  # what to hand the engine: the GGUF (first shard) or the safetensors folder
    files: list[Path] = field(default_factory=list)
    repo_id: str | None = None
    commit: str | None = None
    refs: list[str] = field(default_factory=list)
    shards: int = 1
    projector: Path | None = None  # a vision GGUF's mmproj beside it: the pair is one model that takes images

    @property
    def vision(self) -> bool:
        return self.projector is not None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["path"] = str(self.path)
        out["files"] = [str(p) for p in self.files]
        out["projector"] = str(self.projector) if self.projector else None
        out["vision"] = self.vision
        return out


@dataclass
class DeleteResult:
    name: str
    freed_bytes: int
    removed: list[str]
    forgotten: bool = False  # a user-added path dropped from the list, files left alone

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- user-added paths


def _registry_file() -> Path:
    return paths.data_dir() / "library.json"


def user_paths() -> list[Path]:
    try:
        data = json.loads(_registry_file().read_text())
    except (OSError, ValueError):
        return []
    return [Path(p) for p in data.get("paths", []) if isinstance(p, str)]


def _save_user_paths(items: list[Path]) -> None:
    target = _registry_file()
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps({"paths": [str(p) for p in items]}, indent=2))
    os.replace(tmp, target)


def add_path(path: Path) -> Path:
    """Remember a folder of models or a single GGUF file."""
    path = path.expanduser().resolve()
    if not path.exists():
        raise ModelError(f"{path} does not exist.", "give the path of a .gguf file or of a folder of models")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelError(f"{path} is not a .gguf file.", "add a .gguf file, or the folder holding safetensors")
    items = user_paths()
    if path not in items:
        items.append(path)
        _save_user_paths(items)
    return path


# --------------------------------------------------------------------------- scanning


def _entries(
    variants: list[Variant], root: Path, source: str, base_name: str, **extra: Any
) -> list[LocalModel]:
    out = []
    for v in variants:
        files = [root / f.path for f in v.files]
        primary = root / v.primary_file if v.primary_file else root
        if v.format == "gguf":
            name = f"{base_name}:{v.name}" if source == "hf-cache" else str(primary)
        else:
            name = (f"{base_name}:{v.name}" if v.name != "safetensors" else base_name) if source == "hf-cache" else str(
                primary
            )
        out.append(
            LocalModel(
                name=name,
                source=source,
                format=v.format,
                quantization=v.quantization,
                size_bytes=v.size_bytes,
                path=primary,
                files=files,
                shards=v.shards,
                projector=_seeing(root / v.projector) if v.projector else None,
                **extra,
            )
        )
    return out


def _seeing(projector: Path) -> Path | None:
    """The projector on disk if it gives sight (an audio encoder's does not); an unreadable one still shows, the
    plan says what is wrong with it."""
    try:
        read_projector(projector)
    except NotVision:
        return None
    except ModelError:
        return projector
    return projector


def _config_of(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _scan_hf_cache(cache_dir: Path) -> list[LocalModel]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    out: list[LocalModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        for i, rev in enumerate(revisions):
            files = [
                RemoteFile(str(f.file_path.relative_to(rev.snapshot_path)), f.size_on_disk, "", None)
                for f in rev.files
            ]
            variants, _ = group_variants(files, config=_config_of(rev.snapshot_path))
            base = repo.repo_id if i == 0 else f"{repo.repo_id}@{rev.commit_hash[:8]}"
            out.extend(
                _entries(
                    variants,
                    rev.snapshot_path,
                    "hf-cache",
                    base,
                    repo_id=repo.repo_id,
                    commit=rev.commit_hash,
                    refs=sorted(rev.refs),
                )
            )
    return out


def _scan_user_path(path: Path) -> list[LocalModel]:
    if path.is_file():
        files = [RemoteFile(path.name, path.stat().st_size, "", None)]
        variants, _ = group_variants(files)
        entries = _entries(variants, path.parent, "file", str(path))
        for entry in entries:  # a file added by hand: its projector is the one beside it
            entry.projector = projector_beside(path)
        return entries
    if not path.is_dir():
        return []
    found = [p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in (".gguf", ".safetensors")]
    files = [RemoteFile(str(p.relative_to(path)), p.stat().st_size, "", None) for p in found]
    variants, _ = group_variants(files, config=_config_of(path))
    return _entries(variants, path, "folder", str(path))


def list_local(cache_dir: Path | None = None) -> list[LocalModel]:
    """Everything runnable on disk: HF cache first, then user-added folders and files."""
    models = _scan_hf_cache(cache_dir or cache.hf_cache_dir())
    seen = {m.path.resolve() for m in models}
    for p in user_paths():
        for m in _scan_user_path(p):
            if m.path.resolve() not in seen:
                models.append(m)
                seen.add(m.path.resolve())
    return models


# --------------------------------------------------------------------------- delete


def delete(name: str, *, cache_dir: Path | None = None) -> DeleteResult:
    """Delete a cached model (its snapshot links and the blobs no other snapshot uses), or forget a user path.

    Files the user added from elsewhere are never deleted, only dropped from the list.
    """
    cache_dir = cache_dir or cache.hf_cache_dir()
    models = list_local(cache_dir)
    match = [m for m in models if m.name == name]
    if not match and ":" not in name and "/" in name:  # "owner/name": every variant of the repo
        match = [m for m in models if m.repo_id == name and m.source == "hf-cache"]
    if not match:
        user = [p for p in user_paths() if str(p) == name or str(p) == str(Path(name).expanduser().resolve())]
        if user:
            _save_user_paths([p for p in user_paths() if p not in user])
            return DeleteResult(name, 0, [], forgotten=True)
        known = ", ".join(m.name for m in models[:8]) or "none"
        raise ModelError(f"No local model named {name!r}.", f"see `switchyard models`; known: {known}")
    freed = 0
    removed: list[str] = []
    for m in match:
        if m.source != "hf-cache":
            owner = next((p for p in user_paths() if m.path == p or p in m.path.parents), None)
            if owner is not None:
                _save_user_paths([p for p in user_paths() if p != owner])
            return DeleteResult(name, 0, [], forgotten=True)
        assert m.repo_id is not None
        storage = cache.storage_folder(m.repo_id, cache_dir)
        snapshots, blobs = storage / "snapshots", (storage / "blobs").resolve()
        # the projector goes with the last model that uses it (another quant of the repo may share it)
        shared = {o.projector for o in models if o not in match and o.projector is not None}
        own_projector = [m.projector] if m.projector is not None and m.projector not in shared else []
        for pointer in [*m.files, *own_projector]:
            if not pointer.is_symlink() and not pointer.exists():  # a shared projector another match took
                continue
            if not pointer.absolute().parent.resolve().is_relative_to(snapshots.resolve()):
                raise ModelError(f"refusing to delete {pointer}: it is not inside {snapshots}",
                                 "the model cache was changed by hand; remove that file yourself")
            if pointer.is_symlink():
                blob = pointer.resolve()
                pointer.unlink()  # the link itself, wherever it points
                # only a blob of this repo's own blobs folder is ever deleted, never where a link leads outside
                if blob.parent == blobs and blob.exists() and not _blob_still_used(storage, blob):
                    freed += blob.stat().st_size
                    blob.unlink()
            elif pointer.exists():  # a cache made where symlinks are not allowed holds copies
                freed += pointer.stat().st_size
                pointer.unlink()
            removed.append(str(pointer))
        _prune_empty(storage / "snapshots")
        if not any((storage / "snapshots").glob("*")):
            shutil.rmtree(storage, ignore_errors=True)
            shutil.rmtree(cache_dir / ".locks" / storage.name, ignore_errors=True)
    return DeleteResult(name, freed, removed)


def _blob_still_used(storage: Path, blob: Path) -> bool:
    for p in (storage / "snapshots").rglob("*"):
        if p.is_symlink() and p.resolve() == blob:
            return True
    return False


def _prune_empty(root: Path) -> None:
    if not root.exists():
        return
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except OSError:
            pass
