"""What each client needs to reach the endpoint, worked out once from one `Connection` (the endpoint's URL, key,
served model name and the context it serves per request). `switchyard launch` runs agents with these; the Serve
page's "Connect an app" card shows the same lines for copying.

Written by hand from the agents' own documented settings and `ollama launch` (ollama/ollama cmd/launch/claude.go,
codex.go, opencode.go; `../shared/reference/agents.md`): there is no library for this. The endpoint's own
normalisation (serving.normalize: Claude Code's attribution line stripped, `max_tokens` clamped to the context) is
the guarantee; the variables set here (CLAUDE_CODE_ATTRIBUTION_HEADER=0, ...) are a second line."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from desktop.core.common.defaults import SERVED_MODEL_NAME

NO_KEY = "switchyard"  # what a client sends where the endpoint asks for no key (SDKs refuse an empty one)


@dataclass(frozen=True)
class Agent:
    """One coding agent `switchyard launch` knows: its command, how to install it, and the context it needs."""

    name: str  # the word on the command line: claude, codex, opencode
    title: str
    command: str
    install: str  # one line a user runs when the command is missing
    context_needed: int  # tokens per request below which the agent fails or compacts at every step
    why: str  # where that number comes from, said with it
    context_start: int  # what an endpoint `launch` starts serves, where the model and the fit allow: room to work


AGENTS: dict[str, Agent] = {agent.name: agent for agent in (
    Agent("claude", "Claude Code", "claude", "npm install -g @anthropic-ai/claude-code", 25_000,
          "its first request alone is about 24,000 tokens (tools and system prompt)", 32_768),
    Agent("codex", "Codex CLI", "codex", "npm install -g @openai/codex", 64_000,
          "Codex recommends 64,000 tokens for local models", 65_536),
    Agent("opencode", "OpenCode", "opencode", "npm install -g opencode-ai", 64_000,
          "OpenCode recommends 64,000 tokens for local models", 65_536),
)}


@dataclass(frozen=True)
class Connection:
    """How to reach one running endpoint."""

    url: str  # http://127.0.0.1:8800, no /v1
    model: str  # the name clients send ("switchyard" unless --model-name)
    context: int  # tokens per request the serving plan serves
    api_key: str | None = None  # None: the endpoint takes any key

    @property
    def key(self) -> str:
        """What clients send: the endpoint's key, else a placeholder (the SDKs refuse to start without one)."""
        return self.api_key or NO_KEY

    @property
    def openai_base_url(self) -> str:
        return self.url.rstrip("/") + "/v1"

    @property
    def output_budget(self) -> int:
        """The answer length offered to clients that ask for one: a quarter of the context, at most 32,000."""
        return max(256, min(32_000, self.context // 4))


def connection_from_status(status: Mapping[str, Any] | None, api_key: str | None) -> Connection | None:
    """An endpoint's Connection from its status (EndpointManager.status(): what `switchyard status --json` prints,
    `launch` reads and the Serve page shows); None while no engine serves behind it."""
    plan = ((status or {}).get("active") or {}).get("plan") or {}
    if not status or not status.get("url") or not plan:
        return None
    return Connection(url=str(status["url"]), model=str(status.get("model_name") or SERVED_MODEL_NAME),
                      context=int(plan.get("ctx_per_request") or 0), api_key=api_key)


def claude_env(c: Connection) -> dict[str, str]:
    """Claude Code, by environment only (as `ollama launch claude`): the base URL without /v1, the key as a bearer
    token, every model tier and the subagent on the served model, compaction at the served context, and the
    per-request attribution header and token reminder off (each changes the prompt and misses the prefix cache)."""
    return {
        "ANTHROPIC_BASE_URL": c.url.rstrip("/"),
        "ANTHROPIC_AUTH_TOKEN": c.key,
        "ANTHROPIC_API_KEY": "",
        "ANTHROPIC_MODEL": c.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": c.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": c.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": c.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": c.model,
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(c.context),
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_TOTAL_TOKENS_REMINDER": "off",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_FEEDBACK_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    }


CODEX_PROFILE = "switchyard"  # the profile and provider name in Codex's config.toml
CODEX_KEY_ENV = "SWITCHYARD_API_KEY"  # the provider's env_key: the key travels in the environment, not the file


def codex_env(c: Connection) -> dict[str, str]:
    return {CODEX_KEY_ENV: c.key}


def codex_profile_toml(c: Connection, catalog: str) -> str:
    """Codex's profile file (CODEX_HOME/switchyard.config.toml, read by `codex --profile switchyard`; Codex >= 0.17x
    refuses profiles kept inside config.toml): the Responses API (its only wire API since ~0.125), the served
    model, and a model catalog file carrying the served context window."""
    return "\n".join([
        f"model = {json.dumps(c.model)}",
        f"model_provider = {json.dumps(CODEX_PROFILE)}",
        f"model_catalog_json = {json.dumps(catalog)}",
        f"model_context_window = {c.context}",
        "",
        f"[model_providers.{CODEX_PROFILE}]",
        'name = "Switchyard"',
        f"base_url = {json.dumps(c.openai_base_url + '/')}",
        'wire_api = "responses"',
        f"env_key = {json.dumps(CODEX_KEY_ENV)}",
        "",
    ])


def codex_catalog(c: Connection) -> dict[str, object]:
    """Codex's model catalog (`model_catalog_json`) with the one served model and its real context window, in the
    fields `ollama launch codex` writes for Codex >= 0.134."""
    return {"models": [{
        "slug": c.model, "display_name": c.model, "context_window": c.context, "shell_type": "default",
        "visibility": "list", "supported_in_api": True, "priority": 0,
        "truncation_policy": {"mode": "bytes", "limit": 10_000}, "input_modalities": ["text"],
        "base_instructions": "", "support_verbosity": True, "default_verbosity": "low",
        "supports_parallel_tool_calls": False, "supports_reasoning_summaries": False,
        "supported_reasoning_levels": [], "experimental_supported_tools": [],
    }]}


def opencode_config(c: Connection) -> dict[str, object]:
    """OpenCode's provider, inline (OPENCODE_CONFIG_CONTENT, nothing written): the context and output limits, or
    OpenCode takes a context of 0 (no compaction) or reserves 32,000 tokens for the answer."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"switchyard": {
            "npm": "@ai-sdk/openai-compatible", "name": "Switchyard",
            "options": {"baseURL": c.openai_base_url, "apiKey": c.key},
            "models": {c.model: {"name": c.model, "tool_call": True,
                                 "limit": {"context": c.context, "output": c.output_budget}}},
        }},
        "model": f"switchyard/{c.model}",
    }


def opencode_env(c: Connection) -> dict[str, str]:
    return {"OPENCODE_CONFIG_CONTENT": json.dumps(opencode_config(c), separators=(",", ":"))}


def ollama_env(c: Connection) -> dict[str, str]:
    """What Ollama's clients read: the host without /v1 (the endpoint answers Ollama's /api/ routes), and the
    key only where the endpoint asks for one (the official client sends OLLAMA_API_KEY as a bearer token)."""
    return {"OLLAMA_HOST": c.url.rstrip("/"), **({"OLLAMA_API_KEY": c.api_key} if c.api_key else {})}


def generic_env(c: Connection) -> dict[str, str]:
    """What any OpenAI-, Anthropic- or Ollama-speaking tool reads (the official SDKs among them): `launch --env`."""
    return {
        "OPENAI_BASE_URL": c.openai_base_url,
        "OPENAI_API_KEY": c.key,
        "ANTHROPIC_BASE_URL": c.url.rstrip("/"),
        "ANTHROPIC_API_KEY": c.key,
        **ollama_env(c),
        "SWITCHYARD_MODEL": c.model,
    }


def agent_env(agent: str, c: Connection) -> dict[str, str]:
    """The variables `launch AGENT` sets for the agent's process (Codex also gets its profile file)."""
    return {"claude": claude_env, "codex": codex_env, "opencode": opencode_env}[agent](c)


def shell_exports(env: Mapping[str, str]) -> str:
    """`export NAME=value` lines a POSIX shell sources (`eval "$(switchyard launch --env)"`), each value quoted."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())
