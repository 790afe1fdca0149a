"""Vision GGUFs (issue 58): the projector is pulled with its model from a stand-in Hub, planned as --mmproj from the
Hub cache's snapshot, counted by the fit, marked in /v1/models, and an image request reaches the engine byte for
byte and is answered by the real llama-server.

Expected values come from outside the code under test: the projector's bytes are its tensors' as the gguf library
reads them; which files the stand-in Hub served is its own request log; the image's cost in tokens is llama.cpp's
one-token-per-patch rule for an "mlp" projector (tools/mtmd/clip.cpp) counted by the server's own `usage`; the
projector's memory is llama-server's own "estimated worst-case memory usage of mmproj" line."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_vision import N_IMAGE_TOKENS, tiny_png, write_mmproj

from desktop.core.common.errors import SwitchyardError
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.projector import pick_projector, read_projector

SNAPSHOTS = Path(__file__).parent / "snapshots"
CPU = HardwareSnapshot.load(SNAPSHOTS / "cpu_laptop.json")
GPU = HardwareSnapshot.load(SNAPSHOTS / "rtx4090.json")
SWITCHYARD = [sys.executable, "-m", "desktop"]
REPO = "ggml-org/tiny-vision-GGUF"


def test_the_projector_is_picked_in_16_bits_beside_the_weights() -> None:
    names = ["mmproj-F32.gguf", "mmproj-BF16.gguf", "tiny-Q8_0.gguf", "README.md", "mmproj-F16.gguf"]
    assert pick_projector(names) == "mmproj-F16.gguf"
    assert pick_projector(["mmproj-model-f32.gguf", "gemma-3-4b-it-mmproj-BF16.gguf"]) == \
        "gemma-3-4b-it-mmproj-BF16.gguf"
    assert pick_projector(["Q4/mmproj-F32.gguf", "mmproj-F16.gguf"], near="Q4/model-Q4_K_M.gguf") == \
        "Q4/mmproj-F32.gguf"  # one in the weights' own folder is theirs
    assert pick_projector(["model-Q4_K_M.gguf", "config.json"]) is None


def _tensor_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


@pytest.fixture
def pulled(tmp_path: Path, demo_model: Any) -> tuple[Path, dict[str, str], list[str]]:
    """`switchyard pull` of a vision repo from a stand-in Hub (model, projectors in F16 and F32, a README): the
    model's snapshot path, the environment, and the files the Hub was asked for."""
    import gguf
    from fakehub import FakeHub

    model = Path(demo_model.gguf_path)
    width = int(gguf.GGUFReader(model).fields["llama.embedding_length"].contents())
    f16 = write_mmproj(tmp_path / "src" / "mmproj-F16.gguf", width)
    f32 = write_mmproj(tmp_path / "src" / "mmproj-F32.gguf", width)
    with FakeHub() as hub:
        hub.add_repo(REPO, {"tiny-Q8_0.gguf": model, "mmproj-F16.gguf": f16, "mmproj-F32.gguf": f32,
                            "README.md": b"# tiny vision\n"}, tags=["gguf", "image-text-to-text"])
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "hf-cache"),
                   SWITCHYARD_HOME=str(tmp_path / "home"), SWITCHYARD_NO_KEYRING="1",
                   HF_HUB_DISABLE_IMPLICIT_TOKEN="1")
        variants = subprocess.run([*SWITCHYARD, "variants", REPO, "--json"], env=env, capture_output=True,
                                  text=True, timeout=120)
        assert variants.returncode == 0, variants.stderr
        listed = json.loads(variants.stdout)
        assert [(v["name"], v["projector"]) for v in listed["variants"]] == [("Q8_0", "mmproj-F16.gguf")]
        done = subprocess.run([*SWITCHYARD, "pull", REPO], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        fetched = [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    return Path(done.stdout.strip()), env, fetched


def test_a_vision_repo_is_pulled_with_its_16_bit_projector_and_planned_with_it(
        pulled: tuple[Path, dict[str, str], list[str]]) -> None:
    from desktop.core.planning.planner import plan_launch

    model, env, fetched = pulled
    assert any(p.endswith("/mmproj-F16.gguf") for p in fetched), fetched
    assert not any(p.endswith("/mmproj-F32.gguf") for p in fetched), fetched
    snapshot = model.parent
    assert snapshot.parent.name == "snapshots" and (snapshot / "mmproj-F16.gguf").is_symlink()
    assert sorted(p.name for p in snapshot.iterdir()) == ["mmproj-F16.gguf", "tiny-Q8_0.gguf"]

    models = subprocess.run([*SWITCHYARD, "models", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert models.returncode == 0, models.stderr
    local = [m for m in json.loads(models.stdout) if m.get("repo_id") == REPO]
    assert [(m["name"], m["vision"], Path(m["projector"]).name) for m in local] == \
        [(f"{REPO}:Q8_0", True, "mmproj-F16.gguf")]  # one model that takes images, not two files

    checked = plan_launch("llama.cpp", str(model), CPU, {"ctx_per_request": 1024, "slots": 1})
    assert checked.plan.mmproj == snapshot / "mmproj-F16.gguf"  # the snapshot's name, never the blob's
    projector = _tensor_bytes(snapshot / "mmproj-F16.gguf")
    assert checked.fit.breakdown["bytes.projector"] == projector
    without = plan_launch("llama.cpp", str(model), CPU, {"ctx_per_request": 1024, "slots": 1,
                                                           "extra_args": ("--no-mmproj",)})
    assert without.plan.mmproj is None
    added = (projector + checked.fit.breakdown["bytes.image_encoder"]) / 1024**3
    assert checked.fit.cpu_ram_gib - without.fit.cpu_ram_gib == pytest.approx(added, abs=0.002)

    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import EngineInstall

    argv = get_adapter("llama.cpp").build_command(checked.plan, EngineInstall(
        "llama.cpp", "0", "cache", Path("/usr/bin/llama-server"))).argv
    assert argv[argv.index("--mmproj") + 1] == str(snapshot / "mmproj-F16.gguf")
    assert "--no-mmproj-offload" not in argv and "--image-max-tokens" not in argv  # CPU; a fixed-size encoder


def test_a_tight_gpu_keeps_the_projector_in_ram_and_a_dynamic_encoder_is_capped(tmp_path: Path,
                                                                               demo_model: Any) -> None:
    """On a GPU with room the projector joins the layers; with the GPU full it stays in RAM
    (--no-mmproj-offload); a projector whose tokens grow with the image gets --image-max-tokens."""
    import gguf

    from desktop.core.planning.planner import plan_launch

    folder = tmp_path / "pair"
    folder.mkdir()
    model = folder / "tiny-Q8_0.gguf"
    model.symlink_to(demo_model.gguf_path)
    width = int(gguf.GGUFReader(model).fields["llama.embedding_length"].contents())
    write_mmproj(folder / "mmproj-F16.gguf", width, dynamic=True)
    assert read_projector(folder / "mmproj-F16.gguf").dynamic
    roomy = plan_launch("llama.cpp", str(model), GPU, {"ctx_per_request": 1024, "slots": 1})
    assert roomy.plan.mmproj_offload and roomy.plan.image_max_tokens == 1024
    assert any("on the GPU: the mlp projector" in note for note in roomy.fit.notes)
    asks = {"ctx_per_request": 1024, "slots": 1, "gpu_layers": 99}
    text = plan_launch("llama.cpp", str(model), GPU, {**asks, "extra_args": ("--no-mmproj",)})
    encoder = roomy.fit.breakdown["bytes.image_encoder"]
    assert encoder > 0.2 * 1024**3  # 4,096 patches for 1,024 tokens: the attention is what runs out of memory
    room = int((text.fit.total_gib + 0.1) * 1024**3)  # the layers fit, the projector and its encoder do not
    full = replace(GPU, gpus=[replace(GPU.gpus[0], memory_free_bytes=room)])
    tight = plan_launch("llama.cpp", str(model), full, asks)
    assert not tight.plan.mmproj_offload, tight.fit.notes
    assert any("in RAM (--no-mmproj-offload" in note for note in tight.fit.notes)


def _image_body() -> tuple[dict[str, Any], str]:
    url = "data:image/png;base64," + base64.b64encode(tiny_png()).decode("ascii")
    return {"model": "see", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url, "detail": "high"}}]}]}, url


def test_an_image_request_reaches_the_engine_byte_for_byte_and_the_model_is_marked(
        tmp_path: Path, pulled: tuple[Path, dict[str, str], list[str]]) -> None:
    from test_fleet import standin_launcher

    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.fleet import Fleet, parse_models_config
    from desktop.core.serving.proxy import ProxyServer

    model, _, _ = pulled
    bodies = tmp_path / "bodies.jsonl"
    checkpoint = tmp_path / "tiny-llava"  # a vLLM vision checkpoint's config (the stand-in serves it)
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({**LLAVA_15, "text_config": {
        **LLAVA_15["text_config"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4}}))
    config = parse_models_config({"models": [
        {"name": "see", "engine": "llama.cpp", "model": str(model), "ctx": 1024, "parallel": 1},
        {"name": "see-vllm", "engine": "vllm", "model": str(checkpoint), "ctx": 1024, "parallel": 1}]}, "test.yaml")
    proxy = ProxyServer(port=find_free_port(), wait_timeout=60)
    proxy.start()
    launched: list[Any] = []
    fleet = Fleet(proxy, config, hardware=CPU, ready_timeout=60,
                  launcher=standin_launcher(tmp_path, lambda plan: ["--bodies", str(bodies)], launched))
    try:
        fleet.start()
        assert launched[0].mmproj == model.parent / "mmproj-F16.gguf" and launched[1].images_per_prompt == 4
        listed = httpx.get(proxy.url + "/v1/models", timeout=30, trust_env=False).json()["data"]
        assert [(m["id"], m["switchyard"]["vision"]) for m in listed] == [("see", True), ("see-vllm", True)]
        import ollama  # an Ollama-speaking app offers an image upload on a model whose capabilities say "vision"

        shown = ollama.Client(host=proxy.url, trust_env=False, timeout=30).show("see")
        assert shown.capabilities == ["completion", "tools", "vision"]
        body, url = _image_body()
        for name in ("see", "see-vllm"):  # both engines' lanes, stand-ins here (the real ones: test_vision_llama,
            # test_vision_vllm)
            answer = httpx.post(proxy.url + "/v1/chat/completions", json={**body, "model": name}, timeout=60,
                                trust_env=False)
            assert answer.status_code == 200, answer.text
            forwarded = [json.loads(line) for line in bodies.read_text().splitlines()]
            parts = forwarded[-1]["body"]["messages"][0]["content"]
            assert parts[1] == {"type": "image_url", "image_url": {"url": url, "detail": "high"}}, name
    finally:
        fleet.close()
        proxy.stop()


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_real_llama_server_sees_through_the_pulled_pair_and_the_fit_matches_its_estimate(
        tmp_path: Path, llama_install: Any, pulled: tuple[Path, dict[str, str], list[str]]) -> None:
    """The pair as pulled (snapshot symlinks), served through the endpoint from the plan alone: the image costs
    one prompt token per patch more than the text, and the fit's projector + encoder is what llama-server itself
    estimates for the projector (its verbose log)."""
    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.endpoint import make_launcher
    from desktop.core.serving.fleet import Fleet, parse_models_config, plan_models
    from desktop.core.serving.proxy import ProxyServer

    model, _, _ = pulled
    config = parse_models_config({"models": [{"name": "see", "engine": "llama.cpp", "model": str(model),
                                              "ctx": 1024, "parallel": 1, "args": ["--verbose"]}]}, "test.yaml")
    plans = plan_models(config, CPU)
    proxy = ProxyServer(port=find_free_port(), wait_timeout=300)
    proxy.start()
    fleet = Fleet(proxy, config, launcher=make_launcher(), ready_timeout=300)
    try:
        fleet.start()
        body, _ = _image_body()
        seen = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=120, trust_env=False)
        assert seen.status_code == 200, seen.text
        text_only = {**body, "messages": [{"role": "user", "content": [body["messages"][0]["content"][0]]}]}
        plain = httpx.post(proxy.url + "/v1/chat/completions", json=text_only, timeout=120, trust_env=False)
        assert plain.status_code == 200, plain.text
        assert seen.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"] == N_IMAGE_TOKENS
        active = fleet.lanes["see"].active
        assert active is not None
        log = Path(active.process.log_path).read_text(encoding="utf-8", errors="replace")
        found = re.search(r"estimated worst-case memory usage of mmproj is ([\d.]+) MiB", log)
        assert found, log[-3000:]
        fit = plans["see"].fit.breakdown
        ours = (fit["bytes.projector"] + fit["bytes.image_encoder"]) / 2**20
        assert ours == pytest.approx(float(found[1]), rel=0.1), (ours, found[0])
    finally:
        fleet.close()
        proxy.stop()


LLAVA_15 = {  # llava-hf/llava-1.5-7b-hf's config.json, as the Hub serves it (trimmed to what sizes it)
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
    "projector_hidden_act": "gelu", "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "text_config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                    "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
                    "num_key_value_heads": 32, "max_position_embeddings": 4096, "vocab_size": 32064,
                    "torch_dtype": "float16"},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                      "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "torch_dtype": "float16",
}


def test_a_vllm_vision_checkpoint_is_limited_to_a_few_images_and_their_encoder_is_counted(tmp_path: Path) -> None:
    """vLLM would profile for 999 images a request (its default); the plan asks for 4 (--limit-mm-per-prompt) and
    the fit counts their encoder pass, which the same checkpoint without its vision tower does not have."""
    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import EngineInstall
    from desktop.core.planning.planner import plan_launch

    seeing, blind = tmp_path / "llava", tmp_path / "text"
    for folder, config in ((seeing, LLAVA_15), (blind, {k: v for k, v in LLAVA_15.items() if k != "vision_config"})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    checked = plan_launch("vllm", str(seeing), GPU, {"ctx_per_request": 4096})
    assert checked.plan.images_per_prompt == 4
    argv = get_adapter("vllm").build_command(checked.plan, EngineInstall("vllm", "0", "cache", Path("/usr/bin/python3"))).argv
    assert json.loads(argv[argv.index("--limit-mm-per-prompt") + 1]) == {"image": 4}
    text = plan_launch("vllm", str(blind), GPU, {"ctx_per_request": 4096})
    assert text.plan.images_per_prompt is None and "--limit-mm-per-prompt" not in json.dumps(text.plan.to_json())
    # ViT-L/14 at 336 px: 576 patches, 16 heads; four images' attention scores alone are 4 x 576^2 x 16 x 4 bytes
    assert checked.fit.breakdown["bytes.compute"] - text.fit.breakdown["bytes.compute"] >= 4 * 576**2 * 16 * 4
    assert checked.fit.kv_cache_tokens < text.fit.kv_cache_tokens
    from desktop.core.engines.engine_args import plan_fields_from_args

    given = plan_fields_from_args("vllm", ["--limit-mm-per-prompt", '{"image": 1}'])  # a models.yaml entry's args
    one = plan_launch("vllm", str(seeing), GPU, {"ctx_per_request": 4096, **given})
    assert one.plan.images_per_prompt == 1 and one.fit.kv_cache_tokens > checked.fit.kv_cache_tokens
    with pytest.raises(SwitchyardError, match="counts images only"):
        plan_fields_from_args("vllm", ["--limit-mm-per-prompt", '{"video": 1}'])
    assert takes_images_of(checked.plan) and not takes_images_of(text.plan)


def takes_images_of(plan: Any) -> bool:
    from desktop.core.serving.capabilities import takes_images

    return takes_images(plan)


def test_the_library_row_says_the_model_sees_images_and_delete_takes_its_projector(
        pulled: tuple[Path, dict[str, str], list[str]]) -> None:
    from desktop.core.hub import library
    from desktop.core.hub.library_view import library_rows

    model, env, _ = pulled
    cache_dir = Path(env["HF_HUB_CACHE"])
    row = next(r for r in library_rows(cache_dir) if r["name"] == f"{REPO}:Q8_0")
    assert row["notes"] == "sees images (mmproj-F16.gguf)"
    blobs = model.parent.parent.parent / "blobs"
    assert len(list(blobs.iterdir())) == 2
    library.delete(f"{REPO}:Q8_0", cache_dir=cache_dir)
    assert not blobs.exists() or list(blobs.iterdir()) == []  # nothing of the pair left behind


def test_the_capability_check_reads_the_plans_projector() -> None:
    from desktop.core.engines.base import LaunchPlan
    from desktop.core.serving.capabilities import IMAGES, plan_supports

    seeing = LaunchPlan(engine="llama.cpp", model_path=Path("m.gguf"), mmproj=Path("mmproj-F16.gguf"))
    blind = LaunchPlan(engine="llama.cpp", model_path=Path("m.gguf"))
    assert plan_supports(seeing)[IMAGES] == "yes" and plan_supports(blind)[IMAGES] == "no"
    assert LaunchPlan.from_json(json.loads(json.dumps(seeing.to_json()))) == seeing  # a stored plan keeps it


def test_another_models_projector_in_the_same_folder_is_not_taken(tmp_path: Path, demo_model: Any) -> None:
    """A folder of several models may hold a projector made for another text width: llama-server would refuse
    the pair ("mismatch between text model and mmproj"), so the plan serves the model text-only."""
    from desktop.core.planning.planner import plan_launch

    model = tmp_path / "tiny-Q8_0.gguf"
    model.symlink_to(demo_model.gguf_path)
    write_mmproj(tmp_path / "mmproj-other-F16.gguf", 4096)
    assert plan_launch("llama.cpp", str(model), CPU, {"ctx_per_request": 1024}).plan.mmproj is None


def _audio_projector(path: Path) -> Path:
    """An audio model's projector header (Ultravox, Voxtral): architecture clip, no vision encoder."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", False)
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_string("clip.projector_type", "ultravox")
    writer.add_tensor("a.conv1d.0.weight", np.zeros((8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_projector_at_the_top_of_a_snapshot_serves_a_quant_in_a_subfolder_and_an_audio_one_gives_no_sight(
        tmp_path: Path, demo_model: Any) -> None:
    """Repos keep split quants in `Q8_0/` and the projector at the top: pulled as users pull them, the plan finds
    it across the snapshot; an audio projector (no vision encoder) is no vision model's, in the plan or the list."""
    import gguf
    from fakehub import FakeHub

    from desktop.core.hub import library
    from desktop.core.planning.planner import plan_launch

    model = Path(demo_model.gguf_path)
    width = int(gguf.GGUFReader(model).fields["llama.embedding_length"].contents())
    f16 = write_mmproj(tmp_path / "src" / "mmproj-F16.gguf", width)
    audio = _audio_projector(tmp_path / "src" / "mmproj-audio-F16.gguf")
    pulled: dict[str, Path] = {}
    with FakeHub() as hub:
        hub.add_repo("org/nested-GGUF", {"Q8_0/tiny-Q8_0.gguf": model, "mmproj-F16.gguf": f16}, tags=["gguf"])
        hub.add_repo("org/audio-GGUF", {"tiny-Q8_0.gguf": model, "mmproj-F16.gguf": audio}, tags=["gguf"])
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "hf-cache"),
                   SWITCHYARD_HOME=str(tmp_path / "home"), SWITCHYARD_NO_KEYRING="1",
                   HF_HUB_DISABLE_IMPLICIT_TOKEN="1")
        for repo in ("org/nested-GGUF", "org/audio-GGUF"):
            done = subprocess.run([*SWITCHYARD, "pull", repo], env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            pulled[repo] = Path(done.stdout.strip())
    nested = pulled["org/nested-GGUF"]
    assert nested.parent.name == "Q8_0"
    plan = plan_launch("llama.cpp", str(nested), CPU, {"ctx_per_request": 1024}).plan
    assert plan.mmproj == nested.parent.parent / "mmproj-F16.gguf"
    heard = pulled["org/audio-GGUF"]
    assert (heard.parent / "mmproj-F16.gguf").exists()  # fetched with the model, as the repo ships it
    assert plan_launch("llama.cpp", str(heard), CPU, {"ctx_per_request": 1024}).plan.mmproj is None
    listed = {m.repo_id: m.vision for m in library.list_local(tmp_path / "hf-cache")}
    assert listed == {"org/nested-GGUF": True, "org/audio-GGUF": False}


def test_a_named_projector_stays_with_its_model_and_the_gpu_budget_counts_it(tmp_path: Path,
                                                                            demo_model: Any) -> None:
    """`-- --mmproj F` belongs to the model it was given for: a switch to another model plans that model's own
    (none here); on a GPU the projector and its encoder are in what the endpoint's memory budget holds."""
    import gguf

    from desktop.core.planning.planner import plan_launch, replan
    from desktop.core.planning.swap import engine_need

    folder = tmp_path / "pair"
    folder.mkdir()
    model = folder / "tiny-Q8_0.gguf"
    model.symlink_to(demo_model.gguf_path)
    width = int(gguf.GGUFReader(model).fields["llama.embedding_length"].contents())
    mmproj = write_mmproj(tmp_path / "elsewhere" / "mmproj-F16.gguf", width, dynamic=True)
    seeing = plan_launch("llama.cpp", str(model), GPU, {"ctx_per_request": 1024, "mmproj": mmproj})
    assert seeing.plan.mmproj == mmproj
    other = replan(seeing.plan, GPU, model="demo")
    assert other.plan.mmproj is None  # the demo has no projector of its own
    blind = plan_launch("llama.cpp", str(model), GPU, {"ctx_per_request": 1024, "extra_args": ("--no-mmproj",)})
    cost = (seeing.fit.breakdown["bytes.projector"] + seeing.fit.breakdown["bytes.image_encoder"]) / 1024**3
    added = engine_need(seeing.plan, GPU).gpu_total - engine_need(blind.plan, GPU).gpu_total
    assert added / 1024**3 == pytest.approx(cost, abs=0.002)


def test_an_export_of_a_vision_plan_carries_and_mounts_its_projector() -> None:
    """From a local path the target's llama-server is given the projector and the container mounts it; from a
    repo id llama-server's `-hf` fetches it itself ("mmproj is also downloaded automatically if available", its
    --help); vLLM's image limit and an embedder's batch go along."""
    from desktop.core.engines.base import LaunchPlan
    from desktop.core.planning.export import ExportPlan, docker_run_argv, k8s_documents

    local = LaunchPlan(engine="llama.cpp", model_path=Path("/models/tiny-Q8_0.gguf"),
                       mmproj=Path("/models/mmproj-F16.gguf"), image_max_tokens=1024, ubatch=4096)
    argv = docker_run_argv(ExportPlan.from_launch_plan(local))
    assert argv[argv.index("--mmproj") + 1] == "/models/mmproj-F16.gguf"
    assert "/models/mmproj-F16.gguf:/models/mmproj-F16.gguf:ro" in argv and "--image-max-tokens" in argv
    assert argv[argv.index("--ubatch-size") + 1] == "4096"
    pod = json.dumps(k8s_documents(ExportPlan.from_launch_plan(local)))
    assert '"hostPath": {"path": "/models/mmproj-F16.gguf"}' in pod
    from_repo = docker_run_argv(ExportPlan.from_launch_plan(local, model="ggml-org/tiny-vision-GGUF"))
    assert "--mmproj" not in from_repo and "--hf-repo" in from_repo
    seeing = LaunchPlan(engine="vllm", model_path=Path("/models/llava"), images_per_prompt=4)
    vllm_argv = docker_run_argv(ExportPlan.from_launch_plan(seeing, model="llava-hf/llava-1.5-7b-hf"))
    assert json.loads(vllm_argv[vllm_argv.index("--limit-mm-per-prompt") + 1]) == {"image": 4}
