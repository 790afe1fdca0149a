"""The real vLLM CPU build sees an image: a generated tiny vision-language checkpoint (tests/tiny_llava.py, vLLM's
Idefics3 architecture) answers an OpenAI chat request with an `image_url` part (a base64 PNG data URL), and the
image costs exactly the prompt tokens the checkpoint's processor promises (its <image> embeddings and their tags)."""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import _running
from tiny_llava import IMAGE_PROMPT_TOKENS, write_tiny_vlm

from desktop.core.common import unixhttp
from desktop.core.engines.base import EngineInstall


def _png(width: int, height: int) -> bytes:
    """A small RGB gradient PNG, written by hand (the project's venv has no imaging library)."""
    rows = b"".join(
        b"\x00" + bytes(value for x in range(width) for value in ((x * 6) % 256, (y * 10) % 256, 128))
        for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def vision_server(vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = write_tiny_vlm(Path(tmp_path_factory.mktemp("tiny-vlm")))
    # images_per_prompt=1 is the plan's --limit-mm-per-prompt '{"image": 1}'
    yield from _running("vllm", folder, vllm_install, ctx_per_request=1024, slots=2, eager=True, dtype="float32",
                        images_per_prompt=1)


@pytest.mark.engine
@pytest.mark.vllm
def test_real_vllm_answers_an_image_request_and_counts_its_tokens(vision_server: Any) -> None:
    url = "data:image/png;base64," + base64.b64encode(_png(40, 24)).decode("ascii")
    question = {"type": "text", "text": "What is in this picture?"}

    def chat(content: list[dict[str, Any]]) -> dict[str, Any]:
        with unixhttp.client(vision_server.base_url, timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            response = client.post(
                unixhttp.http_url(vision_server.base_url) + "/v1/chat/completions",
                json={"model": vision_server.plan.served_model_name, "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "user", "content": content}]},
            )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        return body

    seen = chat([{"type": "image_url", "image_url": {"url": url}}, question])
    text_only = chat([question])
    assert seen["usage"]["completion_tokens"] >= 1
    # the image is resized to the tower's 32x32 and becomes <fake><global-img> + 4 x <image> + <fake>
    assert seen["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"] == IMAGE_PROMPT_TOKENS == 7
