"""A tiny random-weight vision-language checkpoint, generated (never downloaded), that the real vLLM CPU build serves.

`write_tiny_vlm(folder)` writes a Hugging Face folder for vLLM's `Idefics3ForConditionalGeneration` (the
SmolVLM / Idefics3 architecture): a 2-layer SigLIP-style vision tower on 32x32 pixels in 8x8 patches (a 4x4 grid),
a pixel-shuffle connector (scale factor 2: the 16 patch features become 4 image embeddings) and a 2-layer Llama,
all float32 under vLLM's own tensor names (`model.vision_model.*`, `model.connector.*`, `model.text_model.*`,
`lm_head.*`). Image splitting is off, so every image is resized to 32x32 and costs exactly IMAGE_PROMPT_TOKENS
prompt tokens: `<fake_token_around_image><global-img>` + IMAGE_SEQ_LEN `<image>` + `<fake_token_around_image>`.

Why not LLaVA (or PaliGemma, Qwen2-VL, Gemma 3, Mistral 3, ...): vLLM's llava, paligemma and most other vision
modules import transformers' Pixtral image processor, which imports torchvision, and Switchyard's vLLM CPU install
has no torchvision (pip's PyPI wheel is built for another torch and is removed at install); vLLM then fails with
"Model architectures ['LlavaForConditionalGeneration'] failed to be inspected" (ModuleNotFoundError: torchvision).
The idefics3 module needs no torchvision: transformers falls back to its PIL image processor.

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
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
# The tile tags Idefics3's processor looks up (used only when image splitting is on, but looked up always).
ROW_COL_TOKENS = [f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]

# Vision tower: 32x32 pixels in 8x8 patches -> 16 patch features, pixel-shuffled 2x2 -> 4 image embeddings.
IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 2
VISION_HIDDEN = 64
VISION_HEADS = 2  # head size 32
VISION_LAYERS = 2
VISION_INTERMEDIATE = 128
PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2
IMAGE_SEQ_LEN = PATCHES // SCALE_FACTOR**2  # <image> embeddings per image: 4
# What one image adds to the prompt in place of the template's single <image>: the embeddings and their 3 tags.
IMAGE_PROMPT_TOKENS = IMAGE_SEQ_LEN + 3

# Language model (Llama).
TEXT_HIDDEN = 128
TEXT_HEADS = 2
TEXT_KV_HEADS = 2
TEXT_HEAD_DIM = TEXT_HIDDEN // TEXT_HEADS  # 64
TEXT_LAYERS = 2
TEXT_INTERMEDIATE = 256
MAX_POSITIONS = 2048

# "USER:\n<image>What is this?</s>\nASSISTANT:\n". An `image_url` part reaches the template as {"type": "image"}
# (vLLM's "openai" content format, detected because the template loops over the parts); it becomes the one
# <image> token the processor expands. The newline before the content keeps the text's tokens the same with or
# without an image in front (the byte-level BPE would otherwise merge the space into " What"), so an image part
# costs exactly IMAGE_PROMPT_TOKENS more prompt tokens than the same text alone (its one <image> becomes them).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'].upper() + ':\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:\n' }}{% endif %}"
)

FloatArray = npt.NDArray[np.float32]


def build_vlm_tokenizer() -> Tokenizer:
    """The demo model's byte-level BPE plus Idefics3's image tokens, each one special id that never splits."""
    tokenizer = build_tokenizer()
    specials = [IMAGE_TOKEN, FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE, *ROW_COL_TOKENS]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return tokenizer


def generate_weights(vocab_size: int) -> Iterator[tuple[str, FloatArray]]:
    """Every tensor of the checkpoint under the names vLLM's idefics3 loader expects, deterministic."""
    rng = np.random.default_rng(SEED)

    def normal(std: float, *shape: int) -> FloatArray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def ones(size: int) -> FloatArray:
        return np.ones(size, dtype=np.float32)

    def zeros(*shape: int) -> FloatArray:
        return np.zeros(shape, dtype=np.float32)

    # SigLIP-style vision tower: a biased patch convolution, one position per patch (no CLS), a post-layernorm.
    vision = "model.vision_model"
    yield f"{vision}.embeddings.patch_embedding.weight", normal(0.02, VISION_HIDDEN, 3, PATCH_SIZE, PATCH_SIZE)
    yield f"{vision}.embeddings.patch_embedding.bias", zeros(VISION_HIDDEN)
    yield f"{vision}.embeddings.position_embedding.weight", normal(0.02, PATCHES, VISION_HIDDEN)
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

    # Connector: pixel shuffle (in the model), then one bias-free linear layer to the text width.
    yield "model.connector.modality_projection.proj.weight", normal(
        0.02, TEXT_HIDDEN, VISION_HIDDEN * SCALE_FACTOR**2
    )

    # Llama language model with an untied lm_head.
    text = "model.text_model"
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


def write_tiny_vlm(folder: Path) -> Path:
    """Write the checkpoint into folder (created if missing) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    eos_id = _token_id(tokenizer, EOS_TOKEN)

    text_config = {
        "model_type": "llama",
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
        "pad_token_id": eos_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    vision_config = {
        "model_type": "idefics3_vision",
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": VISION_INTERMEDIATE,
        "num_hidden_layers": VISION_LAYERS,
        "num_attention_heads": VISION_HEADS,
        "num_channels": 3,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": _token_id(tokenizer, IMAGE_TOKEN),
        "scale_factor": SCALE_FACTOR,
        "pad_token_id": eos_id,
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
            "pad_token": EOS_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "processor_class": "Idefics3Processor",
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        folder / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "additional_special_tokens": [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE],
        },
    )
    _write_json(
        folder / "preprocessor_config.json",
        {
            "image_processor_type": "Idefics3ImageProcessor",
            "processor_class": "Idefics3Processor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"longest_edge": IMAGE_SIZE},
            "resample": 1,
            "do_image_splitting": False,
            "max_image_size": {"longest_edge": IMAGE_SIZE},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_pad": True,
        },
    )
    _write_json(
        folder / "processor_config.json",
        {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_SEQ_LEN},
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
        raise RuntimeError(f"the tiny vision tokenizer lacks {token!r}")
    return index


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    import sys

    print(write_tiny_vlm(Path(sys.argv[1])))
