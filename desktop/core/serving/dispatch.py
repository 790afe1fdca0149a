"""Which answer a request that passed the endpoint's screen gets, and who hears of it: a route the endpoint answers
itself (the control channel, /health, /v1/models), a refusal (a path that reaches no engine, an unknown model), or,
once its body's model is read (on the loop, or in a worker thread for a body with many JSON tokens), the engine
route the forwarder takes it to.

Apart from the proxy module (ProxyServer: the server's lifecycle, its thread-safe methods, the screen by head) so
that each holds one concern; ProxyServer.dispatch hands every request here (once per request, never per chunk).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from desktop.core.common.text import bounded
from desktop.core.engines.model_path import model_label
from desktop.core.serving import normalize, ollama
from desktop.core.serving.capabilities import TrafficCapabilities
from desktop.core.serving.forward import MESSAGES_PATH, Forwarder
from desktop.core.serving.http1 import (
    ClientConnection,
    Incoming,
    LocalHandler,
    LocalRequest,
    LocalResponse,
    anthropic_error,
    json_error,
    ollama_error,
)
from desktop.core.serving.metering import RequestListener, RequestRecord
from desktop.core.serving.requestinfo import LOOP_TOKENS, BadBody, RequestInfo, scan
from desktop.core.serving.router import Route, Router

log = logging.getLogger("switchyard.proxy")

CONTROL_PREFIX = "/switchyard/"
# The only paths forwarded to an engine (POST): inference. Everything else an engine serves (llama.cpp's /slots,
# /props, /lora-adapters, /metrics; vLLM's /invocations, /tokenize, /pause, dev-mode RPC) is a 404 here, unless a
# model opts a path in (models.yaml `extra_routes`, ProxyServer(extra_routes=...)).
INFERENCE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                              "/v1/rerank", "/v1/messages", "/v1/messages/count_tokens"})


class Dispatcher:
    """Answers the requests of one endpoint (ProxyServer) on its loop: its own routes, refusals, and the requests
    it forwards (counted, announced to the request listeners, their capabilities noted, then to the forwarder)."""

    def __init__(self, router: Router, events: RequestEvents, forwarder: Forwarder,
                 capabilities: TrafficCapabilities, model_name: str, started_at: float) -> None:
        self.router = router
        self.events = events
        self.counters = events.counters
        self.forwarder = forwarder
        self.capabilities = capabilities
        self.model_name = model_name  # the served name when one model is served (/v1/models)
        self.started_at = started_at
        self.local_routes: dict[str, dict[str, LocalHandler]] = {}  # path -> method -> handler (add_routes)
        self.scanner: ThreadPoolExecutor | None = None  # reads bodies too large to read on the loop

    def close(self) -> None:
        """The endpoint stops: no more bodies are read in the worker thread."""
        if self.scanner is not None:
            self.scanner.shutdown(wait=False, cancel_futures=True)

    def dispatch(self, request: Incoming, client: ClientConnection) -> None:
        """Answer one request that passed the screen; calls client.request_done() when finished, now or later."""
        path, method = request.path, request.method
        routes = self.local_routes.get(path)
        if routes is not None or path.startswith(CONTROL_PREFIX):
            handler = routes.get(method) if routes else None
            if handler is None:
                self._answer(request, client, json_error(404 if not routes else 405, f"no route {method} {bounded(path)}"))
            else:
                client.wait_in(self._local(handler, request, client))
        elif path == "/health":
            self._answer(request, client, health_answer(self.router), counted=False)
        elif path == "/v1/models":
            listed = method in ("GET", "HEAD")
            self._answer(request, client, models_answer(self.router, self.model_name, self.started_at) if listed
                         else json_error(405, f"{method} {path} is not allowed; GET it"), counted=not listed)
        elif path.startswith(ollama.API_PREFIX):
            self._ollama(request, client)
        elif (path in INFERENCE_ROUTES and method == "POST") or self.router.extra_route(path):
            try:
                info = scan(request.body, LOOP_TOKENS)
                if info is not None:
                    request.shape = normalize.parse(path, request.body)
            except BadBody as exc:
                self._answer(request, client, error_answer(path, 400, str(exc)))
                return
            if info is None:  # too many tokens to read on the loop: read it in a worker thread
                self._scan_off_loop(request, client)
            else:
                self._route(request, client, info)
        else:
            what = "POST it" if path in INFERENCE_ROUTES else \
                f"the endpoint forwards only {', '.join(sorted(INFERENCE_ROUTES))} (and GET /v1/models)"
            self._answer(request, client, error_answer(path, 404 if path not in INFERENCE_ROUTES else 405,
                                                      f"no route {method} {bounded(path)}: {what}"))

    def _ollama(self, request: Incoming, client: ClientConnection) -> None:
        """Ollama's API: the listings answered here, model management refused, chat/generate/embed translated to
        the engine's OpenAI route and then forwarded like any inference request (serving.ollama)."""
        path, method = request.path, request.method
        if path in ollama.LOCAL_ROUTES:
            wanted = "POST" if path == "/api/show" else "GET"
            if method not in (wanted, "HEAD") or (method == "HEAD" and wanted == "POST"):
                self._answer(request, client, ollama_error(405, f"{method} {path} is not allowed; {wanted} it"))
                return
            status, data = ollama.local_answer(path, method, request.body, self.served())
            self._answer(request, client, LocalResponse.json(data, status=status), counted=status >= 400)
            return
        refused = ollama.management(path)
        if refused is not None or path not in ollama.ENGINE_ROUTES:
            self._answer(request, client, ollama_error(501 if refused else 404, refused or f"no route {method} "
                                                       f"{bounded(path)}: the endpoint speaks Ollama's /api/chat, "
                                                       "/api/generate, /api/embed, /api/tags, /api/show, /api/ps "
                                                       "and /api/version"))
            return
        if method != "POST":
            self._answer(request, client, ollama_error(405, f"{method} {path} is not allowed; POST it"))
            return
        try:
            call, engine_path, body = ollama.translate(path, request.body)
        except ollama.OllamaRefusal as exc:
            loading = ollama.is_load(exc)
            if loading is None:
                self._answer(request, client, ollama_error(exc.status, exc.message))
            else:  # an empty prompt loads the model: it is (or is being) loaded already
                answer = LocalResponse.json(ollama.load_answer(loading))
                if loading.stream:
                    answer.body += b"\n"
                    answer.content_type = "application/x-ndjson"
                self._answer(request, client, answer, counted=False)
            return
        if self.router.multi:  # Ollama clients add a tag to the name: `switchyard:latest` is `switchyard`
            name = body["model"]
            if name not in self.router.routes and name.endswith(":latest") and name[:-7] in self.router.routes:
                body["model"] = name[:-7]
        request.ollama = call
        request.path = request.target = engine_path  # from here on, an OpenAI request (its record says /api/...)
        request.body = json.dumps(body).encode()
        try:
            info = scan(request.body, None)
        except BadBody as exc:
            self._answer(request, client, ollama_error(400, str(exc)))
            return
        assert info is not None
        request.shape = normalize.parse(engine_path, request.body)
        self._route(request, client, info)

    def served(self) -> list[ollama.Served]:
        """What Ollama's listings show: the served name (or each configured model) and what serves it."""
        if not self.router.multi:
            active = self.router.active
            return [ollama.Served(self.model_name, active.model if active else "", active.engine if active else None,
                                  active.context if active else 0, self.started_at,
                                  vision=bool(active and active.vision))]
        return [ollama.Served(name, str((route.active.model if route.active else route.info.get("model")) or ""),
                              route.active.engine if route.active else None,
                              route.active.context if route.active else int(route.info.get("ctx") or 0),
                              self.started_at,
                              vision=route.active.vision if route.active else bool(route.info.get("vision")),
                              kind=str(route.info.get("kind") or "chat"))
                for name, route in self.router.routes.items()]

    def _route(self, request: Incoming, client: ClientConnection, info: RequestInfo) -> None:
        """The body is read: pick the route by its model and forward."""
        request.info = info
        name = info.model
        if name is None and self.router.multi and request.path not in INFERENCE_ROUTES:
            name = self.router.opted_in(request.path)  # e.g. GET /props: to the one model that opted it in
        route = self.router.route(name)
        if route is None:
            self._answer(request, client, unknown_model(self.router, name, request.path) if request.ollama is None else
                         ollama_error(404, f"model '{bounded(name or '')}' not found; this endpoint serves "
                                           f"{', '.join(self.router.routes)}"))
            return
        refusal = wrong_kind(self.router, name, route, request.path)
        if refusal is not None:
            self._answer(request, client, ollama_error(400, refusal) if request.ollama is not None else
                         LocalResponse.json({"error": {"message": refusal, "type": "invalid_request_error",
                                                       "param": "model", "code": "model_not_supported"}}, status=400))
            return
        if request.path not in INFERENCE_ROUTES and request.path not in route.extra_routes:
            self._answer(request, client, error_answer(request.path, 404, f"no route {request.method} "
                                                      f"{bounded(request.path)} for this model"))
            return
        request.reasoning = route.reasoning_effort
        self.counters["requests"] += 1
        request.seq = self.counters["requests"]
        self.events.started(request, client)
        model = None
        if self.router.multi:
            model = name if name in self.router.routes else next(iter(self.router.routes))
        self.capabilities.note(model or self.model_name, info.capabilities)
        self.forwarder.forward(request, client, route, model)

    def _scan_off_loop(self, request: Incoming, client: ClientConnection) -> None:
        """Read a body with many JSON tokens in a worker thread (the loop serves others meanwhile), then route."""
        if self.scanner is None:
            self.scanner = ThreadPoolExecutor(max_workers=2, thread_name_prefix="switchyard-scan")
        scanned = asyncio.get_running_loop().run_in_executor(self.scanner, read_body, request)

        def read(done: asyncio.Future[RequestInfo | None]) -> None:
            try:
                info = done.result()
            except BadBody as exc:
                self._answer(request, client, error_answer(request.path, 400, str(exc)))
                return
            except asyncio.CancelledError:  # the endpoint is stopping
                client.request_done(False)
                return
            except Exception:
                log.exception("the endpoint could not read a request body")
                client.request_done(False)
                return
            assert info is not None
            self._route(request, client, info)

        scanned.add_done_callback(read)

    def _answer(self, request: Incoming, client: ClientConnection, response: LocalResponse, *,
                counted: bool = True) -> None:
        """Answer from the endpoint itself (a refusal counts as a client error)."""
        if counted and 400 <= response.status < 500:
            self.counters["client_errors"] += 1
        client.write_response(response, request=request)
        client.request_done(True)

    async def _local(self, handler: LocalHandler, request: Incoming, client: ClientConnection) -> bool:
        try:
            response = await handler(LocalRequest(request.method, request.path, request.query, request.headers,
                                                  request.body))
        except Exception as exc:
            log.exception("control route %s failed", request.path)
            response = json_error(500, f"the endpoint failed: {exc}")
        client.write_response(response, request=request)
        return True


def read_body(request: Incoming) -> RequestInfo | None:
    """The scan of a body with many JSON tokens, and its parse for the request rules (serving.normalize), in the
    scan's worker thread."""
    info = scan(request.body, None)
    request.shape = normalize.parse(request.path, request.body)
    return info


class RequestEvents:
    """The endpoint's counters, and who hears of each forwarded request as it arrives and as it finishes.

    "failed": the endpoint or an engine failed the request (5xx, a cut or broken stream); "client_errors": it was
    refused as the client's fault (4xx, including a client that left before its answer: 499)."""

    def __init__(self) -> None:
        self.counters = {"requests": 0, "failed": 0, "client_errors": 0, "waited": 0}
        self.listeners: list[RequestListener] = []
        self.started_listeners: list[RequestListener] = []

    def started(self, request: Incoming, client: ClientConnection) -> None:
        """A request that just arrived (a record with status 0; built only when someone listens)."""
        if not self.started_listeners:
            return
        record = RequestRecord(time.time(), request.method, request.path, None, 0, False, None, 0.0, None,
                               model=request.info.model, client=client.peer, seq=request.seq)
        self._tell(self.started_listeners, record)

    def finished(self, record: RequestRecord) -> None:
        if record.failed:
            self.counters["failed"] += 1
        elif record.client_error:
            self.counters["client_errors"] += 1
        self._tell(self.listeners, record)

    @staticmethod
    def _tell(listeners: list[RequestListener], record: RequestRecord) -> None:
        for listener in list(listeners):
            try:
                listener(record)
            except Exception:
                log.exception("request listener failed")


def health_answer(router: Router) -> LocalResponse:
    if router.multi:  # serving: every model is loaded, or loads on its next request
        models = {name: "loaded" if route.active else route.down_reason or "unloaded"
                  for name, route in router.routes.items()}
        return LocalResponse.json({"status": "ok", "models": models})
    if router.active is not None:
        return LocalResponse.json({"status": "ok", "engine": router.active.engine})
    return LocalResponse.json({"status": "unavailable", "reason": router.down_reason or "starting"}, status=503)

def models_answer(router: Router, model_name: str, started_at: float) -> LocalResponse:
    if router.multi:
        data = []
        for name, route in router.routes.items():
            state = "loaded" if route.active else "loading" if route.loading_since else \
                "down" if route.down_reason else "unloaded"
            info = {**route.info, "state": state}
            if isinstance(info.get("model"), str):
                info["model"] = model_label(info["model"])  # a name, never the user's path
            data.append({"id": name, "object": "model", "created": int(started_at),
                         "owned_by": "switchyard", "switchyard": info})
        return LocalResponse.json({"object": "list", "data": data})
    active = router.active
    entry: dict[str, Any] = {"id": model_name, "object": "model", "created": int(started_at),
                             "owned_by": "switchyard"}
    if active is not None:
        entry["switchyard"] = {"engine": active.engine, "model": model_label(active.model), "vision": active.vision}
    return LocalResponse.json({"object": "list", "data": [entry]})

def unknown_model(router: Router, name: str | None, path: str = "") -> LocalResponse:
    """OpenAI's answer for a model it does not have, naming the ones this endpoint does have (Anthropic's shape,
    `not_found_error`, on the Messages API: the anthropic SDK raises NotFoundError from it)."""
    names = ", ".join(router.routes)
    message = (f"The model '{bounded(name)}' does not exist on this endpoint; available: {names}" if name is not None
               else f"the request names no model; this endpoint serves several: {names}")
    if path.startswith(MESSAGES_PATH):
        return anthropic_error(404 if name is not None else 400, message,
                               "not_found_error" if name is not None else "invalid_request_error")
    return LocalResponse.json({"error": {"message": message, "type": "invalid_request_error", "param": "model",
                                         "code": "model_not_found" if name is not None else "model_required"}},
                              status=404 if name is not None else 400)


POOLING_ROUTES = {"/v1/embeddings": "embedding", "/v1/rerank": "rerank"}


def wrong_kind(router: Router, name: str | None, route: Route, path: str) -> str | None:
    """With a models list, embeddings and reranking go to an entry of that kind (models.yaml `kind`): why a
    request that names another kind of model is refused, naming the entries that do serve it or how to add one."""
    wanted = POOLING_ROUTES.get(path)
    kind = route.info.get("kind")
    if wanted is None or not router.multi or kind is None or kind == wanted:
        return None
    serving = [other for other, r in router.routes.items() if r.info.get("kind") == wanted]
    what = "embeddings" if wanted == "embedding" else "reranking"
    return (f"'{bounded(name or '')}' is a {kind} model and serves no {what}; "
            + (f"ask {', '.join(serving)} instead" if serving else
               f"add a models.yaml entry with `kind: {wanted}` (e.g. `- {{name: embed, engine: llama.cpp, model: "
               f"FILE.gguf, kind: {wanted}}}`) and ask it by its name"))


def error_answer(path: str, status: int, message: str) -> LocalResponse:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return anthropic_error(status, message, kind) if path.startswith(MESSAGES_PATH) else \
        json_error(status, message, kind)
