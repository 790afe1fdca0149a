"""The hub cache trusts no name from the server, deletes only inside the cache, and downloads through the proxy
the environment names, credentials included (against the loopback fake Hub and a loopback proxy)."""

from __future__ import annotations

import base64
import http.client
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fakehub import FakeHub, random_bytes

from desktop.core.common.errors import ModelError
from desktop.core.hub import cache, library
from desktop.core.hub.download import RetryPolicy, pull

FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, stall_timeout=5, connect_timeout=5)
SHA = "a" * 40


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "root" / "hf-cache"))
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SWITCHYARD_NO_KEYRING", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        yield fake


def _files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")} if root.exists() else set()


def test_a_hub_file_named_dot_dot_is_refused_and_nothing_is_written(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo("evil/repo", {"../../x": random_bytes(2000, 1), "model-Q4_K_M.gguf": random_bytes(2000, 2)},
                 tags=["gguf"])
    before = _files_under(tmp_path)
    for spec in ("evil/repo:../../x", "evil/repo:Q4_K_M", "evil/repo"):
        with pytest.raises(ModelError, match="unsafe file name"):
            pull(spec, policy=FAST)
    assert _files_under(tmp_path) == before
    assert not list(tmp_path.rglob("x"))


@pytest.mark.parametrize(("kind", "value"), [
    ("file name", "../x"), ("file name", "a/../../x"), ("file name", "/etc/passwd"), ("file name", "a//b"),
    ("file name", "a\\..\\x"), ("file name", "C:/x"), ("file name", "a/./b"), ("file name", "bad\nname"),
    ("etag", "../../x"), ("etag", "A" * 64), ("etag", "abc"), ("commit", "main/../.."), ("commit", "g" * 40),
    ("revision", "../x"), ("revision", "a/../b"), ("revision", ".hidden"), ("repo id", "../x"),
    ("repo id", "a/b/c"), ("repo id", "a/.."),
])
def test_unsafe_server_names_are_refused(kind: str, value: str) -> None:
    check = {"file name": cache.check_filename, "revision": cache.check_revision, "repo id": cache.check_repo_id,
             "etag": lambda v: cache.check_digest("etag", v), "commit": lambda v: cache.check_digest("commit", v)}
    with pytest.raises(ModelError, match=f"unsafe {kind}"):
        check[kind](value)


def test_safe_names_pass() -> None:
    assert cache.check_filename("sub/dir/model-00001-of-00002.safetensors")
    assert cache.check_revision("refs/pr/1") and cache.check_revision("v1.0")
    assert cache.check_repo_id("Qwen/Qwen3-0.6B-GGUF")
    assert cache.check_digest("etag", "0" * 64) and cache.check_digest("commit", SHA)


def test_every_cache_path_stays_inside_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with pytest.raises(ModelError):
        cache.pointer_path("a/b", SHA, "../../../../x", root)
    with pytest.raises(ModelError):
        cache.write_ref("a/b", "../../../../x", SHA, root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "models--a--b").mkdir(parents=True)
    (root / "models--a--b" / "blobs").symlink_to(outside)  # a planted link: blobs would land outside
    with pytest.raises(ModelError, match="unsafe path"):
        cache.blob_path("a/b", "0" * 64, root)
    assert not list(outside.iterdir())


def test_delete_never_removes_a_file_outside_the_cache(hub: FakeHub, tmp_path: Path) -> None:
    root = Path(os.environ["HF_HUB_CACHE"])
    hub.add_repo("demo/tiny-GGUF", {"tiny-Q4_K_M.gguf": random_bytes(3000, 3)}, tags=["gguf"])
    result = pull("demo/tiny-GGUF:Q4_K_M", policy=FAST)
    victim = tmp_path / "precious.gguf"
    victim.write_bytes(b"keep me")
    result.path.unlink()
    result.path.symlink_to(victim)  # the pointer now leads outside the cache
    library.delete("demo/tiny-GGUF", cache_dir=root)
    assert victim.read_bytes() == b"keep me"
    assert not result.path.is_symlink()


class _AuthProxy(ThreadingHTTPServer):
    """A forward HTTP proxy on loopback that wants Basic credentials, like a corporate one."""

    daemon_threads = True

    def __init__(self, credentials: str) -> None:
        self.expected = "Basic " + base64.b64encode(credentials.encode()).decode()
        self.seen: list[tuple[str, bool]] = []
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(BaseHTTPRequestHandler):
    server: _AuthProxy

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:
        self._relay()

    def do_HEAD(self) -> None:
        self._relay()

    def _relay(self) -> None:
        authorized = self.headers.get("Proxy-Authorization") == self.server.expected
        self.server.seen.append((self.path, authorized))
        if not authorized:
            self.send_response(407)
            self.send_header("Proxy-Authenticate", 'Basic realm="corp"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        target = urlsplit(self.path)
        upstream = http.client.HTTPConnection(target.hostname or "", target.port or 80, timeout=10)
        skip = {"proxy-authorization", "proxy-connection", "connection", "keep-alive"}
        upstream.request(self.command, target.path + (f"?{target.query}" if target.query else ""),
                         headers={k: v for k, v in self.headers.items() if k.lower() not in skip})
        answer = upstream.getresponse()
        body = answer.read()
        upstream.close()
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)


def test_downloads_go_through_an_authenticating_proxy_from_the_environment(
        hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    data = random_bytes(200_000, 4)
    hub.add_repo("demo/tiny-GGUF", {"tiny-Q4_K_M.gguf": data}, tags=["gguf"])
    proxy = _AuthProxy("alice:s3cr%t")
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("HTTP_PROXY", f"http://alice:s3cr%25t@127.0.0.1:{proxy.server_address[1]}")
        result = pull("demo/tiny-GGUF:Q4_K_M", policy=FAST)
        assert result.path.read_bytes() == data
        downloads = [(path, ok) for path, ok in proxy.seen if "/resolve/" in path]
        assert downloads and all(ok for _path, ok in downloads), proxy.seen
    finally:
        proxy.shutdown()
        proxy.server_close()
