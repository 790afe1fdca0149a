"""Download a variant into the standard HF cache: resumable, verified, pausable, and honest about failures.

Why not `hf_hub_download`: huggingface_hub 2.4 writes each download to a process-unique temporary file and deletes
it on any failure, so a killed app or a dropped connection restarts from zero; it has no pause, no cancel, and it
does not check sha256. This module keeps the library's cache layout and lock files (so both share one cache) and
uses HfApi for metadata, but moves the bytes itself (through httpx, with the environment's proxies and their
user:pass@ credentials; every server-supplied name is checked by `cache` before it becomes a path):

- ranged GETs into ``blobs/<etag>.incomplete`` (a stable name: a rerun after kill -9 continues from its size);
- the sha256 from the Hub's LFS metadata (git blob sha1 for small files) is computed over the partial bytes and
  the rest as they arrive; a file whose digest differs is discarded and never becomes ``blobs/<etag>``;
- retries with exponential backoff on network errors, 5xx/429, and stalls (no byte for ``stall_timeout`` s);
- a free-disk check before starting and a clear error on ENOSPC, keeping the partial bytes for later;
- a sharded set is one unit: snapshot links appear only once every shard has verified.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import queue
import random
import shutil
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from desktop.core.common.errors import ModelError, SwitchyardError
from desktop.core.hub import cache

# DownloadProgress and FileProgress live in hub.progress; re-exported here, where callers import them
from desktop.core.hub.progress import DownloadProgress as DownloadProgress
from desktop.core.hub.progress import FileProgress as FileProgress
from desktop.core.hub.progress import ProgressBook, ProgressCallback
from desktop.core.hub.search import gated_message, repo_listing
from desktop.core.hub.tokens import get_token, redact
from desktop.core.hub.variants import (
    FitTagger,
    RemoteFile,
    Variant,
    default_tagger,
    group_variants,
    quality_here,
)
from desktop.core.hub.variants import tag_and_recommend as _tag

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20
HASH_BLOCK = 8 << 20
_SIDE_FILES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py", ".md")


class DownloadCancelled(SwitchyardError):
    """The user cancelled; partial files are kept so a later pull resumes."""

    exit_code = 130


class ChecksumMismatch(SwitchyardError):
    """The bytes received do not match the Hub's digest, even after downloading them again."""


class DiskFull(SwitchyardError):
    """Not enough free space, before starting or while writing."""


class _Retryable(Exception):
    """A transient failure: reconnect (with Range) after a backoff."""


class _Paused(Exception):
    pass


@dataclass
class RetryPolicy:
    attempts: int = 8  # consecutive failed attempts without a byte of progress
    base_delay: float = 0.5
    max_delay: float = 30.0
    stall_timeout: float = 30.0  # seconds without a byte before the connection is dropped and resumed
    connect_timeout: float = 15.0

    def delay(self, failures: int) -> float:
        raw = min(self.max_delay, self.base_delay * (2 ** max(0, failures - 1)))
        return float(raw * (0.75 + random.random() * 0.5))  # noqa: S311 - jitter, not crypto


class DownloadControl:
    """Pause, resume and cancel from any thread (the GUI's buttons, Ctrl-C in the CLI)."""

    def __init__(self) -> None:
        self._running = threading.Event()
        self._running.set()
        self._cancelled = threading.Event()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def cancel(self) -> None:
        self._cancelled.set()
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        """Called between chunks: raise to stop the transfer when cancelled or paused."""
        if self._cancelled.is_set():
            raise DownloadCancelled("Download cancelled.", "run the same pull again to resume")
        if not self._running.is_set():
            raise _Paused

    def wait_while_paused(self) -> None:
        self._running.wait()
        if self._cancelled.is_set():
            raise DownloadCancelled("Download cancelled.", "run the same pull again to resume")

    def sleep(self, seconds: float) -> None:
        """A backoff that a cancel cuts short."""
        if self._cancelled.wait(seconds):
            raise DownloadCancelled("Download cancelled.", "run the same pull again to resume")


class FreeBytes(Protocol):
    def __call__(self, path: Path) -> int: ...


def disk_free(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return int(shutil.disk_usage(probe).free)


@dataclass
class PullResult:
    repo_id: str
    revision: str
    commit: str
    variant: str | None
    path: Path  # what to hand the engine: the GGUF file (first shard) or the safetensors folder
    files: list[Path]
    total_bytes: int
    downloaded_bytes: int
    reused_bytes: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["path"] = str(self.path)
        out["files"] = [str(p) for p in self.files]
        return out


# --------------------------------------------------------------------------- selection


@dataclass
class Selection:
    repo_id: str
    revision: str
    commit: str
    variant: str | None
    files: list[RemoteFile]
    primary: str  # repo-relative path handed to the engine ("" = repo root folder)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``owner/name[:QUANT|:FILE]`` -> (repo_id, selector)."""
    repo_id, _, selector = spec.strip().partition(":")
    return repo_id, (selector or None)


def select(
    spec: str, revision: str | None = None, *, tagger: FitTagger | None = None, api: Any = None
) -> Selection:
    """Resolve what `pull` fetches: a quant, a file (with the rest of its shard set), or the recommended variant."""
    repo_id, selector = parse_spec(spec)
    listing = repo_listing(repo_id, revision, api=api)
    variants, _ = group_variants(
        listing.files, config=listing.config, tags=listing.tags, safetensors_params=listing.safetensors_params
    )
    by_path = {f.path: f for f in listing.files}
    chosen: Variant | None = None
    if selector:
        lowered = selector.lower()
        chosen = next((v for v in variants if v.name.lower() == lowered), None)
        chosen = chosen or next((v for v in variants if (v.quantization or "").lower() == lowered), None)
        chosen = chosen or next((v for v in variants if any(f.path == selector for f in v.files)), None)
        if chosen is None and selector in by_path:  # a plain file (config.json, a .bin ...)
            f = by_path[selector]
            return Selection(listing.repo_id, revision or "main", listing.commit, None, [f], f.path)
        if chosen is None:
            names = ", ".join(v.name for v in variants) or "none"
            raise ModelError(
                f"{repo_id} has no variant or file {selector!r}.",
                f"pick one of: {names} (see `switchyard variants {repo_id}`)",
            )
    elif len(variants) == 1:
        chosen = variants[0]
    elif variants:
        measured, budget = quality_here(listing.repo_id)
        _tag(variants, tagger or default_tagger(), listing.config, measured, budget, listing.repo_id)
        chosen = next((v for v in variants if v.recommended), None)
        if chosen is None:
            raise ModelError(
                f"No variant of {repo_id} fits this machine.",
                f"name one explicitly, e.g. `switchyard pull {repo_id}:{variants[0].name}`",
            )
    else:
        raise ModelError(f"{repo_id} has no GGUF or safetensors weights.", "pick another repo")
    files = list(chosen.files)
    if chosen.projector and chosen.projector in by_path:  # a vision GGUF sees only with its projector beside it
        files.append(by_path[chosen.projector])
    if chosen.format == "safetensors":
        folder = chosen.primary_file
        prefix = f"{folder}/" if folder else ""
        for f in listing.files:
            rest = f.path[len(prefix) :] if f.path.startswith(prefix) else None
            if rest is not None and "/" not in rest and f.path.lower().endswith(_SIDE_FILES) and f not in files:
                files.append(f)
    return Selection(listing.repo_id, revision or "main", listing.commit, chosen.name, files, chosen.primary_file)


# --------------------------------------------------------------------------- transfer


class _HashingWriter:
    """Writes on one helper thread and hashes on another, so the socket keeps draining while both run
    (file writes and hashlib release the GIL; sha256 alone is about as fast as a loopback socket).

    After `close()` without a write error, `written` bytes are on disk and the digest covers exactly them, so
    the file can be resumed from `written` without re-reading it. A write error is fatal for this attempt.
    """

    def __init__(self, fh: Any, hasher: Any, on_written: Callable[[int], None]) -> None:
        self._fh = fh
        self._hasher = hasher
        self._on_written = on_written
        self._writes: queue.Queue[memoryview | None] = queue.Queue(maxsize=32)
        self._hashes: queue.Queue[memoryview | None] = queue.Queue(maxsize=32)
        self.written = 0
        self.error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._write_loop, name="hub-writer", daemon=True),
            threading.Thread(target=self._hash_loop, name="hub-hasher", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _write_loop(self) -> None:
        while (block := self._writes.get()) is not None:
            if self.error is not None:
                continue
            try:
                self._fh.write(block)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader thread
                self.error = exc
                continue
            self.written += len(block)
            self._on_written(len(block))

    def _hash_loop(self) -> None:
        while (block := self._hashes.get()) is not None:
            self._hasher.update(block)

    def put(self, block: memoryview) -> None:
        if self.error is not None:
            raise self.error
        self._hashes.put(block)
        self._writes.put(block)

    def close(self) -> None:
        self._writes.put(None)
        self._hashes.put(None)
        for t in self._threads:
            t.join()
        self._fh.flush()


def _new_hasher(f: RemoteFile) -> Any:
    if f.sha256:
        return hashlib.sha256()
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % f.size)
    return h


@dataclass
class _PartState:
    """The partial file's size and the running digest of exactly those bytes."""

    hasher: Any
    have: int

    def restart(self, f: RemoteFile) -> None:
        self.hasher = _new_hasher(f)
        self.have = 0


def _expected_digest(f: RemoteFile) -> str:
    return f.sha256 or f.blob_id


class _Transfer:
    """Downloads a list of files of one commit into the cache, reporting aggregated progress."""

    def __init__(
        self,
        selection: Selection,
        *,
        cache_dir: Path,
        token: str | None,
        policy: RetryPolicy,
        control: DownloadControl,
        on_progress: ProgressCallback | None,
        workers: int,
    ) -> None:
        self.sel = selection
        self.cache_dir = cache_dir
        self.token = token
        self.policy = policy
        self.control = control
        self.workers = max(1, workers)
        self.endpoint = cache.hf_endpoint()
        self.progress = ProgressBook(selection.repo_id, selection.variant, selection.files, on_progress)
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._client: httpx.Client | None = None

    # ------------------------------------------------------------- http
    def _url(self, f: RemoteFile) -> str:
        return (
            f"{self.endpoint}/{self.sel.repo_id}/resolve/{quote(self.sel.commit, safe='')}/"
            f"{quote(f.path, safe='/')}"
        )

    def _client_for_thread(self) -> httpx.Client:
        """The transfer's HTTP client: proxies from the environment (HTTP(S)_PROXY, ALL_PROXY, NO_PROXY, with
        user:pass@ credentials), redirects followed with the token dropped when they leave the Hub's host, a
        connect timeout, and a read timeout that is the stall timeout (data may come slowly, never silently)."""
        with self._lock:
            if self._client is None:
                timeout = httpx.Timeout(self.policy.connect_timeout, read=self.policy.stall_timeout)
                self._client = httpx.Client(
                    trust_env=True, follow_redirects=True, max_redirects=6, timeout=timeout,
                    limits=httpx.Limits(max_connections=self.workers * 2, max_keepalive_connections=self.workers),
                    headers={"User-Agent": "switchyard (huggingface_hub-compatible cache)",
                             "Accept-Encoding": "identity"},
                )
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _open(self, f: RemoteFile, start: int) -> httpx.Response:
        """GET with Range (a streamed response the caller closes); the token goes to the Hub's own host only."""
        headers = {"Range": f"bytes={start}-"} if start > 0 else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        client = self._client_for_thread()
        try:
            return client.send(client.build_request("GET", self._url(f), headers=headers), stream=True)
        except httpx.TooManyRedirects:
            raise _Retryable("too many redirects") from None
        except (httpx.TransportError, OSError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None

    # ------------------------------------------------------------- one file
    def fetch(self, f: RemoteFile) -> Path:
        from huggingface_hub.utils import WeakFileLock  # type: ignore[attr-defined]

        blob = cache.blob_path(self.sel.repo_id, f.etag, self.cache_dir)
        lock = cache.lock_path(self.sel.repo_id, f.etag, self.cache_dir)
        lock.parent.mkdir(parents=True, exist_ok=True)
        blob.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):
            if blob.exists() and blob.stat().st_size == f.size:
                self.progress.reuse(f.path, f.size)
                self.progress.set_state(f.path, "reused", f"{f.path}: already in the cache")
                return blob
            restarted = False
            while True:
                try:
                    digest = self._download_to_partial(f)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise self._disk_full(f) from None
                    raise
                if digest == _expected_digest(f):
                    break
                part = cache.incomplete_path(self.sel.repo_id, f.etag, self.cache_dir)
                part.unlink(missing_ok=True)
                self.progress.set_done(f.path, 0)
                if restarted:
                    self.progress.set_state(f.path, "failed", f"{f.path}: checksum mismatch", "checksum mismatch")
                    raise ChecksumMismatch(
                        f"{f.path} from {self.sel.repo_id} failed its sha256 check twice "
                        f"(expected {_expected_digest(f)[:16]}…, got {digest[:16]}…); nothing was kept.",
                        "the server or a proxy is sending wrong bytes: retry later or try another HF_ENDPOINT",
                    )
                log.warning("checksum mismatch for %s; downloading it again from the start", f.path)
                self.progress.set_state(f.path, "retrying", f"{f.path}: checksum mismatch, downloading again")
                restarted = True
            part = cache.incomplete_path(self.sel.repo_id, f.etag, self.cache_dir)
            with _open_part(part) as fh:
                if hasattr(os, "fchmod"):  # the mode of a finished blob, set through the file we checked
                    os.fchmod(fh.fileno(), 0o644)
            os.replace(part, blob)
        self.progress.set_state(f.path, "complete", f"{f.path}: verified")
        return blob

    def _download_to_partial(self, f: RemoteFile) -> str:
        """Bring blobs/<etag>.incomplete to full size, retrying; return the hex digest of its bytes."""
        part = cache.incomplete_path(self.sel.repo_id, f.etag, self.cache_dir)
        with _open_part(part) as fh:
            state = _PartState(_new_hasher(f), os.fstat(fh.fileno()).st_size)
        if state.have > f.size:
            state.have = 0
        if state.have:
            self.progress.set_state(f.path, "verifying", f"{f.path}: checking {state.have} bytes already here")
            with _open_part(part) as fh:
                left = state.have
                while left and (block := fh.read(min(HASH_BLOCK, left))):
                    state.hasher.update(block)
                    left -= len(block)
        self.progress.set_done(f.path, state.have)
        failures = 0
        while state.have < f.size:
            if self._abort.is_set():
                raise DownloadCancelled("Stopped because another file of the set failed.")
            self.control.wait_while_paused()
            before = state.have
            self.progress.set_state(f.path, "downloading", f"{f.path}: from byte {state.have}")
            try:
                self._transfer(f, part, state)
            except _Paused:
                self.progress.set_state(f.path, "paused", f"{f.path}: paused at byte {state.have}")
                continue
            except _Retryable as exc:
                failures = 0 if state.have > before else failures + 1
                self.progress.count_attempt(f.path)
                reason = redact(str(exc), self.token)
                if failures >= self.policy.attempts:
                    self.progress.set_state(f.path, "failed", f"{f.path}: {reason}", reason)
                    raise SwitchyardError(
                        f"Downloading {f.path} from {self.sel.repo_id} failed {failures} times in a row: {reason}.",
                        f"{state.have} of {f.size} bytes are kept; run the same pull again to resume",
                    ) from None
                delay = self.policy.delay(max(failures, 1))
                self.progress.set_state(f.path, "retrying", f"{f.path}: {reason}; retrying in {delay:.1f}s", reason)
                self.control.sleep(delay)
        self.progress.set_state(f.path, "verifying", f"{f.path}: verifying")
        return str(state.hasher.hexdigest())

    def _transfer(self, f: RemoteFile, part: Path, state: _PartState) -> None:
        """Append one connection's worth of bytes at `state.have`. Raises _Retryable on transient failures."""
        self.control.check()
        resp = self._open(f, state.have)
        try:
            status = resp.status_code
            if status in (401, 403):
                raise gated_message(self.sel.repo_id, self.token is not None)
            if status == 404:
                raise ModelError(f"{f.path} is no longer in {self.sel.repo_id}@{self.sel.commit[:8]}.")
            if status == 416 and state.have > 0:
                state.restart(f)
                raise _Retryable("range not satisfiable; restarting the file")
            if status in (408, 429) or status >= 500:
                raise _Retryable(f"HTTP {status}")
            if status not in (200, 206):
                raise SwitchyardError(f"Unexpected HTTP {status} for {f.path}.", "retry later")
            if state.have > 0 and status == 200:
                log.info("server ignored Range for %s; starting over", f.path)
                state.restart(f)
                self.progress.set_done(f.path, 0)
            elif status == 206:
                content_range = resp.headers.get("Content-Range") or ""
                if not content_range.startswith(f"bytes {state.have}-"):
                    raise _Retryable(f"server answered range {content_range!r} for bytes={state.have}-")
            with _open_part(part) as fh:
                fh.seek(state.have)
                fh.truncate()
                writer = _HashingWriter(fh, state.hasher, lambda n: self.progress.advance(f.path, n))
                try:
                    self._pump(resp, writer, f.size - state.have)
                finally:
                    writer.close()
                    state.have += writer.written
                    fh.truncate(state.have)
                if writer.error is not None:
                    raise writer.error
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full(f) from None
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        finally:
            resp.close()

    def _disk_full(self, f: RemoteFile) -> DiskFull:
        self.progress.set_state(f.path, "failed", f"{f.path}: disk full", "disk full")
        return DiskFull(
            f"The disk filled up while writing {f.path} into {self.cache_dir}.",
            "free some space (or set HF_HUB_CACHE to a bigger disk) and run the same pull again: "
            "it resumes from the bytes already written",
        )

    def _pump(self, resp: httpx.Response, writer: _HashingWriter, remaining: int) -> None:
        # iter_raw yields each network read as it arrives, so bytes that came before a stall are never lost
        chunks = resp.iter_raw()
        while remaining > 0:
            self.control.check()
            if self._abort.is_set():
                raise DownloadCancelled("Stopped because another file of the set failed.")
            try:
                block = next(chunks, b"")
            except httpx.ReadTimeout:
                raise _Retryable(f"stalled: no data for {self.policy.stall_timeout:g}s") from None
            except httpx.TransportError as exc:
                raise _Retryable(f"{type(exc).__name__}: {exc}") from None
            if not block:
                raise _Retryable("connection closed mid-file")
            block = block[:remaining]
            writer.put(memoryview(block))
            remaining -= len(block)

    # ------------------------------------------------------------- whole set
    def run(self) -> list[Path]:
        try:
            return self._run()
        finally:
            self.close()

    def _run(self) -> list[Path]:
        self.progress.emit("downloading", f"{self.sel.repo_id}: starting", force=True)
        paths: dict[str, Path] = {}
        errors: list[BaseException] = []
        if self.workers == 1 or len(self.sel.files) == 1:
            for f in self.sel.files:
                paths[f.path] = self.fetch(f)
        else:
            with ThreadPoolExecutor(max_workers=min(self.workers, len(self.sel.files))) as pool:
                futures = {pool.submit(self._fetch_guarded, f, errors): f for f in self.sel.files}
                for future, f in futures.items():
                    result = future.result()
                    if result is not None:
                        paths[f.path] = result
            if errors:
                real = [e for e in errors if not isinstance(e, DownloadCancelled)] or errors
                raise real[0]
        return [paths[f.path] for f in self.sel.files]

    def _fetch_guarded(self, f: RemoteFile, errors: list[BaseException]) -> Path | None:
        try:
            return self.fetch(f)
        except BaseException as exc:
            errors.append(exc)
            self._abort.set()
            return None


def check_free_space(selection: Selection, cache_dir: Path, free_bytes: FreeBytes = disk_free) -> int:
    """Raise DiskFull unless the bytes still missing (+5%, at most 256 MiB, of headroom) fit; return them."""
    missing = 0
    for f in selection.files:
        if cache.blob_path(selection.repo_id, f.etag, cache_dir).exists():
            continue
        part = cache.incomplete_path(selection.repo_id, f.etag, cache_dir)
        have = part.stat().st_size if part.exists() else 0
        missing += max(0, f.size - have)
    headroom = min(256 << 20, missing // 20)
    target = cache.storage_folder(selection.repo_id, cache_dir)
    free = free_bytes(target)
    if missing + headroom > free:
        raise DiskFull(
            f"Not enough disk space for {selection.repo_id}:{selection.variant or selection.primary}: "
            f"{_human(missing)} to download, {_human(free)} free under {cache_dir}.",
            "free some space, or set HF_HUB_CACHE to a folder on a bigger disk",
        )
    return missing


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def pull(
    spec: str,
    *,
    revision: str | None = None,
    cache_dir: Path | None = None,
    on_progress: ProgressCallback | None = None,
    control: DownloadControl | None = None,
    policy: RetryPolicy | None = None,
    tagger: FitTagger | None = None,
    free_bytes: FreeBytes = disk_free,
    workers: int = 4,
) -> PullResult:
    """Download ``owner/name[:QUANT|:FILE]`` into the HF cache and return where it landed.

    Already-complete blobs are reused; partial ones continue from their size. Progress goes to `on_progress`.
    """
    started = time.monotonic()
    cache_dir = cache_dir or cache.hf_cache_dir()
    selection = select(spec, revision, tagger=tagger)
    check_free_space(selection, cache_dir, free_bytes)
    transfer = _Transfer(
        selection,
        cache_dir=cache_dir,
        token=get_token(),
        policy=policy or RetryPolicy(),
        control=control or DownloadControl(),
        on_progress=on_progress,
        workers=workers,
    )
    try:
        blobs = transfer.run()
    except DownloadCancelled:
        transfer.progress.emit("cancelled", f"{selection.repo_id}: cancelled (partial files kept)", force=True)
        raise
    except SwitchyardError as exc:
        transfer.progress.emit("failed", exc.message, force=True)
        raise
    # Every file verified: only now does the set appear in the snapshot (a sharded set is one unit).
    pointers = []
    for f, blob in zip(selection.files, blobs, strict=True):
        pointer = cache.pointer_path(selection.repo_id, selection.commit, f.path, cache_dir)
        cache.link_pointer(blob, pointer)
        pointers.append(pointer)
    cache.write_ref(selection.repo_id, selection.revision, selection.commit, cache_dir)
    snapshot = cache.storage_folder(selection.repo_id, cache_dir) / "snapshots" / selection.commit
    primary = snapshot / Path(*selection.primary.split("/")) if selection.primary else snapshot
    transfer.progress.emit("complete", f"{selection.repo_id}: done -> {primary}", force=True)
    return PullResult(
        repo_id=selection.repo_id,
        revision=selection.revision,
        commit=selection.commit,
        variant=selection.variant,
        path=primary,
        files=pointers,
        total_bytes=sum(f.size for f in selection.files),
        downloaded_bytes=transfer.progress.downloaded,
        reused_bytes=transfer.progress.reused,
        seconds=time.monotonic() - started,
    )


def _open_part(part: Path) -> io.BufferedRandom:
    """Open (creating it) a partial download for reading and writing, never through a symlink: in a shared HF
    cache another user could plant `blobs/<etag>.incomplete -> ~victim/.bashrc`, and resuming would truncate and
    overwrite the target. Anything but a regular file is refused with the way out."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | \
        getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(part, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SwitchyardError(f"the partial download {part} is a symbolic link; refusing to write through it",
                                  "remove that link (someone else may have planted it in a shared cache)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SwitchyardError(f"the partial download {part} is not a regular file", "remove it and pull again")
    return os.fdopen(fd, "r+b")
