"""Several models behind one endpoint (`switchyard serve --config models.yaml`): each model name has its own
engine process, requests are routed by their JSON `model` field, an engine idle for its `ttl` is stopped and the
next request for it starts it again (the request waits, bounded by the endpoint's wait timeout), and engines that
do not fit in memory together (the fit decides, through a MemoryBudget) are swapped: the least recently used one
is stopped first, its requests wait, none fail.

Each model is one EndpointManager bound to its route, so a model's engine can be switched (llama.cpp <-> vLLM)
exactly like the single-model endpoint's."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from desktop.core.common.defaults import DEFAULT_CTX_PER_REQUEST, DEFAULT_READY_TIMEOUT, DEFAULT_SLOTS
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, no_progress
from desktop.core.engines import get_adapter
from desktop.core.engines.base import LaunchPlan
from desktop.core.engines.engine_args import plan_fields_from_args
from desktop.core.engines.model_path import resolve_model
from desktop.core.engines.pooling import KINDS, args_kind, task_args
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.models.parsers import check_parser
from desktop.core.planning.fit import MAX_CTX
from desktop.core.planning.planner import Checked, plan_launch
from desktop.core.runtime.telemetry import Telemetry
from desktop.core.serving.capabilities import takes_images
from desktop.core.serving.defaults import DEFAULT_DRAIN_TIMEOUT
from desktop.core.serving.endpoint import (
    EndpointListener,
    EndpointManager,
    Launcher,
    MemoryBudget,
    SwitchResult,
    default_launcher,
)
from desktop.core.serving.proxy import ProxyServer

log = logging.getLogger("switchyard.endpoint")

MODEL_KEYS = ("name", "engine", "model", "ctx", "parallel", "ttl", "loading_status", "extra_routes", "tool_parser",
              "reasoning_parser", "reasoning_effort", "prefix_cache", "args", "kind")
TOP_KEYS = ("models", "loading_status")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
CONFIG_HINT = f"fix that entry of the config (keys: {', '.join(MODEL_KEYS)})"


def reasoning_setting(value: Any, where: str) -> str:
    """A reasoning_effort value as the one setting; YAML reads a bare `off` as false, which is off too."""
    from desktop.core.serving.reasoning import EFFORTS

    effort = "off" if value is False else value
    if effort not in EFFORTS:
        raise SwitchyardError(f"{where}: reasoning_effort must be one of {', '.join(EFFORTS)}, not {value!r}",
                              CONFIG_HINT)
    return str(effort)


@dataclass(frozen=True)
class ModelEntry:
    """One model of the list: the name clients send, and how to serve it."""

    name: str
    engine: str
    model: str
    ctx: int = DEFAULT_CTX_PER_REQUEST
    parallel: int = DEFAULT_SLOTS
    ttl: float | None = None  # seconds without requests before its engine stops; None = never
    loading_status: bool = False  # tell waiting streaming clients that the model loads (SSE comments)
    extra_routes: tuple[str, ...] = ()  # engine paths forwarded besides the inference routes (opt-in)
    # vLLM's tool-call / reasoning parser for this model, or "none"; None: the model's own (models.parsers)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    args: tuple[str, ...] = ()  # the engine's own flags (engines.engine_args: counted, refused or passed through)
    prefix_cache: bool = True  # false: the engine's prefix cache off (every request evaluates its whole prompt)
    # off|low|medium|high|auto: how much the model thinks where a request does not say (normalize rule 6); apart
    # from reasoning_parser, which says where the engine puts the thinking it does
    reasoning_effort: str = "auto"
    # chat | embedding | rerank: an embedder or reranker gets its engine's flags for it (engines.pooling)
    kind: str = "chat"

    def engine_args(self) -> tuple[str, ...]:
        """The engine flags this entry launches with: its kind's (engines.pooling), then the person's own."""
        if self.kind == "chat":
            return self.args
        return (*task_args(self.engine, self.kind, self.ctx, self.args, self._model_file()), *self.args)

    def _model_file(self) -> Path | None:
        """The entry's model on disk when it names one here (`demo`, a path): its GGUF says its own pooling."""
        try:
            return resolve_model(self.model, get_adapter(self.engine))
        except SwitchyardError:
            return None

    def switch_overrides(self, given: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
        """The plan fields a switch of this entry to another engine starts it with: `given` (serve's), and an
        embedder's or reranker's kind flags in that engine's spelling, so that it serves the same routes after a
        switch (its own `args` are its engine's: they stay behind, and come back with it)."""
        overrides = {name: dict(fields) for name, fields in (given or {}).items()}
        if self.kind == "chat":
            return overrides
        for engine in ("llama.cpp", "vllm"):
            fields = overrides.setdefault(engine, {})
            own = self.engine_args() if engine == self.engine else task_args(engine, self.kind, self.ctx, ())
            # as plan fields, so the fit counts what it counts (the embedder's raised -ub) and the argv has it once
            for name, value in plan_fields_from_args(engine, own).items():
                fields[name] = (*fields.get(name, ()), *value) if name == "extra_args" else value
        return overrides

    def asks(self) -> dict[str, Any]:
        """The plan fields this entry sets (the planner chooses the rest)."""
        parsers = {"tool_parser": self.tool_parser, "reasoning_parser": self.reasoning_parser}
        args = self.engine_args()
        return {"ctx_per_request": self.ctx, "slots": self.parallel,
                **{k: v for k, v in parsers.items() if v is not None},
                **({} if self.prefix_cache else {"prefix_cache": False}),
                **(plan_fields_from_args(self.engine, args) if args else {})}

    def plan(self, hardware: HardwareSnapshot, progress: ProgressCallback = no_progress) -> Checked:
        """This entry's checked plan on `hardware`, or PlanRefused naming the entry and the fix."""
        try:
            return plan_launch(self.engine, self.model, hardware, self.asks(), progress=progress)
        except SwitchyardError as exc:
            raise type(exc)(f"'{self.name}': {exc.message}", exc.hint) from None

    def served_kind(self) -> str:
        """What the entry's engine serves: its kind, or, for a chat entry given the engine's own embedding or
        rerank switch in `args` (how embedders were configured before `kind`), that."""
        if self.kind != "chat":
            return self.kind
        return args_kind(self.engine, self.args, self._model_file())

    def info(self) -> dict[str, Any]:
        return {"engine": self.engine, "model": self.model, "ctx": self.ctx, "parallel": self.parallel,
                "ttl": self.ttl, "kind": self.served_kind()}


@dataclass(frozen=True)
class ModelsConfig:
    models: tuple[ModelEntry, ...]
    source: str = "<config>"

    def names(self) -> list[str]:
        return [m.name for m in self.models]


def _int(where: str, key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise SwitchyardError(f"{where}: {key} must be a whole number from {low:,} to {high:,}, not {value!r}",
                              CONFIG_HINT)
    return value


def parse_models_config(data: Any, source: str = "<config>") -> ModelsConfig:
    """Validate a parsed models list; every problem is one line naming the entry and the key."""
    if isinstance(data, list):
        data = {"models": data}
    if not isinstance(data, dict):
        raise SwitchyardError(f"{source}: expected a mapping with a `models:` list", CONFIG_HINT)
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise SwitchyardError(f"{source}: unknown key(s) {', '.join(map(str, unknown))}",
                              f"the top level takes: {', '.join(TOP_KEYS)}")
    default_status = data.get("loading_status", False)
    if not isinstance(default_status, bool):
        raise SwitchyardError(f"{source}: loading_status must be true or false, not {default_status!r}",
                              CONFIG_HINT)
    items = data.get("models")
    if not isinstance(items, list) or not items:
        raise SwitchyardError(f"{source}: `models:` must be a non-empty list of entries",
                              "add entries like `- {name: chat, engine: llama.cpp, model: demo}`")
    entries: list[ModelEntry] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        where = f"{source}: models[{index}]"
        if not isinstance(item, dict):
            raise SwitchyardError(f"{where} must be a mapping, not {item!r}", CONFIG_HINT)
        if isinstance(item.get("name"), str):
            where += f" ('{item['name']}')"
        unknown = sorted(set(map(str, item)) - set(MODEL_KEYS))
        if unknown:
            raise SwitchyardError(f"{where}: unknown key(s) {', '.join(unknown)}", CONFIG_HINT)
        for key in ("name", "engine", "model"):
            if not isinstance(item.get(key), str) or not item[key].strip():
                raise SwitchyardError(f"{where}: `{key}` is required (a non-empty string)", CONFIG_HINT)
        name = item["name"].strip()
        if not NAME.match(name):
            raise SwitchyardError(f"{where}: the name '{name}' has characters clients cannot send easily",
                                  "use letters, digits and . _ - : / @ + (no spaces)")
        if name in seen:
            raise SwitchyardError(f"{where}: the name '{name}' is used twice", "give every model its own name")
        seen.add(name)
        try:
            engine = get_adapter(item["engine"]).name
        except SwitchyardError as exc:
            raise SwitchyardError(f"{where}: {exc.message}", exc.hint) from exc
        ctx = _int(where, "ctx", item.get("ctx", DEFAULT_CTX_PER_REQUEST), 1, MAX_CTX)
        parallel = _int(where, "parallel", item.get("parallel", DEFAULT_SLOTS), 1, 1024)
        ttl = item.get("ttl")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0):
            raise SwitchyardError(f"{where}: ttl must be a positive number of seconds (or left out), not {ttl!r}",
                                  CONFIG_HINT)
        status = item.get("loading_status", default_status)
        if not isinstance(status, bool):
            raise SwitchyardError(f"{where}: loading_status must be true or false, not {status!r}", CONFIG_HINT)
        routes = item.get("extra_routes", [])
        if not isinstance(routes, list) or not all(isinstance(r, str) and r.startswith("/") for r in routes):
            raise SwitchyardError(f"{where}: extra_routes must be a list of paths like /props, not {routes!r}",
                                  CONFIG_HINT)
        parsers: dict[str, str] = {}
        for key, kind in (("tool_parser", "tool"), ("reasoning_parser", "reasoning")):
            if item.get(key) is None:
                continue
            try:
                parsers[key] = check_parser(kind, item[key] if isinstance(item[key], str) else repr(item[key]))
            except SwitchyardError as exc:
                raise SwitchyardError(f"{where}: {key}: {exc.message}", exc.hint) from None
        effort = reasoning_setting(item.get("reasoning_effort", "auto"), where)
        prefix_cache = item.get("prefix_cache", True)
        if not isinstance(prefix_cache, bool):
            raise SwitchyardError(f"{where}: prefix_cache must be true or false, not {prefix_cache!r}", CONFIG_HINT)
        engine_args = item.get("args", [])
        if isinstance(engine_args, str):
            engine_args = engine_args.split()
        if not isinstance(engine_args, list) or not all(isinstance(a, str | int | float) for a in engine_args):
            raise SwitchyardError(f"{where}: args must be a list of the engine's flags, like [--n-cpu-moe, 4], "
                                  f"not {engine_args!r}", CONFIG_HINT)
        engine_args = [str(a) for a in engine_args]
        try:
            plan_fields_from_args(engine, engine_args)
        except SwitchyardError as exc:
            raise SwitchyardError(f"{where}: args: {exc.message}", exc.hint or CONFIG_HINT) from None
        kind = item.get("kind", "chat")
        if kind not in KINDS:
            raise SwitchyardError(f"{where}: kind must be one of {', '.join(KINDS)}, not {kind!r}", CONFIG_HINT)
        entries.append(ModelEntry(name, engine, item["model"].strip(), ctx, parallel,
                                  float(ttl) if ttl is not None else None, status, tuple(routes), **parsers,
                                  args=tuple(engine_args), prefix_cache=prefix_cache, reasoning_effort=effort,
                                  kind=kind))
    return ModelsConfig(tuple(entries), source)


def load_models_config(path: str | Path) -> ModelsConfig:
    """Read and validate a models.yaml."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise SwitchyardError(f"cannot read the models config {file}: {exc.strerror or exc}",
                              "check the path given to --config") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SwitchyardError(f"{file} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}",
                              "fix the YAML syntax") from exc
    return parse_models_config(data, str(file))


def plan_models(config: ModelsConfig, hardware: HardwareSnapshot,
                progress: ProgressCallback = no_progress) -> dict[str, Checked]:
    """Every entry's checked plan (what `serve --config --dry-run` prints): the first that does not fit raises."""
    return {entry.name: entry.plan(hardware, progress) for entry in config.models}


class Fleet:
    """The engines of a model list behind one ProxyServer. Thread-safe; loads happen one at a time."""

    def __init__(
        self,
        proxy: ProxyServer,
        config: ModelsConfig,
        *,
        telemetry: Telemetry | None = None,
        launcher: Launcher = default_launcher,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        budget: MemoryBudget | None = None,
        auto_fit: bool = False,
        hardware: HardwareSnapshot | None = None,
        plans: dict[str, Checked] | None = None,
        engine_overrides: dict[str, dict[str, Any]] | None = None,
        redetect: Callable[[], HardwareSnapshot] | None = None,
    ) -> None:
        self.proxy = proxy
        self.config = config
        self.budget = budget
        hardware = hardware or (budget.hardware if budget else None) or detect()
        plans = plans if plans is not None else plan_models(config, hardware)  # refused here: nothing started
        self.lanes: dict[str, EndpointManager] = {}
        for entry in config.models:
            lane = EndpointManager(proxy, telemetry=telemetry, launcher=launcher, ready_timeout=ready_timeout,
                                   drain_timeout=drain_timeout, budget=budget, auto_fit=auto_fit,
                                   hardware=hardware, route=entry.name, meter=False,
                                   engine_overrides=entry.switch_overrides(engine_overrides), redetect=redetect)
            lane.plan = plans[entry.name].plan
            lane.state = "unloaded"
            self.lanes[entry.name] = lane
        if telemetry is not None:
            proxy.subscribe(lambda record: telemetry.publish(record.to_samples()))
        proxy.set_models({e.name: {**e.info(), "vision": takes_images(plans[e.name].plan)} for e in config.models},
                         on_demand=self._on_demand,
                         reasoning={e.name: e.reasoning_effort for e in config.models},
                         loading_status=[e.name for e in config.models if e.loading_status],
                         extra_routes={e.name: e.extra_routes for e in config.models})
        for route in proxy.router.routes.values():
            route.idle = True  # nothing loaded yet: the first request for a model loads it
        self._ttl = {e.name: e.ttl for e in config.models}
        self._loaded_at: dict[str, float] = {}
        self._load_lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None

    def subscribe(self, listener: EndpointListener) -> None:
        for lane in self.lanes.values():
            lane.subscribe(listener)

    # --- loading ---
    def start(self, preload: bool = True) -> None:
        """Start the TTL watcher and, with `preload`, load the models in list order while they fit together; the
        others load on their first request. A model that fails to load is reported and left to load on demand."""
        if any(ttl is not None for ttl in self._ttl.values()):
            self._reaper = threading.Thread(target=self._reap, name="switchyard-ttl", daemon=True)
            self._reaper.start()
        if not preload:
            return
        loaded: list[LaunchPlan] = []
        for name, lane in self.lanes.items():
            assert lane.plan is not None
            if self.budget is not None and not self.budget.fits([*loaded, lane.plan]):
                log.info("%s is not preloaded: it does not fit beside the others (loads on demand)", name)
                continue
            self.load(name)
            loaded.append(lane.plan)

    def load(self, name: str) -> None:
        """Load `name`'s engine unless it is loaded; stop least recently used others first when the budget says
        they do not fit together. Raises the engine's failure (its route then fails waiting requests fast)."""
        lane = self.lanes[name]
        with self._load_lock:
            if lane.loaded or self._closed.is_set():
                return
            self._make_room(name)
            assert lane.plan is not None
            lane.start(lane.plan)  # planned again on the memory free now (a TTL reload, a swap back)
            self._loaded_at[name] = time.monotonic()

    def _make_room(self, name: str) -> None:
        if self.budget is None:
            return
        want = self.lanes[name].plan
        assert want is not None
        loaded = {n: lane.active.plan for n, lane in self.lanes.items() if lane.active is not None and n != name}
        while loaded and not self.budget.fits([*loaded.values(), want]):
            victim = min(loaded, key=self._last_used)
            plan = loaded.pop(victim)
            self.lanes[victim].unload(f"stopped to make room for '{name}' (stop-first: "
                                      f"{self.budget.describe([plan, want])})")

    def _last_used(self, name: str) -> float:
        lane = self.lanes[name]
        active = lane.active
        used = self.proxy.router.last_used.get(active.upstream.name) if active is not None else None
        return max(used or 0.0, self._loaded_at.get(name, 0.0))

    def _on_demand(self, name: str) -> None:
        """Called on the endpoint's loop when a request finds `name` unloaded: load it in a thread."""
        threading.Thread(target=self._load_quietly, args=(name,), name=f"switchyard-load-{name}",
                         daemon=True).start()

    def _load_quietly(self, name: str) -> None:
        try:
            self.load(name)
        except SwitchyardError as exc:  # the route already fails its waiting requests with this reason
            log.error("loading %s failed: %s", name, exc)
        except Exception:
            log.exception("loading %s failed", name)
            self.proxy.set_upstream(None, down_reason=f"loading {name} failed unexpectedly", model=name, idle=True)

    # --- idle unload ---
    def _tick(self) -> float:
        ttls = [t for t in self._ttl.values() if t is not None]
        return max(0.1, min(1.0, min(ttls) / 10)) if ttls else 1.0

    def _reap(self) -> None:
        while not self._closed.wait(self._tick()):
            for name in self.lanes:
                try:
                    self._reap_one(name)
                except SwitchyardError as exc:
                    log.warning("unloading %s failed: %s", name, exc)

    def _reap_one(self, name: str) -> bool:
        ttl, lane = self._ttl[name], self.lanes[name]
        if ttl is None or not lane.loaded:
            return False
        with self._load_lock:
            active = lane.active
            if active is None or self.proxy.inflight(active.upstream.name) > 0:
                return False
            idle = time.monotonic() - self._last_used(name)
            if idle < ttl:
                return False
            return lane.unload(f"idle for {idle:.1f} s (ttl {ttl:g} s); the next request loads it again")

    # --- control ---
    def _lane(self, name: str | None) -> tuple[str, EndpointManager]:
        if name is None:
            if len(self.lanes) != 1:
                raise SwitchyardError("this endpoint serves several models: say which one to switch",
                                      f"add --name, one of: {', '.join(self.lanes)}")
            name = next(iter(self.lanes))
        lane = self.lanes.get(name)
        if lane is None:
            raise SwitchyardError(f"no model named '{name}' on this endpoint", f"one of: {', '.join(self.lanes)}")
        return name, lane

    def switch(self, engine: str, model: str | None = None, name: str | None = None) -> SwitchResult:
        """Switch one model's engine (like the single-model endpoint's switch)."""
        name, lane = self._lane(name)
        if not lane.loaded:
            self.load(name)
        with self._load_lock:
            return lane.switch(engine, model)

    def switch_preview(self, engine: str, model: str | None = None, name: str | None = None) -> dict[str, Any]:
        """The plan a switch of one model would start, and its kind (nothing starts)."""
        return self._lane(name)[1].switch_preview(engine, model)

    def status(self) -> dict[str, Any]:
        models = {}
        for name, lane in self.lanes.items():
            data = lane.status()
            data["ttl"] = self._ttl[name]
            data["loaded"] = lane.loaded
            data["plan"] = lane.plan.to_json() if lane.plan else None
            models[name] = data
        states = {m["state"] for m in models.values()}
        return {
            "url": self.proxy.url,
            "openai_base_url": self.proxy.url + "/v1",
            "model_name": ", ".join(self.lanes),
            "state": "serving" if "serving" in states else next(iter(states)),
            "last_error": next((m["last_error"] for m in models.values() if m["last_error"]), None),
            "models": models,
            "active": None,
            "standby": None,
            "starting": None,
            "requests": {**self.proxy.counters, "inflight": self.proxy.inflight()},
            "budget_gib": round(self.budget.free_bytes / 2**30, 2) if self.budget else None,
        }

    def close(self) -> None:
        self._closed.set()
        if self._reaper is not None:
            self._reaper.join(timeout=10)
        for lane in self.lanes.values():
            lane.close()
