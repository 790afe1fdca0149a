"""The "Try it" chat client against the real llama-server on the demo model: a streamed answer with its speed, and
a stop that ends the answer at once and keeps what arrived."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.measure.chat import ChatStream

pytestmark = [pytest.mark.engine, pytest.mark.llamacpp]


def test_chat_streams_an_answer_with_its_speed(llama_server: Any) -> None:
    pieces: list[str] = []
    stream = ChatStream(llama_server.base_url + "/v1", [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Say hello."}],
                        model=llama_server.plan.served_model_name, temperature=0.0, max_tokens=24)
    answer = stream.run(pieces.append)
    assert answer.text and answer.text == "".join(pieces) and len(pieces) >= 2
    assert answer.tokens_counted and answer.output_tokens >= len(pieces) - 1
    assert answer.ttft_s is not None and 0 < answer.ttft_s <= answer.seconds
    assert answer.tokens_per_s is not None and answer.tokens_per_s > 0
    assert not answer.stopped and answer.finish_reason in ("stop", "length")
    assert "tokens/s" in answer.summary()


def test_stop_ends_the_answer_and_keeps_what_arrived(llama_server: Any) -> None:
    stream = ChatStream(llama_server.base_url + "/v1", [{"role": "user", "content": "Count to one thousand."}],
                        temperature=0.0, max_tokens=2000)
    pieces: list[str] = []

    def on_text(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3:
            threading.Thread(target=stream.stop).start()  # from another thread, as the GUI does

    answer = stream.run(on_text)
    assert answer.stopped and 3 <= len(pieces) < 2000
    assert answer.text == "".join(pieces) and answer.output_tokens == len(pieces)
    assert "stopped" in answer.summary()


def test_a_dead_endpoint_is_one_readable_error() -> None:
    from desktop.core.runtime.ports import find_free_port

    stream = ChatStream(f"http://127.0.0.1:{find_free_port()}/v1", [{"role": "user", "content": "hi"}])
    with pytest.raises(SwitchyardError, match="chat request .* failed"):
        stream.run()
