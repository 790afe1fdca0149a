"""Official llama.cpp release assets: look them up, download them resumably, verify their sha256, unpack them.

The checksum comes from the release API itself: GitHub has exposed a `digest` ("sha256:<hex>") for every
release asset since June 2025. An asset without one is only accepted when PINNED_SHA256 knows it, and an asset
whose bytes do not match is refused (the partial file is deleted, nothing is installed): a mismatch means a
corrupted or tampered download, never something to retry around silently.

Downloads go to `<name>.part` and resume with an HTTP Range request after an interruption (in the same call,
a few times, and again on the next call). The installer unpacks into a staging folder, moves the result into
place and writes the ready marker last, so a failure at any point leaves no install that looks ready.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import shutil
import tarfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent
from desktop.core.engines.runtimes import BuildChoice, release_api_base, server_binary_name

log = logging.getLogger("switchyard.engines.release")

ATTEMPTS = 3
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# sha256 of assets whose release listing carries no digest (older releases); name -> hex. Empty while the pinned
# build's listing has digests.
PINNED_SHA256: dict[str, str] = {}


@dataclass(frozen=True)
class RemoteAsset:
    name: str
    url: str
    sha256: str
    size: int | None = None


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_client(url: str) -> httpx.Client:
    """An HTTP client for the release server: proxies from the environment for the internet, none for loopback."""
    return httpx.Client(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S), follow_redirects=True,
                        trust_env=not _is_loopback(url), headers={"User-Agent": "switchyard"})


def lookup(tag: str, names: Iterable[str], client: httpx.Client, base: str | None = None) -> list[RemoteAsset]:
    """The download URL and sha256 of each named asset of release `tag`, from the release API."""
    api = f"{(base or release_api_base()).rstrip('/')}/tags/{tag}"
    try:
        response = client.get(api, headers={"Accept": "application/vnd.github+json"})
    except httpx.HTTPError as exc:
        raise SwitchyardError(f"cannot reach the llama.cpp release server {api}: {exc}",
                              "check the network, or build from source: --source source") from exc
    if response.status_code == 404:
        raise SwitchyardError(f"llama.cpp release {tag} was not found at {api}",
                              "build from source instead: --source source")
    if response.status_code != 200:
        raise SwitchyardError(f"the llama.cpp release server answered HTTP {response.status_code} for {api}",
                              "try again later, or build from source: --source source")
    try:
        listing: Any = response.json()
        by_name = {str(a["name"]): a for a in listing.get("assets", [])}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SwitchyardError(f"{api} did not return a release listing", "check SWITCHYARD_LLAMACPP_RELEASES") from exc
    found: list[RemoteAsset] = []
    for name in names:
        item = by_name.get(name)
        if item is None:
            raise SwitchyardError(f"llama.cpp release {tag} has no asset {name}",
                                  "build from source instead: --source source")
        digest = str(item.get("digest") or "")
        sha = digest.removeprefix("sha256:").lower() if digest.startswith("sha256:") else PINNED_SHA256.get(name, "")
        if len(sha) != 64:
            raise SwitchyardError(f"no sha256 is known for {name}, so it cannot be verified and is not installed",
                                  "build from source instead: --source source")
        size = item.get("size")
        found.append(RemoteAsset(name, str(item["browser_download_url"]), sha, int(size) if size else None))
    return found


def _hash_file(path: Path) -> Any:
    hasher = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            hasher.update(block)
    return hasher


class _Interrupted(Exception):
    """The connection ended before the whole file arrived; the bytes so far are kept in the .part file."""


def download(asset: RemoteAsset, directory: Path, progress: ProgressCallback, client: httpx.Client,
             attempts: int = ATTEMPTS) -> Path:
    """Download `asset` into `directory`, resuming a `.part` left by an earlier attempt; verify its sha256.

    Returns the verified file. A wrong checksum deletes the partial file and raises: nothing is kept that failed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / asset.name
    if final.exists() and _hash_file(final).hexdigest() == asset.sha256:
        return final
    part = directory / (asset.name + ".part")
    for attempt in range(1, attempts + 1):
        try:
            _transfer(asset, part, progress, client)
            break
        except _Interrupted as exc:
            have = part.stat().st_size if part.exists() else 0
            if attempt == attempts:
                raise SwitchyardError(
                    f"the download of {asset.name} was interrupted ({exc}); {have} bytes are kept",
                    "run the same command again: it resumes where it stopped") from None
            progress(ProgressEvent(f"{asset.name}: {exc}; resuming at byte {have}"))
    got = _hash_file(part).hexdigest()
    if got != asset.sha256:
        part.unlink(missing_ok=True)
        raise SwitchyardError(
            f"{asset.name} failed its sha256 check (expected {asset.sha256[:16]}…, got {got[:16]}…); "
            "nothing was installed",
            "the download was corrupted or altered: run the install again, or build from source with --source source")
    os.replace(part, final)
    return final


def _transfer(asset: RemoteAsset, part: Path, progress: ProgressCallback, client: httpx.Client) -> None:
    """One connection: append to `part` from its current size (Range), or start over if the server ignores it."""
    have = part.stat().st_size if part.exists() else 0
    if asset.size is not None and have > asset.size:
        part.unlink()
        have = 0
    if asset.size is not None and have == asset.size:
        return  # complete already: the checksum decides
    # Identity encoding: the bytes on disk are the bytes of the file, so a Range offset means the same on both ends.
    headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
    try:
        with client.stream("GET", asset.url, headers=headers) as response:
            if response.status_code == 416 and have:
                part.unlink()  # the server has fewer bytes than we kept: not the same file
                raise _Interrupted("range not satisfiable; starting over")
            if response.status_code == 404:
                raise SwitchyardError(f"{asset.url} was not found (HTTP 404)", "build from source: --source source")
            if response.status_code not in (200, 206):
                if response.status_code >= 500 or response.status_code in (408, 429):
                    raise _Interrupted(f"HTTP {response.status_code}")
                raise SwitchyardError(f"downloading {asset.name} failed: HTTP {response.status_code}",
                                      "try again later, or build from source: --source source")
            if response.status_code == 206:
                content_range = response.headers.get("Content-Range", "")
                if not content_range.startswith(f"bytes {have}-"):
                    part.unlink(missing_ok=True)
                    raise _Interrupted(f"server answered range {content_range!r} for bytes={have}-; starting over")
            else:
                have = 0  # a 200 is the whole file from the start
            total = asset.size or (have + int(response.headers.get("Content-Length", 0) or 0)) or None
            with open(part, "ab" if have else "wb") as fh:
                last_tenth = -1
                for block in response.iter_raw():  # as it arrives: nothing held back if the connection drops
                    fh.write(block)
                    have += len(block)
                    if total:
                        tenth = int(10 * have / total)
                        if tenth != last_tenth:
                            last_tenth = tenth
                            progress(ProgressEvent(f"downloading {asset.name}: {have >> 20} of {total >> 20} MiB",
                                                   min(1.0, have / total)))
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise _Interrupted(f"{type(exc).__name__}: {exc}") from None
    if asset.size is not None and have < asset.size:
        raise _Interrupted(f"connection closed after {have} of {asset.size} bytes")


def unpack(archive: Path, destination: Path) -> None:
    """Unpack a release archive (zip or tar.gz) into `destination`, refusing paths that leave it."""
    destination.mkdir(parents=True, exist_ok=True)
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                root = destination.resolve()
                for member in zf.infolist():
                    target = (destination / member.filename).resolve()
                    if not target.is_relative_to(root):
                        raise SwitchyardError(f"{archive.name} contains a path outside its folder: {member.filename}")
                    zf.extract(member, destination)
                    mode = (member.external_attr >> 16) & 0o777
                    if mode and not member.is_dir():
                        target.chmod(mode)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(destination, filter="data")
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        raise SwitchyardError(f"{archive.name} is not a readable archive: {exc}",
                              "run the install again to download it afresh") from exc


def locate_server(tree: Path, os_name: str) -> Path:
    """The folder holding llama-server in an unpacked release: the top of a Windows zip, or the single
    `llama-<tag>/` folder of a Linux/macOS tarball. Its shared libraries sit beside it."""
    name = server_binary_name(os_name)  # type: ignore[arg-type]
    for candidate in (tree / name, *sorted(tree.glob(f"*/{name}"))):
        if candidate.is_file():
            return candidate.parent
    raise SwitchyardError(f"the release archive has no {name}", "build from source instead: --source source")


def install_release(choice: BuildChoice, root: Path, downloads: Path, progress: ProgressCallback,
                    smoke: Callable[[Path], str] | None) -> dict[str, Any]:
    """Download, verify and unpack `choice`'s assets into `root/bin`; return the marker fields (not yet written).

    `smoke` runs the unpacked binary (`--version`) and returns what it printed; None skips it (a Windows build
    unpacked on another OS). The caller writes the ready marker after this returns.
    """
    base = release_api_base()
    staging = root.parent / f".{root.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with make_client(base) as client:
            assets = lookup(choice.release_tag, choice.assets, client, base)
            files = [download(asset, downloads, progress, client) for asset in assets]
        tree = staging / "tree"
        for archive in files:  # Windows zips are flat: the CUDA runtime DLLs land beside llama-server.exe
            progress(ProgressEvent(f"unpacking {archive.name}"))
            unpack(archive, tree)
        server_dir = locate_server(tree, choice.platform.os)
        bin_dir = root / "bin"
        shutil.rmtree(bin_dir, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        os.replace(server_dir, bin_dir)
        binary = bin_dir / server_binary_name(choice.platform.os)
        version = smoke(binary) if smoke is not None else "not run (built for another OS)"
        if version.startswith("unknown"):
            shutil.rmtree(bin_dir, ignore_errors=True)
            raise SwitchyardError(f"the downloaded {choice.variant} llama-server does not run here: {version}",
                                  f"it needs {'; '.join(choice.needs) or 'nothing more'}; or try "
                                  "`switchyard engines install llama.cpp --variant cpu`")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for archive in files:
        archive.unlink(missing_ok=True)  # unpacked and verified: the archives are not needed any more
    return {
        "binary_version": version,
        "release_tag": choice.release_tag,
        "assets": [{"name": a.name, "url": a.url, "sha256": a.sha256} for a in assets],
    }
