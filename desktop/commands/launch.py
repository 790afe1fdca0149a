"""`switchyard launch claude|codex|opencode [--model M] [-- AGENT ARGS]`: a coding agent wired to the endpoint in
one command, as `ollama launch` does for Ollama. It finds the running endpoint (or starts one on the model, with a
context the agent can work in, that keeps serving after the agent exits), checks that the context it serves is
enough for the agent, sets the agent's variables (and Codex's profile file, kept apart and undone by
`--restore`), and runs the agent in its place. `launch --env` prints the variables for any OpenAI- or
Anthropic-speaking tool instead (`eval "$(switchyard launch --env)"`)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from desktop.commands import _numbers as N
from desktop.core.agents.clients import AGENTS, Agent, Connection
from desktop.core.common.errors import SwitchyardError

LAUNCH_SLOTS = 1  # an agent asks one thing at a time; one slot gives it the whole context (the endpoint queues)
READY_POLL_S = 0.25  # how often the endpoint's log is read while it starts (another process: nothing to wait on)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "launch", help="run Claude Code, Codex or OpenCode against the endpoint (or print the variables: --env)",
        description="Run a coding agent wired to the stable endpoint: its base URL, key, model and the context the "
                    "endpoint serves. Starts the endpoint first when none runs (it keeps serving afterwards).")
    parser.add_argument("agent", nargs="?", choices=sorted(AGENTS), help="the agent to run")
    parser.add_argument("--model", help="the model to serve when no endpoint runs (`demo`, a GGUF, a Hub repo)")
    parser.add_argument("--engine", help="engine for an endpoint launch starts (default: the recommended one)")
    parser.add_argument("--ctx", type=N.count, help="context per request for an endpoint launch starts (default: "
                                                    "what the agent needs, where the fit allows it)")
    parser.add_argument("--port", type=N.port, help="which endpoint; for a new one, its port (default 8800)")
    parser.add_argument("--env", action="store_true",
                        help="print `export` lines for OpenAI/Anthropic clients (and the agent's, if named)")
    parser.add_argument("--restore", action="store_true", help="undo the config file launch wrote for the agent")
    parser.add_argument("--ready-timeout", type=N.seconds, default=1800.0,
                        help="how long to wait for an endpoint launch starts (default 1800 s)")
    parser.add_argument("agent_args", nargs="*", metavar="-- AGENT_ARGS",
                        help="after `--`: passed to the agent as they are")
    parser.set_defaults(func=cmd_launch, passthrough="agent_args")


def cmd_launch(args: argparse.Namespace) -> int:
    agent = AGENTS[args.agent] if args.agent else None
    if args.restore:
        return _restore(agent)
    if agent is None and not args.env:
        raise SwitchyardError("name the agent to launch", f"one of {', '.join(sorted(AGENTS))}, or --env for the "
                                                          "variables of any OpenAI or Anthropic client")
    binary = None if args.env or agent is None else agent_binary(agent)
    discovery, started = _endpoint(args, agent)
    connection = connection_of(discovery)
    if agent is not None:
        _check_context(agent, connection, discovery, args)
    from desktop.core.agents import clients

    if args.env:
        env = {**clients.generic_env(connection), **(clients.agent_env(agent.name, connection) if agent else {})}
        sys.stdout.write(clients.shell_exports(env))
        return 0
    assert agent is not None and binary is not None
    argv = [str(binary), *_agent_options(agent, connection), *args.agent_args]
    print(f"launching {agent.title} on {connection.url} (model '{connection.model}', {connection.context:,} tokens "
          "per request)", file=sys.stderr)
    if started:
        print(f"the endpoint launch started keeps serving after {agent.title} exits: `switchyard stop --port "
              f"{discovery.port}` stops it", file=sys.stderr)
    return _run(argv, {**os.environ, **clients.agent_env(agent.name, connection)})


def agent_binary(agent: Agent) -> Path:
    """The agent's executable: on PATH, or where its own installer puts it; one line with the install command if
    it is nowhere."""
    found = shutil.which(agent.command)
    if found:
        return Path(found)
    home = Path.home()
    for fallback in {"claude": [home / ".local" / "bin" / "claude", home / ".claude" / "local" / "claude"],
                     "opencode": [home / ".opencode" / "bin" / "opencode"]}.get(agent.name, []):
        if fallback.is_file() and os.access(fallback, os.X_OK):
            return fallback
    raise SwitchyardError(f"{agent.title} is not installed (no `{agent.command}` on PATH): {agent.install}")


def _restore(agent: Agent | None) -> int:
    if agent is None:
        raise SwitchyardError("name the agent whose config to restore", "switchyard launch codex --restore")
    if agent.name != "codex":
        print(f"nothing to restore: launch {agent.name} sets environment variables only and writes no file",
              file=sys.stderr)
        return 0
    from desktop.core.agents import codex_home

    print(codex_home.restore(codex_home.codex_home()), file=sys.stderr)
    return 0


def _agent_options(agent: Agent, connection: Connection) -> list[str]:
    """What goes before the user's own arguments: Codex's profile (written here, with its catalog)."""
    if agent.name == "claude":
        return ["--model", connection.model]
    if agent.name == "codex":
        from desktop.core.agents import codex_home
        from desktop.core.agents.clients import CODEX_PROFILE

        files = codex_home.write(connection, codex_home.codex_home())
        note = f" (yours is kept as {files.backup})" if files.backup else ""
        print(f"wrote Codex's `{CODEX_PROFILE}` profile, {files.profile}{note}; `switchyard launch codex --restore` "
              "undoes it", file=sys.stderr)
        return ["--profile", CODEX_PROFILE, "-c", f'model_catalog_json="{files.catalog}"']
    return []


def _run(argv: list[str], env: dict[str, str]) -> int:
    """The agent in this process's place (POSIX), so its exit code, signals and terminal are the user's."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execve(argv[0], argv, env)  # noqa: S606 - the agent's own binary, no shell
    return subprocess.run(argv, env=env, check=False).returncode  # noqa: S603


# --- the endpoint ---------------------------------------------------------------------------------------------
def _endpoint(args: argparse.Namespace, agent: Agent | None) -> tuple[Any, bool]:
    """(discovery, started): the running endpoint, else one started now on --model."""
    from desktop.core.serving import control

    running = [d for d in control.find_instances() if d.kind != "engine" and (args.port is None or d.port == args.port)]
    if len(running) > 1:
        ports = ", ".join(str(d.port) for d in running)
        raise SwitchyardError(f"several Switchyard endpoints are running (ports {ports})", "say which with --port")
    if running:
        discovery = running[0]
        if args.model and args.model != _served_model(discovery):
            raise SwitchyardError(f"the endpoint on port {discovery.port} serves {_served_model(discovery)}, not "
                                  f"{args.model}", f"switch it (`switchyard switch --to ENGINE --model {args.model} "
                                  f"--port {discovery.port}`), or drop --model to use what it serves")
        _wait_serving(discovery, args.ready_timeout)
        return discovery, False
    if not args.model:
        raise SwitchyardError("no Switchyard endpoint is running, and launch needs a model to start one",
                              "give --model (`demo`, a GGUF file, or a downloaded Hub model such as "
                              "org/name:Q4_K_M), or start the endpoint yourself")
    return _start_endpoint(args, agent), True


def _served_model(discovery: Any) -> str:
    from desktop.core.serving.control import ControlClient

    plan = (ControlClient(discovery).status().get("active") or {}).get("plan") or {}
    return str(plan.get("model") or "nothing yet")


def _wait_serving(discovery: Any, timeout: float) -> None:
    """Until the endpoint has an engine serving (it may still be loading one)."""
    from desktop.core.serving.control import ControlClient

    client, deadline, pause = ControlClient(discovery), time.monotonic() + timeout, threading.Event()
    while True:
        status = client.status()
        if status.get("active"):
            return
        idle = discovery.kind == "app" and not status.get("starting")  # the app waits for a click, not for us
        if idle or status.get("state") == "down" or time.monotonic() > deadline:
            raise SwitchyardError(f"the endpoint on port {discovery.port} has no engine serving "
                                  f"({status.get('last_error') or status.get('state')})",
                                  "start a model on the app's Serve page" if idle else
                                  "`switchyard status` says why; start it again")
        pause.wait(READY_POLL_S)


def _start_endpoint(args: argparse.Namespace, agent: Agent | None) -> Any:
    """`switchyard serve --endpoint` on --model in its own session (it outlives launch and the agent), its log in
    the logs folder; returns its discovery once it serves."""
    from desktop._frozen import self_command
    from desktop.core.common import paths
    from desktop.core.common.defaults import DEFAULT_PROXY_PORT

    engine = args.engine or _recommended_engine(args.model)
    ctx = args.ctx or _context_for(agent, engine, args.model)
    port = args.port or DEFAULT_PROXY_PORT
    log = paths.logs_dir() / f"launch-endpoint-{port}.log"
    argv = [*self_command(), "serve", "--endpoint", "--engine", engine, "--model", args.model,
            "--proxy-port", str(port), "--parallel", str(LAUNCH_SLOTS), *(["--ctx", str(ctx)] if ctx else [])]
    print(f"starting the endpoint: switchyard {' '.join(argv[len(self_command()):])} (log: {log})",
          file=sys.stderr)
    with open(log, "w") as out:  # noqa: PTH123
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,  # noqa: S603
                                start_new_session=True)
    try:
        return _ready(proc, log, port, args.ready_timeout)
    except BaseException:  # Ctrl-C or a failed start: an endpoint nobody got to use is not left behind
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: serve stops its engines on the way out
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise


def _ready(proc: subprocess.Popen[bytes], log: Path, port: int, timeout: float) -> Any:
    """The started endpoint's discovery once its log says `ready:`; its exit or the timeout, as an error."""
    from desktop.core.serving import control

    deadline, pause = time.monotonic() + timeout, threading.Event()
    while True:
        text = log.read_text(errors="replace")
        if any(line.startswith("ready:") for line in text.splitlines()):
            return control.find_instance(port)
        if proc.poll() is not None:
            tail = "\n".join(text.splitlines()[-8:])
            raise SwitchyardError(f"the endpoint did not start (exit {proc.returncode}); its log ends:\n{tail}",
                                  f"the whole log: {log}")
        if time.monotonic() > deadline:
            raise SwitchyardError(f"the endpoint did not serve within {timeout:.0f} s", f"its log: {log}")
        pause.wait(READY_POLL_S)


def _recommended_engine(model: str) -> str:
    from desktop.core.machine.hardware import detect
    from desktop.core.models.facts import facts_for
    from desktop.core.planning.recommend import Workload, recommend

    return recommend(facts_for(model), detect(), Workload(concurrency=1, prompt_len=25_000, output_len=1024)).engine


def _context_for(agent: Agent | None, engine: str, model: str) -> int | None:
    """The context a new endpoint serves: the agent's working room (`context_start`), within the model's window
    and what the fit allows with one request at a time; None where even the agent's need does not fit (serve's
    default then, and the check after the start says why)."""
    if agent is None:
        return None
    from desktop.core.agents.context_room import largest_context
    from desktop.core.machine.hardware import detect
    from desktop.core.models.facts import facts_for

    window = facts_for(model).context_length
    target = min(agent.context_start, window)
    if target < agent.context_needed:
        return None
    largest = largest_context(engine, model, detect(), LAUNCH_SLOTS, target)
    return min(target, largest) if largest is not None and largest >= agent.context_needed else None


def connection_of(discovery: Any) -> Connection:
    from desktop.core.agents.clients import connection_from_status
    from desktop.core.serving.control import ControlClient

    connection = connection_from_status(ControlClient(discovery).status(), discovery.api_key)
    if connection is None:
        raise SwitchyardError(f"the endpoint on port {discovery.port} stopped serving", "`switchyard status` says why")
    return connection


def _check_context(agent: Agent, connection: Connection, discovery: Any, args: argparse.Namespace) -> None:
    """Refuse before the agent starts when the served context is below its need, saying what would fit."""
    from desktop.core.agents.context_room import judge, largest_context

    if connection.context >= agent.context_needed:
        return
    from desktop.core.machine.hardware import detect
    from desktop.core.models.facts import facts_for
    from desktop.core.serving.control import ControlClient

    plan = (ControlClient(discovery).status().get("active") or {}).get("plan") or {}
    model = str(plan.get("model") or "")
    facts = facts_for("demo" if model == "demo" else str(plan.get("model_path") or model))
    window = facts.context_length
    largest = None
    if window >= agent.context_needed:
        largest = largest_context(str(plan.get("engine")), model, detect(), int(plan.get("slots") or 1), window,
                                  model_path=Path(str(plan.get("model_path"))), facts=facts)
    verdict = judge(agent, connection.context, f"'{model}'", window, largest)
    hint = None
    if largest is not None and largest >= agent.context_needed:
        hint = (f"`switchyard stop --port {discovery.port}`, then `switchyard launch {agent.name} --model {model} "
                f"--ctx {min(agent.context_start, largest)}`")
    raise SwitchyardError(verdict.message, hint)
