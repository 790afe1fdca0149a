"""The standard Hugging Face cache layout, shared with every other HF tool on the machine.

    <cache>/models--org--name/blobs/<etag>            file contents, named by etag (LFS sha256 or git blob sha1)
    <cache>/models--org--name/blobs/<etag>.incomplete our partial download (stable name, so it survives a kill)
    <cache>/models--org--name/snapshots/<commit>/<path> relative symlink to ../../blobs/<etag>
    <cache>/models--org--name/refs/<branch>           the commit a branch pointed at

Files fetched by `hf download`/transformers are reused as-is, and ours are reusable by them.

Every name that goes into a path here (repo id, commit, branch, etag, file name) may come from a server
(HF_ENDPOINT can point anywhere), so each is checked against what the Hub itself allows, and every path is proven
to stay inside the cache before anything is written or deleted: a file named `../../x` is refused, never joined.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path, PurePosixPath

from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

from desktop.core.common.errors import ModelError

_REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")  # the Hub's own rule for names
_HEX_DIGEST = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # git sha1 (commits, small files) or LFS sha256
_REF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _refuse(kind: str, value: object) -> ModelError:
    return ModelError(f"refusing an unsafe {kind} from the Hub: {str(value)[:120]!r}",
                   "the server (HF_ENDPOINT) sent a name that would leave the model cache; use the real Hub "
                   "or a mirror you trust")


def check_repo_id(repo_id: str) -> str:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) and ".." not in p for p in parts):
        raise _refuse("repo id", repo_id)
    return repo_id


def check_digest(kind: str, value: str) -> str:
    """A commit or an etag: 40 or 64 lowercase hex characters, nothing else."""
    if not isinstance(value, str) or not _HEX_DIGEST.fullmatch(value):
        raise _refuse(kind, value)
    return value


def check_revision(revision: str) -> str:
    """A branch, tag or commit name as it goes under refs/: plain segments, no `..`, no leading dot."""
    parts = revision.split("/") if isinstance(revision, str) else [""]
    if not all(_REF_PART.fullmatch(p) and ".." not in p and not p.endswith(".lock") for p in parts):
        raise _refuse("revision", revision)
    return revision


def check_filename(filename: str) -> str:
    """A repo-relative file path: forward slashes, no empty, `.` or `..` segment, no absolute path or drive
    letter, no backslash or control character."""
    if (not isinstance(filename, str) or not filename or len(filename) > 1024 or "\\" in filename
            or any(ord(c) < 32 for c in filename) or PurePosixPath(filename).is_absolute() or re.match(r"[A-Za-z]:", filename)):
        raise _refuse("file name", filename)
    if any(part in ("", ".", "..") for part in filename.split("/")):
        raise _refuse("file name", filename)
    return filename


def inside(root: Path, path: Path, *, follow_last: bool = True) -> Path:
    """`path`, proven to resolve inside `root` (symlinks followed; with follow_last=False not the last one: a
    snapshot pointer is a link into blobs/ by design); refused otherwise."""
    resolved_root = root.resolve()
    resolved = path.resolve() if follow_last else path.parent.resolve() / path.name
    if resolved != resolved_root and not resolved.is_relative_to(resolved_root):
        raise _refuse("path", path)
    return path


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
    root = cache_dir or hf_cache_dir()
    return inside(root, root / repo_folder_name(repo_id=check_repo_id(repo_id), repo_type="model"))


def blob_path(repo_id: str, etag: str, cache_dir: Path | None = None) -> Path:
    storage = storage_folder(repo_id, cache_dir)
    return inside(storage, storage / "blobs" / check_digest("etag", etag))


def incomplete_path(repo_id: str, etag: str, cache_dir: Path | None = None) -> Path:
    storage = storage_folder(repo_id, cache_dir)
    return inside(storage, storage / "blobs" / f"{check_digest('etag', etag)}.incomplete")


def pointer_path(repo_id: str, commit: str, filename: str, cache_dir: Path | None = None) -> Path:
    storage = storage_folder(repo_id, cache_dir)
    snapshot = storage / "snapshots" / check_digest("commit", commit)
    return inside(snapshot, snapshot / Path(*check_filename(filename).split("/")), follow_last=False)


def lock_path(repo_id: str, etag: str, cache_dir: Path | None = None) -> Path:
    """The same lock file huggingface_hub takes, so we never download a blob at the same time as it does."""
    root = cache_dir or hf_cache_dir()
    folder = repo_folder_name(repo_id=check_repo_id(repo_id), repo_type="model")
    return inside(root, root / ".locks" / folder / f"{check_digest('etag', etag)}.lock")


def link_pointer(blob: Path, pointer: Path) -> None:
    """Point snapshots/<commit>/<file> at the blob: relative symlink, or a copy where symlinks are not allowed.
    Both come from the checked builders above."""
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
    storage = storage_folder(repo_id, cache_dir)
    ref = inside(storage / "refs", storage / "refs" / check_revision(revision))
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.exists() or ref.read_text() != commit:
        ref.write_text(commit)
