"""The real vLLM CPU build sees an image: a generated tiny vision-language checkpoint (tests/tiny_llava.py, vLLM's
Idefics3 architecture) answers, through the endpoint, an OpenAI chat request with an `image_url` part (a base64 PNG data URL), and the
image costs exactly the prompt tokens the checkpoint's processor promises (its <image> embeddings and their tags)."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_llava import IMAGE_PROMPT_TOKENS, write_tiny_vlm

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


@pytest.mark.engine
@pytest.mark.vllm
def test_real_vllm_answers_an_image_request_through_the_endpoint_and_counts_its_tokens(
        vllm_install: EngineInstall, tmp_path: Path) -> None:
    """The checkpoint served from its models.yaml entry alone: the plan asks vLLM for 4 images a request
    (--limit-mm-per-prompt), /v1/models marks the model as seeing images, and an image through the endpoint costs
    the checkpoint's own image tokens."""
    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.endpoint import make_launcher
    from desktop.core.serving.fleet import Fleet, parse_models_config
    from desktop.core.serving.proxy import ProxyServer

    folder = write_tiny_vlm(tmp_path / "tiny-vlm")
    config = parse_models_config({"models": [{"name": "see", "engine": "vllm", "model": str(folder), "ctx": 1024,
                                              "parallel": 2, "args": ["--enforce-eager"]}]}, "test.yaml")
    proxy = ProxyServer(port=find_free_port(), wait_timeout=600)
    proxy.start()
    fleet = Fleet(proxy, config, launcher=make_launcher(), ready_timeout=600)
    try:
        fleet.start()
        active = fleet.lanes["see"].active
        assert active is not None and active.plan.images_per_prompt == 4
        listed = httpx.get(proxy.url + "/v1/models", timeout=30, trust_env=False).json()["data"]
        assert [(m["id"], m["switchyard"]["vision"]) for m in listed] == [("see", True)]
        url = "data:image/png;base64," + base64.b64encode(_png(40, 24)).decode("ascii")
        question = {"type": "text", "text": "What is in this picture?"}

        def chat(content: list[dict[str, Any]]) -> dict[str, Any]:
            response = httpx.post(proxy.url + "/v1/chat/completions", timeout=120, trust_env=False,
                                  json={"model": "see", "max_tokens": 4, "temperature": 0,
                                        "messages": [{"role": "user", "content": content}]})
            assert response.status_code == 200, response.text
            body: dict[str, Any] = response.json()
            assert body["choices"][0]["finish_reason"] in ("length", "stop")
            return body

        seen = chat([{"type": "image_url", "image_url": {"url": url}}, question])
        text_only = chat([question])
        assert seen["usage"]["completion_tokens"] >= 1
        # the image is resized to the tower's 32x32 and becomes <fake><global-img> + 4 x <image> + <fake>
        assert seen["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"] == IMAGE_PROMPT_TOKENS == 7
        assert proxy.counters["failed"] == 0
    finally:
        fleet.close()
        proxy.stop()
