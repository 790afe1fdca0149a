"""`switchyard serve`: start a real engine on a model, wait until it really serves, then either stream one
prompt and exit (`--prompt`) or serve until Ctrl-C/SIGTERM. Nothing is left running afterwards.

With `--endpoint` (or `--proxy-port P`) it runs the stable endpoint in front of the engine: one OpenAI URL and one
model name that stay while engines are switched behind it, driven from other shells by `switchyard status`,
`switchyard switch --to E` and `switchyard stop` through the endpoint's local control channel."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from desktop.commands import _numbers as N
from desktop.commands._common import capability_lines, cell, emit_json, print_described, stderr_progress
from desktop.core.common.defaults import (
    DEFAULT_CTX_PER_REQUEST,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_FIRST_BYTE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_PROXY_PORT,
    DEFAULT_READY_TIMEOUT,
    DEFAULT_SLOTS,
    DEFAULT_VLLM_UTILIZATION,
    DEFAULT_WAIT_TIMEOUT,
    SERVED_MODEL_NAME,
)
from desktop.core.common.errors import EngineFailed, SwitchyardError

if TYPE_CHECKING:  # the engines, the proxy and the store load only when a command runs: `status` stays instant
    from desktop.core.machine.hardware import HardwareSnapshot
    from desktop.core.planning.planner import Checked
    from desktop.core.runtime.supervisor import EngineProcess
    from desktop.core.serving.control import EndpointControl
    from desktop.core.serving.endpoint import EndpointEvent
    from desktop.core.serving.proxy import ProxyServer
    from desktop.core.storage.history import Store


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="run an engine on a model (OpenAI-compatible, 127.0.0.1)")
    parser.add_argument("--engine", help="llama.cpp, vllm, or auto (the hybrid endpoint: llama.cpp at once, vLLM "
                                         "when the load makes it pay; see --auto-*) (or give --config)")
    parser.add_argument("--model", help="`demo`, a GGUF file, or a Hugging Face folder (or give --config)")
    parser.add_argument("--config", metavar="MODELS_YAML",
                        help="serve several models behind the endpoint: a YAML list of entries name, engine, "
                             "model, ctx, parallel, ttl (seconds idle before unloading), loading_status")
    parser.add_argument("--port", type=N.port_or_free, default=0,
                        help="the port clients use (default: a free one; with --endpoint, the endpoint's default): "
                             "with --endpoint, or a plain serve of vLLM, the endpoint's, and the engine listens on "
                             "a private socket")
    parser.add_argument("engine_args", nargs="*", metavar="-- ENGINE_ARGS",
                        help="after `--`: the engine's own flags, read as the engine reads them (vLLM and "
                             "llama-server take `_` for `-`). The fit counts --n-cpu-moe/--cpu-moe/-ctk/-ctv and the "
                             "expert tensors an -ot rule sends to the CPU (llama.cpp; the rule stays as typed), "
                             "--cpu-offload-gb/--kv-cache-dtype (vLLM); flags the plan owns (-c, -ngl, --port, "
                             "--max-model-len ...) are refused naming the option to use; the rest pass through, "
                             "named in the fit's notes as not accounted")
    parser.add_argument("--no-key", action="store_true",
                        help="plain serve: start the engine without its per-launch API key (any local process and "
                             "web page that finds the port can then use it)")
    parser.add_argument("--ctx", type=N.count, default=DEFAULT_CTX_PER_REQUEST,
                        help="context tokens per request (vLLM --max-model-len; llama.cpp's -c is ctx x parallel)")
    parser.add_argument("--parallel", type=N.count, default=DEFAULT_SLOTS,
                        help="requests at once (llama.cpp slots / vLLM max_num_seqs)")
    plan = parser.add_argument_group("launch plan (default: what the fit finds on this machine)")
    plan.add_argument("--gpu-layers", type=N.non_negative, help="llama.cpp -ngl (default: as many as fit)")
    plan.add_argument("--kv-type", help="KV cache type: llama.cpp f16/q8_0/q4_0..., vLLM auto/fp8")
    plan.add_argument("--util", type=N.fraction, help=f"vLLM gpu_memory_utilization (default {DEFAULT_VLLM_UTILIZATION}, "
                                                       "or less when other processes hold GPU memory)")
    plan.add_argument("--tp", type=N.count, help="vLLM tensor-parallel size (default 1)")
    plan.add_argument("--dtype", help="vLLM --dtype (default auto: the checkpoint's)")
    plan.add_argument("--tool-parser", metavar="NAME",
                      help="vLLM tool-call parser, or none (default: the model's own, from its chat template)")
    plan.add_argument("--reasoning-parser", metavar="NAME",
                      help="vLLM reasoning parser, or none; llama.cpp then splits reasoning out (default: the model's own)")
    plan.add_argument("--no-prefix-cache", action="store_true",
                      help="turn the engines' prefix cache off (on by default: a request that repeats a prompt's "
                           "start reuses its KV; llama.cpp --no-cache-prompt --cache-ram 0, vLLM "
                           "--no-enable-prefix-caching)")
    plan.add_argument("--hardware", help="plan for a snapshot from `switchyard detect --json` instead of this machine")
    plan.add_argument("--dry-run", action="store_true",
                      help="print the checked plan, the exact argv and env, and the memory breakdown; start nothing")
    parser.add_argument("--prompt", help="stream one completion for this prompt, print phase times, then stop")
    parser.add_argument("--max-tokens", type=N.count, default=32)
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing a missing engine")
    parser.add_argument("--ready-timeout", type=N.seconds, default=DEFAULT_READY_TIMEOUT)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    endpoint = parser.add_argument_group("stable endpoint")
    endpoint.add_argument("--endpoint", action="store_true",
                          help=f"serve through the stable endpoint on 127.0.0.1:{DEFAULT_PROXY_PORT}")
    endpoint.add_argument("--proxy-port", type=N.port, help="stable endpoint port (implies --endpoint)")
    endpoint.add_argument("--model-name", default=SERVED_MODEL_NAME, help="the model name clients see")
    endpoint.add_argument("--reasoning-effort", choices=("off", "low", "medium", "high", "auto"), default="auto",
                          help="how much the model thinks where a request does not say (each engine's own "
                               "mechanism; default auto: the model's and engine's default)")
    endpoint.add_argument("--api-key-env", metavar="VAR",
                          help="require this environment variable's value as the endpoint's API key")
    endpoint.add_argument("--wait-timeout", type=N.seconds, default=DEFAULT_WAIT_TIMEOUT,
                          help="how long a request waits for an engine while none is ready (seconds)")
    endpoint.add_argument("--allowed-origins", metavar="ORIGINS",
                          help="web pages allowed to call the endpoint besides local ones: comma-separated "
                               "scheme://host[:port], or * for any (default: the allowed_origins setting)")
    endpoint.add_argument("--first-byte-timeout", type=N.seconds, default=DEFAULT_FIRST_BYTE_TIMEOUT,
                          help="seconds an engine may take before its first response byte (then 504)")
    endpoint.add_argument("--idle-timeout", type=N.seconds, default=DEFAULT_IDLE_TIMEOUT,
                          help="seconds an engine may stay silent mid-answer (then the request is cut)")
    endpoint.add_argument("--standby", metavar="ENGINE", help="also start ENGINE and keep it warm")
    endpoint.add_argument("--vllm-eager", action="store_true",
                          help="vLLM with --enforce-eager whenever it starts here (the first engine, a switch to "
                               "it, the standby, the hybrid's second engine): no torch.compile, so it starts about "
                               "a minute sooner on a CPU, and may serve slower")
    endpoint.add_argument("--keep-standby", action="store_true",
                          help="after a switch keep the old engine warm when memory allows")
    endpoint.add_argument("--failover", action="store_true",
                          help="when the active engine dies, move to the warm standby")
    endpoint.add_argument("--capture-bodies", action="store_true",
                          help="keep request and response bodies in the request log (`switchyard requests`); "
                               "not with --api-key-env")
    endpoint.add_argument("--auto-fit", action="store_true",
                          help="when an engine fails to load for lack of memory, retry once with the fit's next "
                               "smaller plan (and say what changed)")
    endpoint.add_argument("--drain-timeout", type=N.seconds, default=DEFAULT_DRAIN_TIMEOUT,
                          help="how long a switch lets in-flight requests finish before ending them with a "
                               "retryable error (seconds)")
    auto = parser.add_argument_group("hybrid endpoint (--engine auto)")
    auto.add_argument("--auto-window", type=N.seconds, metavar="S",
                      help="sustained load: in-flight p95 over this many seconds (default 300)")
    auto.add_argument("--auto-idle", type=N.seconds, metavar="S",
                      help="retire vLLM after this many seconds at low load (default 600)")
    auto.add_argument("--auto-crossover", type=N.count, metavar="C",
                      help="force the crossover at C requests in flight (demos, tests; default: this machine's measurements)")
    auto.add_argument("--auto-lifetime", type=N.seconds, metavar="S",
                      help="how long this service is expected to run (default: unknown, vLLM may pay back)")
    auto.add_argument("--auto-tick", type=N.seconds, metavar="S", help="how often the policy decides (default 1)")
    parser.set_defaults(func=cmd_serve)

    status = subparsers.add_parser("status", help="show the running stable endpoint and its engines")
    status.add_argument("--port", type=N.port, help="which endpoint, when several run")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)

    switch = subparsers.add_parser("switch", help="move the running endpoint to another engine, without "
                                                  "failing requests")
    switch.add_argument("--to", required=True, metavar="ENGINE", help="llama.cpp or vllm")
    switch.add_argument("--model", help="model for the new engine (default: the one served now)")
    switch.add_argument("--name", help="which model of a --config endpoint to switch")
    switch.add_argument("--port", type=N.port, help="which endpoint, when several run")
    switch.add_argument("--dry-run", action="store_true",
                        help="ask the running endpoint which checked plan (argv, env) it would start; start nothing")
    switch.add_argument("--json", action="store_true", help="machine-readable output")
    switch.set_defaults(func=cmd_switch)

    stop = subparsers.add_parser("stop", help="stop the running endpoint and its engines")
    stop.add_argument("--port", type=N.port, help="which endpoint, when several run")
    stop.add_argument("--json", action="store_true", help="machine-readable output")
    stop.set_defaults(func=cmd_stop)


class _Terminate(Exception):
    pass


def _hardware(args: argparse.Namespace) -> HardwareSnapshot:
    """The machine the plans are checked against: --hardware SNAPSHOT, or this one now."""
    from desktop.core.machine.hardware import HardwareSnapshot, detect

    return HardwareSnapshot.load(args.hardware) if args.hardware else detect()


def plan_asks(args: argparse.Namespace) -> dict[str, Any]:
    """The plan fields the flags set (unset flags leave the choice to the planner)."""
    from desktop.core.planning.planner import asks

    wanted = asks(ctx_per_request=args.ctx, slots=args.parallel, gpu_layers=args.gpu_layers,
                  kv_cache_type=args.kv_type, gpu_memory_utilization=args.util, tensor_parallel=args.tp,
                  dtype=args.dtype, port=args.port or None, tool_parser=args.tool_parser,
                  reasoning_parser=args.reasoning_parser,
                  prefix_cache=False if getattr(args, "no_prefix_cache", False) else None,
                  eager=True if getattr(args, "vllm_eager", False) and args.engine == "vllm" else None)
    engine_args = getattr(args, "engine_args", None) or []
    if engine_args:
        from desktop.core.engines import get_adapter
        from desktop.core.engines.engine_args import plan_fields_from_args

        if not args.engine or args.engine == "auto":
            raise SwitchyardError("engine flags after `--` belong to one engine", "give --engine llama.cpp or vllm")
        fields = plan_fields_from_args(get_adapter(args.engine).name, engine_args)
        both = sorted(set(fields) & set(wanted))
        if both:
            raise SwitchyardError(f"{both[0]} is set twice: by an option and by an engine flag", "keep one")
        wanted.update(fields)
    return wanted


def _vllm_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """What every start of vLLM by this endpoint asks besides the plan (`--vllm-eager`)."""
    return {"vllm": {"eager": True}} if getattr(args, "vllm_eager", False) else {}


def checked_plan(args: argparse.Namespace, hardware: HardwareSnapshot) -> Checked:
    """The planner's checked plan for the flags on `hardware`, or its refusal (one line with the fix)."""
    from desktop.core.planning.planner import plan_launch

    checked = plan_launch(args.engine, args.model, hardware, plan_asks(args), progress=stderr_progress)
    if not getattr(args, "dry_run", False):  # a dry run prints them with the plan
        for note in checked.fit.notes:
            print(f"note: {note}", file=sys.stderr)
    return checked


def _print_described(described: dict[str, Any], as_json: bool, name: str | None = None) -> None:
    if not as_json:
        print_described(described, name)


def cmd_serve(args: argparse.Namespace) -> int:
    from desktop.core.common import unixhttp
    from desktop.core.engines import get_adapter, require_install
    from desktop.core.runtime.launches import record_launch
    from desktop.core.runtime.ports import ensure_port_free
    from desktop.core.runtime.supervisor import EngineProcess, reap_orphans, start_ready
    from desktop.core.serving import control

    # Validate everything cheap before anything slow starts.
    if args.config is not None:
        if args.engine_args:
            raise SwitchyardError("engine flags after `--` go with one model", "put them in models.yaml as `args:`")
        if args.no_prefix_cache:
            raise SwitchyardError("--no-prefix-cache goes with one model", "put `prefix_cache: false` in its "
                                  "models.yaml entry")
        if args.engine or args.model or args.prompt is not None or args.standby:
            raise SwitchyardError("--config takes the engines and models from the file",
                                  "drop --engine/--model/--prompt/--standby, or drop --config")
        return _serve_fleet(args)
    if not args.engine or not args.model:
        raise SwitchyardError("say what to serve: --engine and --model", "or --config models.yaml for several")
    if args.engine == "auto":
        return _serve_auto(args)
    _no_auto_flags(args)
    adapter = get_adapter(args.engine)
    plan_asks(args)  # an unknown setting fails before the model resolves
    if args.dry_run:
        described = checked_plan(args, _hardware(args)).describe()
        if args.json:
            emit_json(described)
        _print_described(described, args.json)
        return 0
    if (args.endpoint or args.proxy_port is not None) and args.prompt is None:
        return _serve_endpoint(args, adapter)
    if adapter.unguarded_routes and args.prompt is None:
        if not args.no_key:  # the engine's key would leave routes open on TCP: the keyed endpoint takes the port
            return _serve_endpoint(args, adapter, keyed_port=True)
        print(f"warning: --no-key puts {adapter.display_name} itself on TCP with no key: "
              f"{', '.join(adapter.unguarded_routes)} and /v1 answer any local process, and web pages by DNS "
              "rebinding", file=sys.stderr)
    if args.port:
        ensure_port_free(args.port)
    plan = checked_plan(args, _hardware(args)).plan  # refuse before installing anything
    install = require_install(adapter, install_missing=not args.no_install, progress=stderr_progress)
    reap_orphans()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise _Terminate(signum)

    previous = signal.signal(signal.SIGTERM, on_signal)
    # Clients talk to a plain serve's engine itself: TCP, guarded by a per-launch key (printed once, kept in the
    # 0600 discovery file). `--prompt` talks to it from here only: a private Unix socket where there are any.
    if not args.no_key:
        import secrets
        from dataclasses import replace

        plan = replace(plan, api_key=_endpoint_api_key(args) or secrets.token_urlsafe(32))
    engine: EngineProcess | None = None
    discovery = None

    def started(process: EngineProcess) -> None:
        nonlocal engine
        engine = process
        print(f"starting {adapter.display_name} on {unixhttp.describe(process.base_url)} (log: {process.log_path})",
              file=sys.stderr)

    try:  # a crash the adapter knows arguments avoid (a CPU kernel that faults here) is started again at once
        engine = start_ready(lambda p: EngineProcess(adapter, p, install, tcp=args.prompt is None), plan,
                             timeout=args.ready_timeout, first_request=args.prompt is None, on_start=started,
                             say=lambda text: print(f"note: {text}", file=sys.stderr))
        cold = engine.cold_start
        if args.prompt is not None:
            return _prompt_once(args, engine)
        record_launch(engine, args.model, source="serve")
        if args.json:
            emit_json({**_engine_status(engine), "cold_start": cold.to_json()})
        discovery = control.write_discovery(engine.plan.port, engine.base_url, "", kind="engine",
                                            info=_engine_status(engine), api_key=engine.plan.api_key)
        if engine.plan.api_key and not args.api_key_env:
            print(f"API key of this launch (clients send `Authorization: Bearer <key>`; also in {discovery}): "
                  f"{engine.plan.api_key}", file=sys.stderr)
        print(f"ready: {engine.base_url}/v1 serving {plan.model_path.name} as '{plan.served_model_name}' "
              f"(T1 {cold.t1_health_s:.2f} s, first token {cold.t2_first_token_s:.2f} s). "
              "Ctrl-C or `switchyard stop` to stop.", file=sys.stderr)
        stopped = threading.Event()
        engine.subscribe(lambda event: stopped.set() if event.state and event.state.value == "crashed" else None)
        while not stopped.wait(0.5):
            pass
        raise engine.failure()
    except (KeyboardInterrupt, _Terminate):
        print("stopping", file=sys.stderr)
        return 0
    finally:
        if discovery is not None:
            control.remove_discovery(discovery)
        if engine is not None:
            engine.stop()
        signal.signal(signal.SIGTERM, previous)


def _engine_status(engine: EngineProcess) -> dict[str, Any]:
    """What `switchyard status` shows for a plain serve, shaped like an endpoint's status (it has no channel)."""
    return {
        "url": engine.base_url,
        "openai_base_url": f"{engine.base_url}/v1",
        "model_name": engine.plan.served_model_name,
        "state": "serving",
        "active": {"engine": engine.adapter.name, "state": "serving", "pid": engine.pid,
                   "base_url": engine.base_url, "model_path": str(engine.plan.model_path)},
    }


def _prompt_once(args: argparse.Namespace, engine: EngineProcess) -> int:
    from desktop.core.runtime.supervisor import stream_completion

    cold = engine.cold_start
    t0 = time.monotonic() - engine.elapsed()
    sent = time.monotonic() - t0
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    for delta in stream_completion(engine.base_url, args.prompt, max_tokens=args.max_tokens,
                                   model=engine.plan.served_model_name, api_key=engine.plan.api_key):
        if delta.error:
            raise EngineFailed(f"the engine answered with an error: {delta.error}")
        if delta.has_token:
            if first is None:
                first = time.monotonic() - t0
            text.append(delta.text)
            if not args.json:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        if delta.usage:
            usage = delta.usage
    done = time.monotonic() - t0
    result = {
        "engine": engine.adapter.name,
        "engine_version": engine.install.version,
        "model": str(engine.plan.model_path),
        "base_url": engine.base_url,
        "prompt": args.prompt,
        "completion": "".join(text),
        "usage": usage,
        "phases_s": {
            "spawn": 0.0,
            "ready": cold.t1_health_s,
            "request_sent": round(sent, 3),
            "first_token": round(first, 3) if first is not None else None,
            "done": round(done, 3),
        },
        "log_markers_s": cold.markers,
        "page_cache_resident": cold.page_cache_resident,
        "cold_start": cold.to_json(),  # the phases the Serve page's bar shows (supervisor.COLD_START_PHASES)
    }
    if args.json:
        emit_json(result)
    else:
        print()
        phases = result["phases_s"]
        print(f"spawn → ready {phases['ready']:.2f} s → first token {phases['first_token'] or float('nan'):.2f} s "
              f"→ done {phases['done']:.2f} s", file=sys.stderr)
    return 0


# --- the stable endpoint -------------------------------------------------------------------------------------
def _history_store() -> Store | None:
    """Telemetry history in the app's SQLite store; serving goes on without it if it cannot be opened."""
    from desktop.core.storage.history import Store

    try:
        return Store()
    except SwitchyardError as exc:
        print(f"telemetry history disabled: {exc}", file=sys.stderr)
        return None


def _guard_options(args: argparse.Namespace) -> dict[str, Any]:
    """The endpoint's origins (the flag, else the setting) and engine timeouts, checked before anything starts."""
    from desktop.core.common.origins import parse_allowed_origins
    from desktop.core.serving.upstream import Timeouts
    from desktop.core.storage import settings as core_settings

    allowed = parse_allowed_origins([args.allowed_origins]) if args.allowed_origins is not None \
        else core_settings.load().allowed_origins
    return {"allowed_origins": allowed, "timeouts": Timeouts(first_byte=args.first_byte_timeout,
                                                            idle=args.idle_timeout)}


def _endpoint_api_key(args: argparse.Namespace) -> str | None:
    """The key clients must send (--api-key-env), checked with the capture flag before anything starts."""
    api_key: str | None = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise SwitchyardError(f"the environment variable {args.api_key_env} is empty or not set",
                                  "export it with the API key clients must send")
    if api_key and args.capture_bodies:
        raise SwitchyardError("--capture-bodies is not available on an endpoint with an API key",
                              "drop --capture-bodies (or --api-key-env)")
    return api_key


def _ensure_engine(adapter: Any, args: argparse.Namespace, what: str = "") -> None:
    from desktop.core.engines import require_install

    require_install(adapter, install_missing=not args.no_install, what=what, progress=stderr_progress)


class _Endpoint:
    """`serve`'s endpoint: the core's EndpointHost (proxy, history, telemetry, request log, control channel,
    discovery file) and a SIGTERM/Ctrl-C/`switchyard stop` loop around it.

    Made in two steps: the cheap checks (port, API key, origins) before anything slow starts, `open()` after."""

    def __init__(self, args: argparse.Namespace, keyed_port: bool = False) -> None:
        from desktop.core.runtime.ports import ensure_port_free, find_free_port

        self.args = args
        self.keyed_port = keyed_port
        if keyed_port:  # a plain serve's port (--port, default a free one) and a per-launch key
            import secrets

            if args.capture_bodies:
                raise SwitchyardError("--capture-bodies is not available on an endpoint with an API key (a plain "
                                      "serve of this engine has one)", "use `serve --endpoint --capture-bodies`")
            self.port = args.port or find_free_port()
            self.api_key: str | None = _endpoint_api_key(args) or secrets.token_urlsafe(32)
        else:
            self.port = args.proxy_port if args.proxy_port is not None else DEFAULT_PROXY_PORT
            self.api_key = _endpoint_api_key(args)
        ensure_port_free(self.port)
        self.guard = _guard_options(args)

    def open(self, model_name: str) -> ProxyServer:
        from desktop.core.serving.host import EndpointHost

        args = self.args
        self.host = EndpointHost(port=self.port, model_name=model_name, api_key=self.api_key,
                                 wait_timeout=args.wait_timeout, capture_bodies=args.capture_bodies,
                                 store=_history_store(), **self.guard)
        self.telemetry = self.host.telemetry
        self.host.proxy.set_reasoning(getattr(args, "reasoning_effort", "auto"))
        return self.host.proxy

    def run(self, target: EndpointControl, served: Any, announce: str, start: Callable[[], None],
            check: Callable[[], None]) -> int:
        """Serve until stopped; `start` runs in a thread (so `switchyard stop` works while engines load),
        `check` raises when serving cannot go on; `served` (the manager or fleet) stops with the host."""
        host = self.host
        host.control(target)
        host.serve(served)

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            raise _Terminate(signum)

        previous = signal.signal(signal.SIGTERM, on_signal)
        try:
            host.start(api_key=self.api_key)  # in the 0600 discovery file: `switchyard launch` passes it on
            print(f"endpoint listening on {host.proxy.url}/v1 {announce}", file=sys.stderr, flush=True)
            if self.keyed_port and not self.args.api_key_env:
                print(f"API key of this launch (clients send `Authorization: Bearer <key>`; also in "
                      f"{host.discovery}): {self.api_key}", file=sys.stderr, flush=True)
            threading.Thread(target=start, name="switchyard-start", daemon=True).start()
            while not target.stop_requested.wait(0.5):
                check()
            print("stopping", file=sys.stderr, flush=True)
            return 0
        except (KeyboardInterrupt, _Terminate):
            print("stopping", file=sys.stderr, flush=True)
            return 0
        finally:
            signal.signal(signal.SIGTERM, previous)
            host.close()


def _endpoint_ports(args: argparse.Namespace) -> argparse.Namespace:
    """`args` for an endpoint serve: the engines behind it listen on private sockets (never a TCP port, where their
    own routes answer anyone), so `--port` names the endpoint's port, unless `--proxy-port` does."""
    if args.port and args.proxy_port is not None:
        raise SwitchyardError(f"--port {args.port} and --proxy-port {args.proxy_port} both name a port for the "
                              "endpoint: the engines behind it listen on private sockets, not on a port",
                              "give one of them")
    proxy_port = args.proxy_port if args.proxy_port is not None else (args.port or None)
    return argparse.Namespace(**{**vars(args), "port": 0, "proxy_port": proxy_port})


def _serve_endpoint(args: argparse.Namespace, adapter: Any, keyed_port: bool = False) -> int:
    """The endpoint in front of the engine. `keyed_port`: a plain `serve` of an engine whose own key leaves routes
    open (vLLM): the engine stays on its private socket, and the endpoint takes the plain serve's port with a
    per-launch key, printed once and kept in the 0600 discovery file, as a plain serve's engine key is."""
    from desktop.core.machine.hardware import detect
    from desktop.core.planning.planner import replan
    from desktop.core.runtime.supervisor import reap_orphans
    from desktop.core.serving.control import EndpointControl
    from desktop.core.serving.endpoint import EndpointManager, machine_budget

    if not keyed_port:
        args = _endpoint_ports(args)
    endpoint = _Endpoint(args, keyed_port=keyed_port)
    args = argparse.Namespace(**{**vars(args), "port": 0})  # the endpoint has the port; the engine its socket
    hardware = _hardware(args)
    plan = checked_plan(args, hardware).plan  # a bad model or a plan that does not fit fails here
    _ensure_engine(adapter, args)
    standby_plan = None
    if args.standby:  # planned like a switch to it: only the asks every engine shares carry over
        standby_plan = replan(plan, hardware, engine=args.standby, progress=stderr_progress,
                              changes=_vllm_overrides(args).get(args.standby)).plan
        from desktop.core.engines import get_adapter

        _ensure_engine(get_adapter(args.standby), args, " (the standby engine)")
    reap_orphans()
    proxy = endpoint.open(args.model_name)
    manager = EndpointManager(proxy, telemetry=endpoint.telemetry, ready_timeout=args.ready_timeout,
                              keep_standby=args.keep_standby or bool(args.standby), failover=args.failover,
                              budget=machine_budget(hardware), hardware=hardware, auto_fit=args.auto_fit,
                              drain_timeout=args.drain_timeout, redetect=None if args.hardware else detect,
                              engine_overrides=_vllm_overrides(args))
    manager.subscribe(lambda event: _print_event(event, args.json))
    target = EndpointControl(manager)
    failures: list[BaseException] = []

    def start_engines() -> None:
        try:
            cold = manager.start(plan)
            active = manager.active
            print(f"ready: {proxy.url}/v1 serving '{args.model_name}' through {adapter.display_name} "
                  f"(engine pid {active.process.pid if active else None}, T1 {cold.t1_health_s:.2f} s, "
                  f"first token {cold.t2_first_token_s:.2f} s). Ctrl-C or `switchyard stop` to stop.",
                  file=sys.stderr, flush=True)
            if standby_plan is not None:
                print(f"starting the warm standby {standby_plan.engine}", file=sys.stderr, flush=True)
                manager.prepare_standby(standby_plan)
            if args.json:
                emit_json(manager.status())
        except BaseException as exc:  # handed to the main thread, which reports it
            failures.append(exc)

    def check() -> None:
        if failures and not target.stop_requested.is_set():
            raise failures[0]
        if manager.down.is_set():
            raise EngineFailed(f"the endpoint has no engine left: {manager.last_error}",
                               "start it again; add --standby ENGINE --failover to survive an engine crash")

    return endpoint.run(target, manager, f"(model '{args.model_name}'); starting {adapter.display_name}",
                        start_engines, check)


AUTO_FLAGS = ("auto_window", "auto_idle", "auto_crossover", "auto_lifetime", "auto_tick")


def _no_auto_flags(args: argparse.Namespace) -> None:
    given = [name for name in AUTO_FLAGS if getattr(args, name, None) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise SwitchyardError(f"{flag} is a setting of the hybrid endpoint", "add --engine auto, or drop it")


def _serve_auto(args: argparse.Namespace) -> int:
    """`serve --engine auto`: the hybrid endpoint. llama.cpp starts at once (its fast cold start serves the first
    requests); the autopilot loop (serving.autopilot) brings vLLM in when the policy says the load makes it pay,
    hands over with drain and retires it after the idle window. Both plans are checked before anything starts."""
    from desktop.core.engines import get_adapter
    from desktop.core.runtime.supervisor import reap_orphans
    from desktop.core.serving.autopilot import AutopilotSettings, build_autopilot, plan_hybrid, ram_budget
    from desktop.core.serving.control import EndpointControl
    from desktop.core.serving.endpoint import EndpointManager, machine_budget

    if args.prompt is not None or args.standby:
        raise SwitchyardError("--engine auto serves through the stable endpoint and manages both engines itself",
                              "drop --prompt/--standby")
    args = _endpoint_ports(args)
    plan_asks(args)  # an unknown setting fails before the model resolves
    hardware = _hardware(args)
    plans = plan_hybrid(args.model, hardware, plan_asks(args), progress=stderr_progress,
                        hint="serve a smaller model or context (--ctx, --parallel)",
                        other_asks=_vllm_overrides(args).get("vllm"))
    llama, vllm, refused = plans.llama, plans.vllm, plans.refused
    if args.dry_run:
        described = {name: checked.describe() for name, checked in (("llama.cpp", llama), ("vllm", vllm))
                     if checked is not None}
        if args.json:
            emit_json({"engine": "auto", "plans": described, "refused": refused})
        for name, one in described.items():
            _print_described(one, args.json, name)
        for name, why in refused.items():
            if not args.json:
                print(f"{name}: refused: {why}")
        return 0
    endpoint = _Endpoint(args)
    first = plans.first
    _ensure_engine(get_adapter(first.plan.engine), args)
    if plans.other is not None:
        try:
            _ensure_engine(get_adapter("vllm"), args, " (the hybrid's second engine)")
        except SwitchyardError as exc:
            plans = plans.without_vllm(str(exc))
    reap_orphans()
    proxy = endpoint.open(args.model_name)
    budget = machine_budget(hardware) or ram_budget(hardware)
    manager = EndpointManager(proxy, telemetry=endpoint.telemetry, ready_timeout=args.ready_timeout,
                              keep_standby=args.keep_standby, failover=args.failover, budget=budget,
                              hardware=hardware, auto_fit=args.auto_fit, drain_timeout=args.drain_timeout,
                              engine_overrides=_vllm_overrides(args))
    manager.subscribe(lambda event: _print_event(event, args.json))
    store = endpoint.host.store
    settings = AutopilotSettings(**{name: value for name, value in (
        ("window_s", args.auto_window), ("idle_s", args.auto_idle), ("crossover", args.auto_crossover),
        ("lifetime_s", args.auto_lifetime), ("tick_s", args.auto_tick)) if value is not None})
    autopilot = build_autopilot(manager, plans, hardware=hardware, budget=budget,
                                runs=store.runs(limit=500) if store else [], model=args.model, settings=settings,
                                journal=endpoint.host.request_log.note)
    target = EndpointControl(manager)
    failures: list[BaseException] = []

    def start_engines() -> None:
        try:
            cold = manager.start(first.plan)
            print(f"ready: {proxy.url}/v1 serving '{args.model_name}' through {first.plan.engine} (hybrid: "
                  f"T1 {cold.t1_health_s:.2f} s, first token {cold.t2_first_token_s:.2f} s). Ctrl-C or "
                  "`switchyard stop` to stop.", file=sys.stderr, flush=True)
            autopilot.start()
            if args.json:
                emit_json(manager.status())
        except BaseException as exc:  # handed to the main thread, which reports it
            failures.append(exc)

    def check() -> None:
        if failures and not target.stop_requested.is_set():
            raise failures[0]
        if manager.down.is_set():
            raise EngineFailed(f"the endpoint has no engine left: {manager.last_error}", "start it again")

    return endpoint.run(target, manager, f"(model '{args.model_name}'); hybrid: starting {first.plan.engine}",
                        start_engines, check)


def _serve_fleet(args: argparse.Namespace) -> int:
    """`serve --config models.yaml`: every model of the list behind one endpoint, routed by `model`; each entry
    planned and checked before anything starts (`--dry-run` prints those plans)."""
    from desktop.core.engines import get_adapter
    from desktop.core.machine.hardware import detect
    from desktop.core.runtime.supervisor import reap_orphans
    from desktop.core.serving.control import EndpointControl
    from desktop.core.serving.endpoint import machine_budget
    from desktop.core.serving.fleet import Fleet, load_models_config, plan_models

    args = _endpoint_ports(args)
    config = load_models_config(args.config)
    hardware = _hardware(args)
    plans = plan_models(config, hardware, stderr_progress)  # a bad model or a plan that does not fit fails here
    if args.dry_run:
        described = {name: checked.describe() for name, checked in plans.items()}
        if args.json:
            emit_json({"models": described})
        for name, one in described.items():
            _print_described(one, args.json, name)
        return 0
    endpoint = _Endpoint(args)
    for entry in config.models:  # a missing engine fails here, before anything starts
        _ensure_engine(get_adapter(entry.engine), args, f" (for '{entry.name}')")
    reap_orphans()
    proxy = endpoint.open(config.names()[0])
    fleet = Fleet(proxy, config, telemetry=endpoint.telemetry, ready_timeout=args.ready_timeout,
                  drain_timeout=args.drain_timeout, budget=machine_budget(hardware), auto_fit=args.auto_fit,
                  hardware=hardware, plans=plans, redetect=None if args.hardware else detect)
    fleet.subscribe(lambda event: _print_event(event, args.json))

    def preload() -> None:
        try:
            fleet.start()
            print(f"ready: {proxy.url}/v1 serves {', '.join(config.names())}. Ctrl-C or `switchyard stop` "
                  "to stop.", file=sys.stderr, flush=True)
            if args.json:
                emit_json(fleet.status())
        except SwitchyardError as exc:  # that model loads again on its next request
            print(f"a model did not load: {exc}", file=sys.stderr, flush=True)

    return endpoint.run(EndpointControl(fleet), fleet, f"for {', '.join(config.names())}", preload, lambda: None)


def _print_event(event: EndpointEvent, as_json: bool) -> None:
    if not as_json:
        print(f"[{event.state}] {event.message}", file=sys.stderr, flush=True)


def cmd_status(args: argparse.Namespace) -> int:
    from desktop.core.serving import control

    discovery = control.find_instance(args.port)
    data = {"kind": discovery.kind, **control.ControlClient(discovery).status()}
    if args.json:
        emit_json(data)
        return 0
    what = {"app": "app endpoint", "engine": "engine (no stable endpoint)"}.get(data.get("kind", ""), "endpoint")
    print(f"{what} {cell(data['openai_base_url'])}  model '{cell(data['model_name'])}'  state {cell(data['state'])}  "
          f"(pid {cell(data.get('pid'))})")
    for role in ("active", "standby", "starting", "sleeping"):
        engine = data.get(role)
        if engine:
            print(f"  {role:8} {cell(engine['engine']):10} {cell(engine['state']):8} pid {engine['pid']}  "
                  f"{cell(engine['base_url'])}  {cell(engine['model_path'])}")
    for name, model in (data.get("models") or {}).items():
        engine = model.get("active")
        spec = model.get("plan") or {}
        ttl = f"ttl {model['ttl']:g} s" if model.get("ttl") else "no ttl"
        where = f"pid {engine['pid']}  {engine['base_url']}" if engine else "not loaded (loads on its next request)"
        print(f"  model {cell(name):14} {cell(spec.get('engine', '?')):10} {cell(model['state']):9} {cell(where)}  "
              f"({ttl})")
    auto = data.get("autopilot")
    if auto:
        last = auto.get("last") or {}
        print(f"  autopilot {cell(auto['state'])}: {cell(last.get('action', '-'))} — {cell(last.get('reason', 'no decision yet'))}")
    requests = data.get("requests")
    if requests:
        print(f"  requests {requests['requests']} total, {requests['failed']} failed, {requests['inflight']} in flight")
    if data.get("last_error"):
        print(f"  last error: {cell(data['last_error'])}")  # it can quote an engine's log line
    if data.get("capability_check"):  # a crash failover's: not checked yet, or what the standby answered
        print(f"  {cell(data['capability_check'])}")
    for line in capability_lines(data.get("capabilities") or [], {"active": "active", "other": "other"}):
        print(line)
    return 0


def cmd_switch(args: argparse.Namespace) -> int:
    from desktop.core.engines import get_adapter
    from desktop.core.serving import control

    engine = get_adapter(args.to).name  # an unknown engine fails here, clearly
    client = control.ControlClient(control.find_instance(args.port))
    if not args.json and not args.dry_run:
        print(f"switching to {engine}: the new engine starts and must serve before traffic moves", file=sys.stderr)
    if args.dry_run:
        preview = client.switch(engine, args.model, args.name, dry_run=True)
        if args.json:
            emit_json(preview)
        else:
            print(shlex.join(preview["argv"]))
            for key, value in preview["env"].items():
                print(f"  env {key}={value}")
            print(preview["message"])
            for line in capability_lines(preview.get("capabilities") or [], {"active": "now", "target": "after"}):
                print(line)
        return 0
    result = client.switch(engine, args.model, args.name)
    if args.json:
        emit_json(result)
    else:
        how = "warm standby" if result["reused_standby"] else "woke from sleep" if result.get("woke") else "cold start"
        old = "kept warm" if result["old_kept_as_standby"] else "sleeping" if result.get("old_sleeping") else "stopped"
        print(f"switched {result['from_engine']} → {result['to_engine']} in {result['seconds']:.1f} s "
              f"({result.get('kind', 'warm')} switch, {how}); old engine {old}")
        print(f"gap: {result.get('gap_s', 0.0):.1f} s with no engine serving (requests waited at the endpoint)"
              + (f"; {result['cut_requests']} request(s) outlived the drain deadline and got a retryable error"
                 if result.get("cut_requests") else ""))
        if result.get("probed"):
            print(f"the new engine answered what the traffic used before it took over: {', '.join(result['probed'])}")
        if result.get("retried_smaller"):
            print(f"the new engine ran out of memory and was retried with a smaller plan: "
                  f"{result['retried_smaller']}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from desktop.core.serving import control

    discovery = control.find_instance(args.port)
    stopped = control.ControlClient(discovery).stop()
    if args.json:
        emit_json({"stopped": stopped, "pid": discovery.pid, "port": discovery.port})
    elif stopped:
        print(f"stopped the endpoint on port {discovery.port} (pid {discovery.pid})")
    if not stopped:
        raise SwitchyardError(f"the {'engine' if discovery.kind == 'engine' else 'endpoint'} (pid {discovery.pid}) did not exit in time",
                              f"kill it with `kill {discovery.pid}`")
    return 0
