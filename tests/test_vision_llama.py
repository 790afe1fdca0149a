"""A vision request through the real llama-server (issue 58): the demo text model with a generated tiny projector
(tests/tiny_vision.py) answers an OpenAI chat request that carries an image.

The expected image cost comes from llama.cpp's own rule, not from the code under test: an "mlp" (LLaVA) projector
turns a fixed-size image into one token per patch (tools/mtmd/clip.cpp `clip_n_output_tokens`), and the server's
own `usage.prompt_tokens` counts them."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import _running
from tiny_vision import N_IMAGE_TOKENS, tiny_png, write_mmproj


def _chat(base_url: str, content: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_real_llama_server_answers_a_chat_with_an_image_through_a_generated_projector(
        llama_install: Any, demo_model: Any, tmp_path: Path) -> None:
    import gguf

    model = Path(demo_model.gguf_path)
    width = int(gguf.GGUFReader(model).fields["llama.embedding_length"].contents())
    mmproj = write_mmproj(tmp_path / "mmproj-tiny.gguf", width)
    image_url = "data:image/png;base64," + base64.b64encode(tiny_png()).decode("ascii")
    question = {"type": "text", "text": "What is in this picture?"}

    servers = _running("llama.cpp", model, llama_install, ctx_per_request=1024, slots=1,
                       extra_args=("--mmproj", str(mmproj)))
    server: Any = next(servers)
    try:
        with_image = _chat(server.base_url, [question, {"type": "image_url", "image_url": {"url": image_url}}])
        assert with_image.status_code == 200, with_image.text
        answer = with_image.json()
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] > 0

        text_only = _chat(server.base_url, [question])
        assert text_only.status_code == 200, text_only.text
        # the image went through the projector: it took exactly one prompt token per patch
        assert answer["usage"]["prompt_tokens"] - text_only.json()["usage"]["prompt_tokens"] == N_IMAGE_TOKENS
    finally:
        servers.close()
