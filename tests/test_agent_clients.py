"""The conformance suite (issues 34 and 55): what clients send, through the official openai and anthropic client
libraries, to the stable endpoint on the demo model, on the real llama-server and then, after `switchyard switch
--to vllm` under a small concurrent load, on the real vLLM (CPU build). Each ROW is one thing clients do; each runs
on both engines, and the suite writes which rows pass on which engine to docs/conformance.md (README links it).

Where the engines differ by design, the row holds each engine's own expected answer and says why, from the
engine's source, in the table. Expected values come from outside the code under test: the SDKs' own parsing
(`parse` raises on JSON that does not fit the model), llama.cpp's grammar rule for whitespace
(common/json-schema-to-grammar.cpp SPACE_RULE), the engines' own refusals.

Before plans carried a tool-call parser, every tools request was a 400 on vLLM ('"auto" tool choice requires
--enable-auto-tool-choice and --tool-call-parser to be set'); before vLLM was launched with compact JSON, a weak
model spent its whole budget inside whitespace (`{\\t\\n"city"\\t\\n\\n...`) and `parse` failed."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest
from conftest import run_cli, serve_until_ready
from pydantic import BaseModel, Field

from desktop.core.runtime.ports import find_free_port

ENGINES = ("llama.cpp", "vllm")
DOC = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city now",
                     "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# An agent's second turn: its own tool call (content null) and the tool's answer.
SECOND_TURN = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
PICK = [{"role": "user", "content": "Pick a colour, a count and a short name."}]
# llama.cpp's whitespace between JSON tokens (common/json-schema-to-grammar.cpp: SPACE_RULE =
# `| " " | "\n"{1,2} [ \t]{0,20}`): nothing, one space, or one or two newlines and up to 20 spaces or tabs.
LLAMA_SPACE = re.compile(r"(?: |\n{1,2}[ \t]{0,20})?")
MISSING_REF = {"name": "broken", "schema": {"$ref": "#/$defs/missing"}}
LOOKBEHIND = {"name": "word", "schema": {"type": "object", "properties": {"a": {"type": "string",
                                                                                "pattern": "(?<=a)b"}},
                                         "required": ["a"]}}
ENGINE_NAMES = {"llama.cpp": "llama-server", "vllm": "vLLM"}


class Pick(BaseModel):
    """A schema whose answer closes within the budget on a model with random weights: an enum, a bounded
    integer and a short string."""

    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    name: str = Field(max_length=8)


@dataclass
class Clients:
    base: str
    engine: str
    http: httpx.Client
    chat: openai.OpenAI
    messages: anthropic.Anthropic


@dataclass
class Row:
    title: str
    run: Callable[[Clients], str]  # raises when the row fails; returns what the table shows
    why: dict[str, str] = field(default_factory=dict)  # engine -> why it answers differently (its source)


def whitespace_runs(text: str) -> list[str]:
    """The whitespace between the JSON tokens of `text` (outside strings), one entry per run."""
    runs, run, in_string, escaped = [], "", False, False
    for char in text:
        if in_string:
            in_string = escaped or char != '"'
            escaped = not escaped and char == "\\"
        elif char in " \t\n\r":
            run += char
        else:
            if run:
                runs.append(run)
            run, in_string = "", char == '"'
    return [*runs, run] if run else runs


def _compact(engine: str, content: str) -> str:
    """JSON as compact as the engine's grammar allows: vLLM none at all (launched with disable_any_whitespace),
    llama-server at most its SPACE rule between tokens."""
    runs = whitespace_runs(content)
    if engine == "vllm":
        assert runs == [], content
        return "no whitespace"
    assert all(LLAMA_SPACE.fullmatch(run) for run in runs), content
    return f"{len(runs)} gaps within llama.cpp's space rule"


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_real_llama_server_takes_the_reasoning_format_a_reasoning_plan_gives_it(llama_install: Any,
                                                                                     demo_model: Any) -> None:
    asked = ("serve", "--engine", "llama.cpp", "--model", "demo", "--reasoning-parser", "deepseek_r1")
    planned = run_cli(*asked, "--dry-run", "--json")
    assert planned.returncode == 0, planned.stderr
    argv = json.loads(planned.stdout)["argv"]
    assert argv[argv.index("--reasoning-format") + 1] == "deepseek"
    served = run_cli(*asked, "--prompt", "Hi", "--max-tokens", "4", "--json")
    assert served.returncode == 0, served.stderr  # llama-server refuses a --reasoning-format it does not know
    assert json.loads(served.stdout)["usage"]["completion_tokens"] == 4


# --- the rows --------------------------------------------------------------------------------------------------
def chat_tools(c: Clients) -> str:
    whole = c.chat.chat.completions.create(model="switchyard", messages=ASK, tools=[WEATHER],  # type: ignore[arg-type, list-item]
                                           max_tokens=8, temperature=0)
    assert whole.choices and whole.choices[0].message.role == "assistant", whole
    return f"finish {whole.choices[0].finish_reason}"


def chat_tools_stream(c: Clients) -> str:
    chunks = list(c.chat.chat.completions.create(model="switchyard", messages=ASK, tools=[WEATHER],  # type: ignore[arg-type, list-item]
                                                 max_tokens=8, temperature=0, stream=True))
    finished = [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason]
    assert finished, chunks[-1:]
    return f"{len(chunks)} chunks, finish {finished[-1]}"


def tool_result_turn(c: Clients) -> str:
    second = c.chat.chat.completions.create(model="switchyard", messages=SECOND_TURN, tools=[WEATHER],  # type: ignore[arg-type, list-item]
                                            max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls"), second
    return f"finish {second.choices[0].finish_reason}"


def messages_tools(c: Clients) -> str:
    answer = c.messages.messages.create(model="switchyard", max_tokens=8, tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
                                        messages=ASK)  # type: ignore[arg-type]
    assert answer.type == "message" and answer.role == "assistant", answer
    return f"stop_reason {answer.stop_reason}"


def messages_stream(c: Clients) -> str:
    with c.messages.messages.stream(model="switchyard", max_tokens=8, tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
                                    messages=ASK) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.stop_reason in ("max_tokens", "end_turn", "tool_use"), final
    return f"stop_reason {final.stop_reason}"


def json_schema(c: Clients) -> str:
    answer = c.chat.chat.completions.parse(model="switchyard", messages=PICK, response_format=Pick,  # type: ignore[arg-type]
                                           max_tokens=64, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pick), choice
    return f"parsed; {_compact(c.engine, choice.message.content or '')}"


def json_schema_stream(c: Clients) -> str:
    with c.chat.chat.completions.stream(model="switchyard", messages=PICK, response_format=Pick,  # type: ignore[arg-type]
                                        max_tokens=64, temperature=0) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pick), choice
    return f"parsed; {_compact(c.engine, choice.message.content or '')}"


def json_object(c: Clients) -> str:
    answer = c.chat.chat.completions.create(model="switchyard", messages=PICK, max_tokens=64, temperature=0,  # type: ignore[arg-type]
                                            response_format={"type": "json_object"})
    content = answer.choices[0].message.content or ""
    assert isinstance(json.loads(content), dict), content
    return f"a JSON object; {_compact(c.engine, content)}"


def _refused(c: Clients, schema: dict[str, Any], stream: bool) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        answer = c.chat.chat.completions.create(
            model="switchyard", messages=PICK, max_tokens=8, stream=stream,  # type: ignore[arg-type, call-overload]
            response_format={"type": "json_schema", "json_schema": schema})
        if stream:
            list(answer)
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error", error
    assert error["param"] == "response_format" and ENGINE_NAMES[c.engine] in error["message"], error
    return error["message"].split("could not use it as a constraint: ", 1)[-1]


def schema_refused(c: Clients) -> str:
    reason = _refused(c, MISSING_REF, stream=False)
    assert _refused(c, MISSING_REF, stream=True) == reason  # vLLM streams its refusal as a 200 event
    return f"400 (whole and streamed): {reason}"


def lookbehind_pattern(c: Clients) -> str:
    if c.engine == "vllm":
        return f"400: {_refused(c, LOOKBEHIND, stream=False)}"
    answer = c.chat.chat.completions.create(model="switchyard", messages=PICK, max_tokens=8,  # type: ignore[arg-type]
                                            response_format={"type": "json_schema", "json_schema": LOOKBEHIND})
    return f"200, compiled (finish {answer.choices[0].finish_reason})"


def responses_whole(c: Clients) -> str:
    answer = c.chat.responses.create(model="switchyard", input="Say hi", max_output_tokens=16)
    assert answer.object == "response" and answer.status in ("completed", "incomplete"), answer
    assert answer.output_text, answer
    return f"status {answer.status}"


def responses_stream(c: Clients) -> str:
    events = [event.type for event in c.chat.responses.create(model="switchyard", input="Say hi",
                                                              max_output_tokens=16, stream=True)]
    assert events[0] == "response.created" and "response.output_text.delta" in events, events
    assert events[-1] in ("response.completed", "response.incomplete"), events
    return f"{len(events)} events, last {events[-1]}"


def responses_json_schema(c: Clients) -> str:
    answer = c.chat.responses.parse(model="switchyard", input="Pick a colour, a count and a short name.",
                                    text_format=Pick, max_output_tokens=64)
    assert isinstance(answer.output_parsed, Pick), answer
    return f"parsed; {_compact(c.engine, answer.output_text)}"


def unknown_model(c: Clients) -> str:
    answer = c.chat.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=4)  # type: ignore[arg-type]
    assert answer.model == "switchyard", answer  # the answer says which model answered
    return "answered by the served model, `model` says which"


def over_long_prompt(c: Clients) -> str:
    long = [{"role": "user", "content": "hello " * 1000}]  # ~3,000 tokens: over the 2,048 served, within the 4,096 window
    with pytest.raises(openai.BadRequestError) as chat_error:
        c.chat.chat.completions.create(model="switchyard", messages=long, max_tokens=4)  # type: ignore[arg-type]
    body = chat_error.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded", body
    assert "--ctx" in body["message"], body
    with pytest.raises(anthropic.BadRequestError) as messages_error:
        c.messages.messages.create(model="switchyard", max_tokens=4, messages=long)  # type: ignore[arg-type]
    assert messages_error.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        c.chat.responses.create(model="switchyard", input="hello " * 1000, max_output_tokens=4)
    return "400 context_length_exceeded (chat), invalid_request_error (messages, responses)"


def bad_json(c: Clients) -> str:
    broken = b'{"model": "switchyard", "messages": ['
    chat = c.http.post(c.base + "/v1/chat/completions", content=broken, headers={"content-type": "application/json"})
    assert chat.status_code == 400 and chat.json()["error"]["type"] == "invalid_request_error", chat.text
    messages = c.http.post(c.base + "/v1/messages", content=broken, headers={"content-type": "application/json"})
    assert messages.status_code == 400 and messages.json()["type"] == "error", messages.text
    assert messages.json()["error"]["type"] == "invalid_request_error", messages.text
    return "400 in OpenAI's shape (chat), Anthropic's (messages)"


ROWS: dict[str, Row] = {
    "chat-tools": Row("Chat Completions with tools", chat_tools),
    "chat-tools-stream": Row("Chat Completions with tools, streamed", chat_tools_stream),
    "tool-result": Row("A tool's result sent back (second turn)", tool_result_turn),
    "messages-tools": Row("Anthropic Messages with tools", messages_tools),
    "messages-stream": Row("Anthropic Messages, streamed", messages_stream),
    "json-schema": Row("response_format json_schema, openai `parse`", json_schema),
    "json-schema-stream": Row("response_format json_schema, streamed (`stream` + `parse`)", json_schema_stream),
    "json-object": Row("response_format json_object", json_object),
    "schema-refused": Row("A schema the engine cannot compile (unresolvable $ref)", schema_refused),
    "lookbehind-pattern": Row("A string `pattern` with a look-behind", lookbehind_pattern, {
        "llama.cpp": "llama-server accepts it and holds the string to nothing: a pattern its grammar cannot "
                     "express (a look-around, no ^...$ anchors) is 'not supported (...), accepting any string' "
                     "(common/json-schema-to-grammar.cpp)",
        "vllm": "the guidance backend's regex engine has no look-around (its message)"}),
    "responses": Row("Responses API", responses_whole),
    "responses-stream": Row("Responses API, streamed", responses_stream),
    "responses-json-schema": Row("Responses API text.format json_schema, openai `responses.parse`",
                                 responses_json_schema, {
        "llama.cpp": "llama-server reads no text.format (server-chat.cpp server_chat_convert_responses_to_chatcmpl); "
                     "the endpoint sends it as the response_format it reads (normalize rule 7)"}),
    "unknown-model": Row("A model name the endpoint does not serve", unknown_model, {
        "llama.cpp": "one model served: the endpoint answers any name with it, as llama-server does (agents "
                     "send their own model names); with models.yaml a 404, model_not_found or Anthropic's "
                     "not_found_error, naming the models (tests/test_fleet.py)",
        "vllm": "the endpoint sends vLLM its served name (vLLM alone would answer 404); with models.yaml a 404 "
                "naming the models, as on llama.cpp"}),
    "over-long-prompt": Row("A prompt longer than the served context", over_long_prompt),
    "bad-json": Row("A body that is not JSON", bad_json),
}
RESULTS: dict[tuple[str, str], str] = {}  # (row, engine) -> "pass: ..." | "FAIL: ..."


@dataclass
class Endpoint:
    base: str
    port: int
    proc: Any
    engine: str = "llama.cpp"
    switch: dict[str, Any] = field(default_factory=dict)

    @contextmanager
    def clients(self) -> Iterator[Clients]:
        http = httpx.Client(trust_env=False, timeout=300)
        chat = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", http_client=http, max_retries=0)
        messages = anthropic.Anthropic(base_url=self.base, api_key="unused", max_retries=0, timeout=300,
                                       http_client=anthropic.DefaultHttpxClient(trust_env=False))
        try:
            yield Clients(self.base, self.engine, http, chat, messages)
        finally:
            http.close()
            messages.close()


@pytest.fixture(scope="module")
def endpoint(llama_install: Any, vllm_install: Any, demo_model: Any) -> Iterator[Endpoint]:
    """One endpoint for the whole suite: llama.cpp first, vLLM after the switch test (or the first vLLM row)."""
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port),
                                    "--parallel", "4", "--vllm-eager")  # the switch's vLLM: no torch.compile
    served = Endpoint(f"http://127.0.0.1:{port}", port, proc)
    try:
        assert ready.startswith(f"ready: {served.base}/v1"), ready
        yield served
        assert run_cli("stop", "--port", str(port)).returncode == 0
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        write_table()


def _on(endpoint: Endpoint, engine: str, row: str) -> None:
    if engine == "vllm" and endpoint.engine != "vllm":
        _switch(endpoint, load=False)
    try:
        with endpoint.clients() as clients:
            shown = ROWS[row].run(clients)
    except BaseException as exc:
        RESULTS[row, engine] = f"FAIL: {type(exc).__name__}: {str(exc)[:300]}"
        raise
    RESULTS[row, engine] = f"pass: {shown}"


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
@pytest.mark.parametrize("row", list(ROWS))
def test_on_llamacpp(endpoint: Endpoint, row: str) -> None:
    assert endpoint.engine == "llama.cpp"
    _on(endpoint, "llama.cpp", row)


def _switch(endpoint: Endpoint, load: bool) -> dict[str, Any]:
    previewed = json.loads(run_cli("switch", "--to", "vllm", "--port", str(endpoint.port), "--dry-run",
                                   "--json").stdout)
    switched = run_cli("switch", "--to", "vllm", "--port", str(endpoint.port), "--json", timeout=900)
    assert switched.returncode == 0, switched.stderr
    endpoint.engine = "vllm"
    endpoint.switch = {"previewed": previewed, "result": json.loads(switched.stdout), "load": load}
    return endpoint.switch


class Load:
    """Clients sending chat requests (whole and streamed, in turn) until told to stop; every failure kept."""

    def __init__(self, base: str, workers: int = 3) -> None:
        self.base, self.stop, self.lock = base, threading.Event(), threading.Lock()
        self.ok, self.failed = 0, []  # type: ignore[var-annotated]
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(workers)]

    def _work(self, index: int) -> None:
        client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=600,
                               http_client=httpx.Client(trust_env=False, timeout=600))
        turn = index
        while not self.stop.is_set():
            turn += 1
            try:
                if turn % 2:
                    chunks = list(client.chat.completions.create(model="switchyard", messages=ASK, max_tokens=8,  # type: ignore[arg-type]
                                                                 stream=True))
                    assert any(c.choices and c.choices[0].finish_reason for c in chunks), chunks[-1:]
                else:
                    answer = client.chat.completions.create(model="switchyard", messages=ASK, max_tokens=8)  # type: ignore[arg-type]
                    assert answer.choices[0].finish_reason, answer
                with self.lock:
                    self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                with self.lock:
                    self.failed.append(f"{type(exc).__name__}: {exc}")
            self.stop.wait(0.2)  # a pace (a few requests a second), not a synchronisation

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(600)


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_switch_to_vllm_under_load(endpoint: Endpoint) -> None:
    """A small concurrent load across `switch --to vllm`: no request fails, and both engines answered some."""
    if endpoint.engine == "vllm":
        pytest.skip("switched already (a vLLM row ran first)")
    try:
        with Load(endpoint.base) as load:
            before = _wait_ok(load, 6)
            switch = _switch(endpoint, load=True)
            during = load.ok
            _wait_ok(load, during + 6)
        assert load.failed == [], load.failed[:3]
        rows = {row["capability"]: row for row in switch["previewed"]["capabilities"]}
        assert rows["tools"]["traffic_s_ago"] is not None and rows["tools"]["target"] == "yes", rows
        # vLLM answered a request with each capability clients had used before it took over (issue 41)
        assert {"tools", "json_schema"} <= set(switch["result"]["probed"]), switch["result"]
        status = json.loads(run_cli("status", "--json", "--port", str(endpoint.port)).stdout)
        assert status["active"]["engine"] == "vllm"
        assert status["active"]["plan"]["tool_parser"] == "hermes"  # from the demo's chat template
        answered = json.loads(run_cli("requests", "--json", "-n", "500", "--port", str(endpoint.port)).stdout)
        by_engine = {engine: sum(1 for r in answered["requests"] if r.get("engine") == engine and r.get("status") == 200)
                     for engine in ENGINES}
        assert all(by_engine.values()), by_engine
    except BaseException as exc:
        RESULTS["switch", "vllm"] = f"FAIL: {type(exc).__name__}: {str(exc)[:300]}"
        raise
    RESULTS["switch", "vllm"] = (f"pass: {load.ok} requests by 3 clients ({before} before the switch), 0 failed; "
                                 f"the request log then held 200s from llama.cpp {by_engine['llama.cpp']} and vLLM "
                                 f"{by_engine['vllm']} (the rows' own requests included)")


def _wait_ok(load: Load, count: int) -> int:
    """Wait (on the load's own progress) until `count` requests succeeded, or one failed."""
    deadline = threading.Event()
    timer = threading.Timer(300, deadline.set)
    timer.start()
    try:
        while load.ok < count and not load.failed and not deadline.is_set():
            load.stop.wait(0.05)
    finally:
        timer.cancel()
    assert load.ok >= count and not load.failed, (load.ok, load.failed[:3])
    return load.ok


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
@pytest.mark.parametrize("row", list(ROWS))
def test_on_vllm(endpoint: Endpoint, row: str) -> None:
    _on(endpoint, "vllm", row)


def write_table() -> None:
    """docs/conformance.md from this run, when every row ran on both engines (a partial run writes nothing)."""
    if not all((row, engine) in RESULTS for row in ROWS for engine in ENGINES):
        return
    lines = [
        "# What clients get through the endpoint, on each engine",
        "",
        "Written by `tests/test_agent_clients.py` (the conformance suite) from its last full run: the official",
        "`openai` and `anthropic` client libraries against the stable endpoint on the demo model (random weights),",
        "first on the real llama-server (b11434), then, after `switchyard switch --to vllm` under a small",
        "concurrent load, on the real vLLM 0.32 (CPU build). A row passes when the client library accepts the",
        "answer as that API's own (its parsing, its error classes) and the checks in the test hold.",
        "",
        "| What the client does | llama.cpp | vLLM |",
        "|---|---|---|",
    ]
    for key, row in ROWS.items():
        cells = [_cell(RESULTS[key, engine], row.why.get(engine)) for engine in ENGINES]
        lines.append(f"| {row.title} | {cells[0]} | {cells[1]} |")
    switch = RESULTS.get(("switch", "vllm"))
    if switch is not None:
        lines.append(f"| Concurrent requests across the switch from llama.cpp to vLLM | {_cell(switch, None)} ||")
    lines += [
        "",
        "Structured output is compact on both: vLLM is launched with",
        "`--structured-outputs-config '{\"backend\":\"guidance\",\"disable_any_whitespace\":true}'` (no whitespace",
        "between JSON tokens; its default lets a weak model write whitespace until the budget ends, and the setting",
        "is launch-wide only: engines/vllm.py says why guidance); llama-server's grammar allows at most one space,",
        "or one or two newlines and up to 20 spaces or tabs, between tokens. A schema an engine cannot compile is",
        "a 400 `invalid_request_error` with `param: response_format`, naming the engine and giving its reason,",
        "streamed or not (serving/structured.py).",
        "",
    ]
    DOC.write_text("\n".join(lines))


def _cell(result: str, why: str | None) -> str:
    text = re.sub(r"(\\n|\s)+", " ", result).replace("|", "\\|")  # (the endpoint escapes a reason's newlines)
    return f"{text} ({why})" if why else text
