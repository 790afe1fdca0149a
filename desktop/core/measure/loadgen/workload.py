"""What the load generator sends: random prompts of fixed or log-normal token lengths, shared-prefix sets (to
show a prefix cache's effect), or a user's JSONL file. Each yields `RequestSpec`s; generation is seeded so two
engines (or two tools) receive the same prompts."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from desktop.core.common.errors import SwitchyardError

# Common short English words: with byte-level BPE tokenizers each is about one token with its leading space,
# so a prompt of N words is close to N tokens even without a tokenizer (the server's usage gives the truth).
WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much go good new write our me man too any day same right look think also "
    "around another came come work three word must because does part even place well such here take why help "
    "put different away again off went old number great tell men say small every found still between name "
    "should home big give air line set own under read last never us left end along while might next sound below "
    "saw something thought both few those always show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animal life enough took four head "
    "above kind began almost live page got earth need far hand high year mother light country father let night"
).split()

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: a completion prompt or chat messages, and how many tokens to ask for."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int = 64
    input_tokens: int = 0  # estimated prompt tokens; the server's usage replaces it when present

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RandomWorkload:
    """Random word prompts; lengths fixed (`input_sigma` 0) or log-normal around the given medians."""

    input_len: int = 128
    output_len: int = 64
    input_sigma: float = 0.0
    output_sigma: float = 0.0
    seed: int = 0
    kind: Literal["random"] = "random"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """`num_prefixes` long shared prefixes, each followed by a short unique suffix: a prefix cache pays off here."""

    num_prefixes: int = 4
    prefix_len: int = 256
    suffix_len: int = 32
    output_len: int = 64
    seed: int = 0
    kind: Literal["shared_prefix"] = "shared_prefix"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JsonlWorkload:
    """One request per line: {"prompt": ...} or {"messages": [...]}, optional "output_tokens" (vllm bench's
    custom dataset format, so the same file drives both tools)."""

    path: Path
    output_len: int = 64  # used when a line has no "output_tokens"
    kind: Literal["jsonl"] = "jsonl"

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "output_len": self.output_len, "kind": self.kind}


Workload = RandomWorkload | SharedPrefixWorkload | JsonlWorkload


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


def _length(rng: random.Random, median: int, sigma: float) -> int:
    if sigma <= 0:
        return max(1, median)
    return max(1, round(rng.lognormvariate(math.log(max(1, median)), sigma)))


def _fit(text: str, tokens: int, counter: TokenCounter | None) -> tuple[str, int]:
    """The longest word prefix a real tokenizer (when given) counts at most `tokens`; else one token per word.

    The count of the whole text gives tokens per word; the guess from it is then stepped a word at a time, so a
    counter that is a server round trip is asked a handful of times per prompt, not log2(words) times."""
    if counter is None:
        return text, len(text.split())
    words = text.split()
    total = counter(" ".join(words))
    while total < tokens:  # a tokenizer that merges words: add more
        words += words[: max(1, tokens - total)]
        total = counter(" ".join(words))
    count = max(1, min(len(words), round(tokens * len(words) / max(total, 1))))
    counted = counter(" ".join(words[:count]))
    if counted <= tokens:
        while count < len(words):
            longer = counter(" ".join(words[: count + 1]))
            if longer > tokens:
                break
            count, counted = count + 1, longer
    else:
        while count > 1 and counted > tokens:
            count -= 1
            counted = counter(" ".join(words[:count]))
    return " ".join(words[:count]), counted


def generate(workload: Workload, count: int, token_counter: TokenCounter | None = None) -> list[RequestSpec]:
    """`count` requests from `workload` (cycling a JSONL file if it has fewer lines)."""
    if count <= 0:
        return []
    if isinstance(workload, RandomWorkload):
        rng = random.Random(workload.seed)
        specs = []
        for _ in range(count):
            in_len = _length(rng, workload.input_len, workload.input_sigma)
            prompt, tokens = _fit(_words(rng, in_len), in_len, token_counter)
            specs.append(RequestSpec(prompt=prompt, max_tokens=_length(rng, workload.output_len,
                                                                        workload.output_sigma),
                                     input_tokens=tokens))
        return specs
    if isinstance(workload, SharedPrefixWorkload):
        rng = random.Random(workload.seed)
        prefixes = [_words(rng, workload.prefix_len) for _ in range(max(1, workload.num_prefixes))]
        specs = []
        for index in range(count):
            prompt = prefixes[index % len(prefixes)] + " " + _words(rng, workload.suffix_len)
            tokens = token_counter(prompt) if token_counter else len(prompt.split())
            specs.append(RequestSpec(prompt=prompt, max_tokens=workload.output_len, input_tokens=tokens))
        return specs
    lines = load_jsonl(workload.path, workload.output_len, token_counter)
    return [lines[index % len(lines)] for index in range(count)]


def load_jsonl(path: Path, output_len: int, token_counter: TokenCounter | None = None) -> list[RequestSpec]:
    """Read a JSONL workload, naming the line of any problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SwitchyardError(f"cannot read workload file {path}: {exc.strerror or exc}",
                              "give a JSONL file with one {\"prompt\": ...} object per line") from exc
    specs: list[RequestSpec] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise SwitchyardError(f"{path}:{number} is not valid JSON: {exc}",
                                  "each line must be one JSON object") from exc
        if not isinstance(item, dict) or not ("prompt" in item or "messages" in item):
            raise SwitchyardError(f"{path}:{number} has neither 'prompt' nor 'messages'",
                                  'write lines like {"prompt": "Hello", "output_tokens": 64}')
        max_tokens = int(item.get("output_tokens") or output_len)
        if "messages" in item:
            messages = item["messages"]
            joined = " ".join(str(m.get("content", "")) for m in messages)
            tokens = token_counter(joined) if token_counter else len(joined.split())
            specs.append(RequestSpec(messages=messages, max_tokens=max_tokens, input_tokens=tokens))
        else:
            prompt = str(item["prompt"])
            tokens = token_counter(prompt) if token_counter else len(prompt.split())
            specs.append(RequestSpec(prompt=prompt, max_tokens=max_tokens, input_tokens=tokens))
    if not specs:
        raise SwitchyardError(f"workload file {path} has no requests", "add at least one line")
    return specs


def write_jsonl(specs: list[RequestSpec], path: Path) -> None:
    """Write specs in vllm bench's custom-dataset format (used to feed both tools the same prompts)."""
    with open(path, "w", encoding="utf-8") as handle:
        for spec in specs:
            item: dict[str, Any] = {"output_tokens": spec.max_tokens}
            if spec.messages is not None:
                item["messages"] = spec.messages
            else:
                item["prompt"] = spec.prompt
            handle.write(json.dumps(item) + "\n")


def tokenizer_counter(tokenizer_file: Path) -> TokenCounter:
    """A token counter from a Hugging Face `tokenizer.json` (exact prompt lengths when the model's is at hand)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count


__all__ = ["JsonlWorkload", "RandomWorkload", "RequestSpec", "SharedPrefixWorkload", "TokenCounter", "Workload",
           "generate", "load_jsonl", "tokenizer_counter", "write_jsonl"]
