"""A tiny generated (never downloaded) vision projector that the real llama-server accepts with `--mmproj`.

The projector is the classic LLaVA one, `clip.projector_type = "mlp"`: a 2-block ViT over a 32x32 image in 8x8
patches (16 patches, so 16 image tokens), width 64, then the two-layer MLP `mm.0` (64 -> 128), GELU, `mm.2`
(128 -> the text model's width). Random float32 weights; what the model answers does not matter.

What it follows in llama.cpp's source (tools/mtmd/):
- clip-impl.h: the GGUF keys (`clip.has_vision_encoder`, `clip.projector_type`, `clip.vision.*`) and the tensor
  names (`v.patch_embd.weight`, `v.position_embd.weight`, `v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,
  ffn_up,ffn_down}.*`, `mm.N.*`);
- clip.cpp `load_hparams`: embedding_length, attention.head_count, feed_forward_length, block_count,
  projection_dim, attention.layer_norm_epsilon, image_size and patch_size are required; image_mean/image_std need
  3 values each; `load_tensors`: per block only attn_out, ffn_up and ffn_down are required (q/k/v and the norms are
  optional but the llava graph uses them), and `ffn_down` must not have n_embd as its first ggml dimension or up
  and down are taken as swapped; `clip_n_mmproj_embd` for "mlp" is `mm.2.weight`'s ne[1], which mtmd.cpp checks
  against the text model's `n_embd`;
- models/llava.cpp: the graph runs blocks 0 .. n_layer-2 (the second-to-last layer is the feature layer), so two
  blocks are the fewest that run one; the position embedding has one row per patch (no class embedding here).

ggml dimensions are numpy's reversed: a (out, in) numpy weight is ggml ne = [in, out]; the patch convolution's
kernel is numpy (n_embd, 3, patch, patch).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import gguf
import numpy as np

IMAGE_SIZE = 32
PATCH_SIZE = 8
VISION_WIDTH = 64
VISION_HEADS = 4
VISION_FF = 128
VISION_BLOCKS = 2
PROJECTOR_HIDDEN = 128
SEED = 58

N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # what one image costs in the context


def write_mmproj(path: Path, text_width: int, dynamic: bool = False) -> Path:
    """Write a LLaVA-MLP projector GGUF whose output width is text_width (the text model's embedding_length).
    `dynamic` also writes `clip.vision.image_min/max_pixels`, the keys of the projectors whose image token count
    follows the image's size (Qwen2-VL's family): for the fit's tests, not for llama-server."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)

    def normal(std: float, *shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name("switchyard-tiny-vision")
    writer.add_description("generated test projector with random weights (tests/tiny_vision.py)")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", VISION_WIDTH)
    writer.add_uint32("clip.vision.feed_forward_length", VISION_FF)
    writer.add_uint32("clip.vision.projection_dim", text_width)
    writer.add_uint32("clip.vision.block_count", VISION_BLOCKS)
    writer.add_uint32("clip.vision.attention.head_count", VISION_HEADS)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)
    if dynamic:
        writer.add_uint32("clip.vision.image_min_pixels", 8 * 8)
        writer.add_uint32("clip.vision.image_max_pixels", 4096 * 4096)

    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    tensors: list[tuple[str, np.ndarray]] = [
        ("v.patch_embd.weight", normal(0.02, VISION_WIDTH, 3, PATCH_SIZE, PATCH_SIZE)),
        ("v.patch_embd.bias", zeros(VISION_WIDTH)),
        ("v.position_embd.weight", normal(0.02, n_patches, VISION_WIDTH)),
        ("v.pre_ln.weight", ones(VISION_WIDTH)),
        ("v.pre_ln.bias", zeros(VISION_WIDTH)),
    ]
    for block in range(VISION_BLOCKS):
        prefix = f"v.blk.{block}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors.append((f"{prefix}.{name}.weight", normal(0.02, VISION_WIDTH, VISION_WIDTH)))
            tensors.append((f"{prefix}.{name}.bias", zeros(VISION_WIDTH)))
        for name in ("ln1", "ln2"):
            tensors.append((f"{prefix}.{name}.weight", ones(VISION_WIDTH)))
            tensors.append((f"{prefix}.{name}.bias", zeros(VISION_WIDTH)))
        tensors.append((f"{prefix}.ffn_up.weight", normal(0.02, VISION_FF, VISION_WIDTH)))
        tensors.append((f"{prefix}.ffn_up.bias", zeros(VISION_FF)))
        tensors.append((f"{prefix}.ffn_down.weight", normal(0.02, VISION_WIDTH, VISION_FF)))
        tensors.append((f"{prefix}.ffn_down.bias", zeros(VISION_WIDTH)))
    tensors += [
        ("mm.0.weight", normal(0.02, PROJECTOR_HIDDEN, VISION_WIDTH)),
        ("mm.0.bias", zeros(PROJECTOR_HIDDEN)),
        ("mm.2.weight", normal(0.02, text_width, PROJECTOR_HIDDEN)),
        ("mm.2.bias", zeros(text_width)),
    ]
    for name, tensor in tensors:
        writer.add_tensor(name, np.ascontiguousarray(tensor))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_png(width: int = 64, height: int = 64) -> bytes:
    """An 8-bit RGB PNG of a colour gradient, written by hand (zlib + struct, no imaging library)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = bytearray()
    for y in range(height):
        rows.append(0)  # filter type: none
        for x in range(width):
            rows += bytes((x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), 128))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit depth, colour type 2 (RGB)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(rows))) + chunk(b"IEND", b"")


def write_vision_pair(folder: Path) -> tuple[Path, Path]:
    """The demo text model (a 512-wide Llama GGUF, cached) and a projector written for it into folder."""
    from desktop.core.models.demo import HIDDEN_SIZE, ensure_demo_model

    model = ensure_demo_model().gguf_path
    return model, write_mmproj(Path(folder) / "mmproj-tiny-vision.gguf", HIDDEN_SIZE)
