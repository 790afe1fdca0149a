"""Attach mode: an OpenAI-compatible server somewhere else (a team's vLLM box, a llama-server on another machine)
used as an engine of kind "external": its models listed, its /metrics read when exposed, and reachable by name from
bench and A/B.

Rules that keep this safe: requests go only to the base URL the user entered (no redirects followed, no proxy
taken from the environment); the API key lives in the OS keyring, or, where none works, in a file only the user
can read, with a warning; TLS is verified unless the user opted out for that endpoint; every request has a short
connect timeout so a dead host fails fast.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from desktop.core.common import paths
from desktop.core.common.errors import SwitchyardError

log = logging.getLogger("switchyard.external")

KIND = "external"
KEYRING_SERVICE = "switchyard-endpoint"
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 15.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ENGINE_PREFIXES = {"vllm:": "vllm", "llamacpp:": "llama.cpp"}


@dataclass(frozen=True)
class ExternalEndpoint:
    """A server the user attached. `api_key` is loaded from the secret store and never serialized."""

    name: str
    base_url: str
    api_key: str | None = field(default=None, repr=False)
    verify_tls: bool = True
    kind: str = KIND

    def headers(self) -> dict[str, str]:
        """What every request to this endpoint carries (the bearer key, when there is one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        return self.base_url + "/" + path.lstrip("/")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "base_url": self.base_url, "verify_tls": self.verify_tls, "kind": self.kind,
                "has_api_key": self.api_key is not None}


@dataclass(frozen=True)
class RemoteModel:
    id: str
    owned_by: str | None = None
    max_model_len: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EndpointReport:
    """What one probe found: the models, which engine serves them (from /metrics), and the common series."""

    name: str
    base_url: str
    models: list[RemoteModel]
    engine: str | None
    metrics_exposed: bool
    metrics: dict[str, float]
    latency_ms: float

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["models"] = [m.to_json() for m in self.models]
        return data


# --- validation -------------------------------------------------------------------------------------
def normalize_base_url(text: str) -> str:
    """The server's root URL from what the user typed (a trailing /v1 or slash is dropped)."""
    raw = text.strip()
    try:
        url = httpx.URL(raw)
    except (httpx.InvalidURL, TypeError) as exc:
        raise SwitchyardError(f"not a valid URL: {raw!r} ({exc})", "use a form like http://gpu-box:8000") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise SwitchyardError(f"not an http(s) URL: {raw!r}", "use a form like http://gpu-box:8000")
    if url.userinfo:
        raise SwitchyardError("the URL contains a user name or password",
                              "remove it and give the API key with --api-key-stdin or --api-key-env")
    if url.query or url.fragment:
        raise SwitchyardError("the URL has a query or fragment", "give only scheme, host, port and path")
    path = url.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return str(url.copy_with(path=path or "/")).rstrip("/")


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise SwitchyardError(f"invalid endpoint name {name!r}",
                              "use letters, digits, '.', '_' or '-' (up to 63), starting with a letter or digit")
    return name


# --- secrets ----------------------------------------------------------------------------------------
class SecretStore:
    """API keys: the OS keyring when one works, else a 0600 file under the data dir (with a warning)."""

    def __init__(self, fallback_dir: Path | None = None, warn: Callable[[str], None] | None = None) -> None:
        self._fallback_dir = fallback_dir
        self._warn = warn or log.warning

    def _file(self, name: str) -> Path:
        folder = self._fallback_dir or paths.data_dir() / "secrets"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        return folder / f"endpoint-{name}.key"

    def put(self, name: str, secret: str) -> str:
        """Store; returns where ('keyring' or 'file')."""
        import keyring
        from keyring.errors import KeyringError

        try:
            keyring.set_password(KEYRING_SERVICE, name, secret)
            if keyring.get_password(KEYRING_SERVICE, name) == secret:  # a null backend stores nothing
                self._delete_file(name)
                return "keyring"
        except (KeyringError, RuntimeError, OSError) as exc:
            log.debug("keyring unavailable: %s", type(exc).__name__)
        path = self._file(name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(secret)
        os.chmod(path, 0o600)
        self._warn(f"no working OS keyring: the API key of endpoint '{name}' is stored in {path} "
                   "(readable only by you)")
        return "file"

    def get(self, name: str, where: str) -> str | None:
        if where == "file":
            try:
                return self._file(name).read_text(encoding="utf-8")
            except FileNotFoundError:
                return None
        import keyring
        from keyring.errors import KeyringError

        try:
            return keyring.get_password(KEYRING_SERVICE, name)
        except (KeyringError, RuntimeError, OSError):
            return None

    def delete(self, name: str) -> None:
        import keyring
        from keyring.errors import KeyringError, PasswordDeleteError

        try:
            keyring.delete_password(KEYRING_SERVICE, name)
        except (PasswordDeleteError, KeyringError, RuntimeError, OSError):
            pass
        self._delete_file(name)

    def _delete_file(self, name: str) -> None:
        self._file(name).unlink(missing_ok=True)


# --- the registry -----------------------------------------------------------------------------------
class EndpointStore:
    """Attached endpoints, as JSON under the config dir (no secrets in it)."""

    def __init__(self, path: Path | None = None, secrets: SecretStore | None = None) -> None:
        self.path = path or paths.config_dir() / "endpoints.json"
        self.secrets = secrets or SecretStore()

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise SwitchyardError(f"cannot read {self.path}: {exc}",
                                  "fix or delete the file; attached endpoints are listed in it") from None
        endpoints = data.get("endpoints", {}) if isinstance(data, dict) else {}
        return endpoints if isinstance(endpoints, dict) else {}

    def _write(self, endpoints: Mapping[str, Mapping[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": 1, "endpoints": endpoints}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def add(self, name: str, base_url: str, api_key: str | None = None, verify_tls: bool = True,
            replace: bool = False) -> ExternalEndpoint:
        check_name(name)
        url = normalize_base_url(base_url)
        endpoints = self._read()
        if name in endpoints and not replace:
            raise SwitchyardError(f"an endpoint named '{name}' already exists",
                                  "pick another name, or pass --replace to overwrite it")
        if api_key is not None and not api_key.strip():
            raise SwitchyardError("the API key is empty", "give the key on stdin or in the named variable")
        key = api_key.strip() if api_key else None
        entry: dict[str, Any] = {"base_url": url, "verify_tls": verify_tls, "key_store": None}
        if key:
            entry["key_store"] = self.secrets.put(name, key)
        elif name in endpoints:
            self.secrets.delete(name)
        endpoints[name] = entry
        self._write(endpoints)
        return ExternalEndpoint(name, url, key, verify_tls)

    def remove(self, name: str) -> None:
        endpoints = self._read()
        if name not in endpoints:
            raise SwitchyardError(f"no endpoint named '{name}'", "see `switchyard endpoints list`")
        del endpoints[name]
        self._write(endpoints)
        self.secrets.delete(name)

    def get(self, name: str) -> ExternalEndpoint:
        entry = self._read().get(name)
        if entry is None:
            raise SwitchyardError(f"no endpoint named '{name}'",
                                  "see `switchyard endpoints list`, or add it with `switchyard endpoints add`")
        return self._endpoint(name, entry)

    def list(self) -> list[ExternalEndpoint]:
        return [self._endpoint(name, entry) for name, entry in sorted(self._read().items())]

    def _endpoint(self, name: str, entry: Mapping[str, Any]) -> ExternalEndpoint:
        where = entry.get("key_store")
        key = self.secrets.get(name, str(where)) if where else None
        if where and key is None:
            log.warning("the API key of endpoint '%s' is missing from the %s", name, where)
        return ExternalEndpoint(name, str(entry["base_url"]), key, bool(entry.get("verify_tls", True)))


def resolve_endpoint(name_or_url: str, store: EndpointStore | None = None) -> ExternalEndpoint:
    """An attached endpoint by name, or a URL (the attached endpoint with that URL, if any, with its key)."""
    store = store or EndpointStore()
    if "://" not in name_or_url:
        return store.get(name_or_url)
    url = normalize_base_url(name_or_url)
    for endpoint in store.list():
        if endpoint.base_url == url:
            return endpoint
    return ExternalEndpoint(httpx.URL(url).netloc.decode("ascii"), url)


# --- talking to it ----------------------------------------------------------------------------------
def client_for(endpoint: ExternalEndpoint, read_timeout: float = READ_TIMEOUT_S) -> httpx.Client:
    """An HTTP client that can only talk to this endpoint the way the user allowed."""
    return httpx.Client(
        timeout=httpx.Timeout(read_timeout, connect=CONNECT_TIMEOUT_S),
        verify=endpoint.verify_tls,
        follow_redirects=False,  # a redirect could point anywhere: never follow it
        trust_env=False,  # no proxy or netrc from the environment
        headers=endpoint.headers(),
    )


def _fetch(endpoint: ExternalEndpoint, path: str, client: httpx.Client | None) -> httpx.Response:
    """GET `path` with the caller's client, or with a short-lived one of our own."""
    if client is not None:
        return _get(client, endpoint, path)
    with client_for(endpoint) as own:
        return _get(own, endpoint, path)


def _get(client: httpx.Client, endpoint: ExternalEndpoint, path: str) -> httpx.Response:
    url = endpoint.url(path)
    try:
        response = client.get(url)
    except httpx.ConnectTimeout:
        raise SwitchyardError(f"timed out after {CONNECT_TIMEOUT_S:g} s connecting to {endpoint.base_url}",
                              "check the address and that a firewall lets you through") from None
    except httpx.TimeoutException:
        raise SwitchyardError(f"{endpoint.base_url} accepted the connection but did not answer {path} in time",
                              "the server may be overloaded or still loading; try again") from None
    except httpx.ConnectError as exc:
        if _is_tls_failure(exc):
            raise SwitchyardError(
                f"the TLS certificate of {endpoint.base_url} could not be verified ({_tls_reason(exc)})",
                "if this is your own host with a self-signed certificate, attach it again with --insecure "
                "(--replace)") from None
        raise SwitchyardError(f"cannot reach {endpoint.base_url}: {_reason(exc)}",
                              "check the address and port, and that the server is running") from None
    except httpx.HTTPError as exc:
        raise SwitchyardError(f"request to {endpoint.base_url} failed: {_reason(exc)}",
                              "check the address and that it is an OpenAI-compatible server") from None
    if response.is_redirect:
        raise SwitchyardError(
            f"{url} redirects to {response.headers.get('location', '?')}",
            "Switchyard follows no redirects: attach the final address instead")
    if response.status_code in (401, 403):
        if endpoint.api_key:
            raise SwitchyardError("the endpoint rejected the API key",
                                  f"set the right key: switchyard endpoints add {endpoint.name} "
                                  f"{endpoint.base_url} --api-key-stdin --replace")
        raise SwitchyardError("the endpoint requires an API key",
                              f"attach it with one: switchyard endpoints add {endpoint.name} "
                              f"{endpoint.base_url} --api-key-stdin --replace")
    return response


def _is_tls_failure(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return "CERTIFICATE_VERIFY_FAILED" in str(exc) or "SSL" in str(exc)


def _tls_reason(exc: BaseException) -> str:
    text = str(exc)
    match = re.search(r"certificate verify failed: ([^(]+)", text)
    return match.group(1).strip() if match else text[:160]


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    if "Name or service not known" in text or "nodename nor servname" in text or "Errno -2" in text:
        return "unknown host name"
    return text[:200]


def list_models(endpoint: ExternalEndpoint, client: httpx.Client | None = None) -> list[RemoteModel]:
    """GET /v1/models."""
    response = _fetch(endpoint, "/v1/models", client)
    if response.status_code == 404:
        raise SwitchyardError(f"{endpoint.base_url} has no /v1/models: not an OpenAI-compatible server",
                              "give the server's root URL, e.g. http://host:8000")
    if response.status_code != 200:
        raise SwitchyardError(f"{endpoint.base_url}/v1/models answered HTTP {response.status_code}",
                              "check the server's log")
    try:
        data = response.json()["data"]
        return [RemoteModel(str(m["id"]), m.get("owned_by"),
                            int(m["max_model_len"]) if m.get("max_model_len") else None) for m in data]
    except (ValueError, KeyError, TypeError) as exc:
        raise SwitchyardError(f"{endpoint.base_url}/v1/models did not return an OpenAI model list ({exc})",
                              "check that the URL points at an OpenAI-compatible server") from None


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text → {sample name: {label string: value}}, the shape adapters' map_metrics takes."""
    families: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            families.setdefault(sample.name, {})[labels] = float(sample.value)
    return families


def detect_engine(families: Mapping[str, Any]) -> str | None:
    """'vllm' or 'llama.cpp' from the metric names' prefixes, None if neither."""
    for name in families:
        for prefix, engine in ENGINE_PREFIXES.items():
            if name.startswith(prefix):
                return engine
    return None


def scrape_metrics(endpoint: ExternalEndpoint,
                   client: httpx.Client | None = None) -> tuple[str | None, dict[str, dict[str, float]]] | None:
    """(engine, families) from GET /metrics, or None when the server exposes no metrics."""
    response = _fetch(endpoint, "/metrics", client)
    if response.status_code != 200:
        return None  # 404 or llama-server's 501 without --metrics
    try:
        families = parse_metrics(response.text)
    except ValueError:
        return None
    return detect_engine(families), families


def probe_endpoint(endpoint: ExternalEndpoint) -> EndpointReport:
    """Models, engine and current common series of one endpoint (one connection, short timeouts)."""
    from desktop.core.engines import get_adapter

    started = time.monotonic()
    with client_for(endpoint) as client:
        models = list_models(endpoint, client)
        latency_ms = (time.monotonic() - started) * 1000
        scraped = scrape_metrics(endpoint, client)
    engine, series = None, {}
    if scraped is not None:
        engine, families = scraped
        if engine:
            series = get_adapter(engine).map_metrics(families)
    return EndpointReport(endpoint.name, endpoint.base_url, models, engine, scraped is not None, series,
                          round(latency_ms, 1))


__all__ = ["KIND", "EndpointReport", "EndpointStore", "ExternalEndpoint", "RemoteModel", "SecretStore",
           "detect_engine", "list_models", "normalize_base_url", "parse_metrics", "probe_endpoint",
           "resolve_endpoint", "scrape_metrics"]
