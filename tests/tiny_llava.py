"""A tiny random-weight LLaVA checkpoint, generated (never downloaded) for tests that need a real vLLM to see images.

`write_tiny_llava(folder)` writes a Hugging Face folder that vLLM's `LlavaForConditionalGeneration` loads: a
2-layer CLIP vision tower (32x32 pixels, 8x8 patches), the LLaVA two-layer MLP projector and a 2-layer Llama, in
float32 with the transformers>=4.52 tensor layout (`model.language_model.*`, `model.vision_tower.vision_model.*`,
`model.multi_modal_projector.*`, `lm_head.*`), which vLLM's llava loader maps onto its own modules. The tokenizer
is the demo model's byte-level BPE plus an added `<image>` token; the chat template writes `<image>\\n` where a
message has an image part, and the processor expands it to one placeholder per patch.

Only numpy, safetensors and tokenizers are used, so the project's venv (which has no torch) can write it. Head
sizes are 64 (text) and 32 (vision): vLLM's CPU attention rejects smaller ones. Output text is meaningless.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer

from desktop.core.models.demo import BOS_TOKEN, EOS_TOKEN, build_tokenizer

SEED = 20250158
IMAGE_TOKEN = "<image>"

# Vision tower (CLIP): 32x32 pixels in 8x8 patches -> a 4x4 grid = 16 patches (+1 CLS position).
IMAGE_SIZE = 32
PATCH_SIZE = 8
VISION_HIDDEN = 64
VISION_HEADS = 2  # head size 32
VISION_LAYERS = 2
VISION_INTERMEDIATE = 128
VISION_FEATURE_LAYER = -2  # the LLaVA-1.5 choice: vLLM builds only the first of the two layers
VISION_FEATURE_SELECT_STRATEGY = "default"  # drop the CLS position
PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2
# The placeholders one image costs in the prompt: every patch ("default" drops the CLS token, which the processor's
# num_additional_image_tokens=1 adds back before subtracting it).
IMAGE_TOKENS = PATCHES

# Language model (Llama).
TEXT_HIDDEN = 128
TEXT_HEADS = 2
TEXT_KV_HEADS = 2
TEXT_HEAD_DIM = TEXT_HIDDEN // TEXT_HEADS  # 64
TEXT_LAYERS = 2
TEXT_INTERMEDIATE = 256
MAX_POSITIONS = 2048

# OpenAI's CLIP normalisation, as LLaVA-1.5's preprocessor_config.json has it.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

# A LLaVA-style template: "USER: <image>\n<text></s>\nASSISTANT:". Image parts (vLLM passes `{"type": "image"}`
# for an `image_url` part) become the `<image>` token the processor expands to IMAGE_TOKENS placeholders.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

FloatArray = npt.NDArray[np.float32]


def build_llava_tokenizer() -> Tokenizer:
    """The demo model's byte-level BPE with `<image>` added as a special token (one id, never split)."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    return tokenizer


def generate_weights(vocab_size: int) -> Iterator[tuple[str, FloatArray]]:
    """Every tensor of the checkpoint under its transformers>=4.52 name, deterministic."""
    rng = np.random.default_rng(SEED)

    def normal(std: float, *shape: int) -> FloatArray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def ones(size: int) -> FloatArray:
        return np.ones(size, dtype=np.float32)

    def zeros(*shape: int) -> FloatArray:
        return np.zeros(shape, dtype=np.float32)

    # CLIP vision tower.
    vision = "model.vision_tower.vision_model"
    yield f"{vision}.embeddings.class_embedding", normal(0.02, VISION_HIDDEN)
    yield f"{vision}.embeddings.patch_embedding.weight", normal(0.02, VISION_HIDDEN, 3, PATCH_SIZE, PATCH_SIZE)
    yield f"{vision}.embeddings.position_embedding.weight", normal(0.02, PATCHES + 1, VISION_HIDDEN)
    yield f"{vision}.pre_layrnorm.weight", ones(VISION_HIDDEN)
    yield f"{vision}.pre_layrnorm.bias", zeros(VISION_HIDDEN)
    for layer in range(VISION_LAYERS):
        prefix = f"{vision}.encoder.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield f"{prefix}.self_attn.{proj}.weight", normal(0.02, VISION_HIDDEN, VISION_HIDDEN)
            yield f"{prefix}.self_attn.{proj}.bias", zeros(VISION_HIDDEN)
        yield f"{prefix}.layer_norm1.weight", ones(VISION_HIDDEN)
        yield f"{prefix}.layer_norm1.bias", zeros(VISION_HIDDEN)
        yield f"{prefix}.mlp.fc1.weight", normal(0.02, VISION_INTERMEDIATE, VISION_HIDDEN)
        yield f"{prefix}.mlp.fc1.bias", zeros(VISION_INTERMEDIATE)
        yield f"{prefix}.mlp.fc2.weight", normal(0.02, VISION_HIDDEN, VISION_INTERMEDIATE)
        yield f"{prefix}.mlp.fc2.bias", zeros(VISION_HIDDEN)
        yield f"{prefix}.layer_norm2.weight", ones(VISION_HIDDEN)
        yield f"{prefix}.layer_norm2.bias", zeros(VISION_HIDDEN)
    yield f"{vision}.post_layernorm.weight", ones(VISION_HIDDEN)
    yield f"{vision}.post_layernorm.bias", zeros(VISION_HIDDEN)

    # Projector: vision hidden -> text hidden, GELU, text hidden -> text hidden.
    projector = "model.multi_modal_projector"
    yield f"{projector}.linear_1.weight", normal(0.02, TEXT_HIDDEN, VISION_HIDDEN)
    yield f"{projector}.linear_1.bias", zeros(TEXT_HIDDEN)
    yield f"{projector}.linear_2.weight", normal(0.02, TEXT_HIDDEN, TEXT_HIDDEN)
    yield f"{projector}.linear_2.bias", zeros(TEXT_HIDDEN)

    # Llama language model.
    text = "model.language_model"
    kv_dim = TEXT_KV_HEADS * TEXT_HEAD_DIM
    yield f"{text}.embed_tokens.weight", normal(1.0, vocab_size, TEXT_HIDDEN)
    for layer in range(TEXT_LAYERS):
        prefix = f"{text}.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", ones(TEXT_HIDDEN)
        yield f"{prefix}.self_attn.q_proj.weight", normal(0.02, TEXT_HEADS * TEXT_HEAD_DIM, TEXT_HIDDEN)
        yield f"{prefix}.self_attn.k_proj.weight", normal(0.02, kv_dim, TEXT_HIDDEN)
        yield f"{prefix}.self_attn.v_proj.weight", normal(0.02, kv_dim, TEXT_HIDDEN)
        yield f"{prefix}.self_attn.o_proj.weight", normal(0.02, TEXT_HIDDEN, TEXT_HEADS * TEXT_HEAD_DIM)
        yield f"{prefix}.post_attention_layernorm.weight", ones(TEXT_HIDDEN)
        yield f"{prefix}.mlp.gate_proj.weight", normal(0.02, TEXT_INTERMEDIATE, TEXT_HIDDEN)
        yield f"{prefix}.mlp.up_proj.weight", normal(0.02, TEXT_INTERMEDIATE, TEXT_HIDDEN)
        yield f"{prefix}.mlp.down_proj.weight", normal(0.02, TEXT_HIDDEN, TEXT_INTERMEDIATE)
    yield f"{text}.norm.weight", ones(TEXT_HIDDEN)
    yield "lm_head.weight", normal(0.35, vocab_size, TEXT_HIDDEN)


def write_tiny_llava(folder: Path) -> Path:
    """Write the checkpoint into folder (created; must not exist or be empty) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_llava_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    eos_id = _token_id(tokenizer, EOS_TOKEN)
    image_id = _token_id(tokenizer, IMAGE_TOKEN)

    text_config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": TEXT_INTERMEDIATE,
        "num_hidden_layers": TEXT_LAYERS,
        "num_attention_heads": TEXT_HEADS,
        "num_key_value_heads": TEXT_KV_HEADS,
        "head_dim": TEXT_HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    vision_config = {
        "model_type": "clip_vision_model",
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": VISION_INTERMEDIATE,
        "num_hidden_layers": VISION_LAYERS,
        "num_attention_heads": VISION_HEADS,
        "num_channels": 3,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
        "projection_dim": VISION_HIDDEN,
        "torch_dtype": "float32",
    }
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_index": image_id,
        "image_seq_length": IMAGE_TOKENS,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": VISION_FEATURE_LAYER,
        "vision_feature_select_strategy": VISION_FEATURE_SELECT_STRATEGY,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})

    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "processor_class": "LlavaProcessor",
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        folder / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "additional_special_tokens": [IMAGE_TOKEN]},
    )
    _write_json(
        folder / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"shortest_edge": IMAGE_SIZE},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": IMAGE_MEAN,
            "image_std": IMAGE_STD,
        },
    )
    _write_json(
        folder / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "image_token": IMAGE_TOKEN,
            "patch_size": PATCH_SIZE,
            "vision_feature_select_strategy": VISION_FEATURE_SELECT_STRATEGY,
            "num_additional_image_tokens": 1,
        },
    )
    save_file(
        {name: np.ascontiguousarray(tensor) for name, tensor in generate_weights(vocab_size)},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return folder


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    index = tokenizer.token_to_id(token)
    if index is None:
        raise RuntimeError(f"the tiny LLaVA tokenizer lacks {token!r}")
    return index


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    import sys

    print(write_tiny_llava(Path(sys.argv[1])))
