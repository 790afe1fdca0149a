"""The standard Hugging Face cache layout, shared with every other HF tool on the machine.

    <cache>/models--org--name/blobs/<etag>            file contents, named by etag (LFS sha256 or git blob sha1)
    <cache>/models--org--name/blobs/<etag>.incomplete our partial download (stable name, so it survives a kill)
    <cache>/models--org--name/snapshots/<commit>/<path> relative symlink to ../../blobs/<etag>
    <cache>/models--org--name/refs/<branch>           the commit a branch pointed at

Files fetched by `hf download`/transformers are reused as-is, and ours are reusable by them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name


def hf_cache_dir() -> Path:
    """HF_HUB_CACHE, else HF_HOME/hub, else the library default; read at call time so tests can point it away."""
    if value := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(value).expanduser()
    if value := os.environ.get("HF_HOME"):
        return Path(value).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hf_endpoint() -> str:
    """HF_ENDPOINT (mirrors) read at call time, without a trailing slash."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def storage_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or hf_cache_dir()) / repo_folder_name(repo_id=repo_id, repo_type="model")


def blob_path(repo_id: str, etag: str, cache_dir: Path | None = None) -> Path:
    return storage_folder(repo_id, cache_dir) / "blobs" / etag


def incomplete_path(repo_id: str, etag: str, cache_dir: Path | None = None) -> Path:
    return storage_folder(repo_id, cache_dir) / "blobs" / f"{etag}.incomplete"


def pointer_path(repo_id: str, commit: str, filename: str, cache_dir: Path | None = None) -> Path:
    return storage_folder(repo_id, cache_dir) / "snapshots" / commit / Path(*filename.split("/"))


def lock_path(repo_id: str, etag: str, cache_dir: Path | None = None) -> Path:
    """The same lock file huggingface_hub takes, so we never download a blob at the same time as it does."""
    root = cache_dir or hf_cache_dir()
    return root / ".locks" / repo_folder_name(repo_id=repo_id, repo_type="model") / f"{etag}.lock"


def link_pointer(blob: Path, pointer: Path) -> None:
    """Point snapshots/<commit>/<file> at the blob: relative symlink, or a copy where symlinks are not allowed."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink() or pointer.exists():
        if pointer.resolve() == blob.resolve():
            return
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:
        shutil.copyfile(blob, pointer)


def write_ref(repo_id: str, revision: str, commit: str, cache_dir: Path | None = None) -> None:
    """Record which commit a branch/tag resolved to, like huggingface_hub does (nothing for a commit hash)."""
    if revision == commit:
        return
    ref = storage_folder(repo_id, cache_dir) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.exists() or ref.read_text() != commit:
        ref.write_text(commit)
