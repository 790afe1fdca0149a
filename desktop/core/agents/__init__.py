"""Clients wired to the endpoint: what each coding agent (Claude Code, Codex CLI, OpenCode) and each plain
OpenAI/Anthropic client needs to reach it (base URL, key, model, the context it is served), as environment
variables and config files. One source for `switchyard launch` and the Serve page's "Connect an app" card."""
