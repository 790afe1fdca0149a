"""A vision model's projector (llama.cpp's `mmproj-*.gguf`, issue 58): which file of a repo or folder it is, and what
it costs beside the text model: its weights, from its own GGUF header, and the image encoder's working memory for
the largest image the plan lets in.

Hand-written because no library names these: the keys are llama.cpp's own (tools/mtmd/clip-impl.h:
`clip.projector_type`, `clip.vision.image_size`, `clip.vision.patch_size`, `clip.vision.embedding_length`,
`clip.vision.attention.head_count`, `clip.vision.image_max_pixels` for the models whose image token count follows
the image's size). A repo ships its projector beside the weights under a name holding "mmproj" (mmproj-F16.gguf,
mmproj-model-f16.gguf, gemma-3-4b-it-mmproj-BF16.gguf), often in several precisions: F16 and BF16 are preferred (what
the model was trained in, half of F32's size; a quantized projector costs image quality for little memory).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from desktop.core.common.errors import ModelError

# preferred first: 16-bit (the model's own precision), then 8-bit, then F32 (twice the memory for nothing)
PREFERENCE = ("f16", "bf16", "q8_0", "f32")
DEFAULT_IMAGE_MAX_TOKENS = 1024  # the cap for a projector whose image token count grows with the image
# vLLM's --limit-mm-per-prompt for a model that sees images: a few screenshots or photos in one request, and its
# start-up profile sized for that many, not for its own default of 999 (vllm/config/multimodal.py)
DEFAULT_IMAGES_PER_PROMPT = 4


def is_projector(name: str) -> bool:
    """Whether a file name is a vision projector's (a GGUF whose name holds "mmproj")."""
    base = name.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and "mmproj" in base


def _rank(name: str) -> tuple[int, str]:
    base = name.rsplit("/", 1)[-1].lower()
    words = set(re.split(r"[-_.]", base))
    return next((i for i, p in enumerate(PREFERENCE) if p in words), len(PREFERENCE)), base


def pick_projector(names: Iterable[str], near: str = "") -> str | None:
    """The projector to use among a repo's or a folder's file names: one in the weights' own folder (`near`) if
    there is one there, else anywhere; F16/BF16 before Q8_0 before F32."""
    found = [n for n in names if is_projector(n)]
    if not found:
        return None
    folder = near.rpartition("/")[0]
    beside = [n for n in found if n.rpartition("/")[0] == folder]
    return min(beside or found, key=_rank)


def projector_beside(model: Path) -> Path | None:
    """The projector of a GGUF model: in its folder, or, in a Hub snapshot, anywhere in the snapshot (repos keep
    split quants in `Q4_K_M/` and the projector at the top), by `pick_projector`'s rule; None for a text-only
    model. A plain folder is searched only beside the model: its subfolders may be other models'."""
    if model.suffix.lower() != ".gguf" or is_projector(model.name):
        return None
    root = next((p for p in model.parents if p.parent.name == "snapshots"), model.parent)
    try:
        files = root.rglob("*.gguf") if root != model.parent else model.parent.iterdir()
        names = [p.relative_to(root).as_posix() for p in files if is_projector(p.name) and p.is_file()]
    except (OSError, ValueError):
        return None
    chosen = pick_projector(names, near=model.relative_to(root).as_posix())
    return root / chosen if chosen else None


class NotVision(ModelError):
    """A GGUF that is not a vision projector (an audio encoder's, another model's file)."""


@dataclass(frozen=True)
class VisionTower:
    """An image encoder's shape: what its working memory for one image follows."""

    image_size: int
    patch_size: int
    width: int  # hidden size
    heads: int
    ffn: int

    @property
    def patches(self) -> int:
        """Patches of one image at the encoder's own size (a fixed-size encoder always sees this many)."""
        return (self.image_size // max(self.patch_size, 1)) ** 2

    def encoder_bytes(self, patches: int | None = None) -> int:
        """The encoder's compute buffer for one image of `patches` patches (its own size by default): f32
        attention scores of every head over every patch pair (one layer at a time: the scheduler reuses the
        buffer) plus the layer's activations. Checked against llama-server's own estimate (tests/test_vision.py)."""
        n = patches or self.patches
        return int(n * n * self.heads * 4 + n * (6 * self.width + 2 * self.ffn) * 4)


def tower_of(config: dict[str, object]) -> VisionTower | None:
    """A Hugging Face config's vision tower (`vision_config`), or None for a text-only model."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None

    def number(*keys: str, default: int) -> int:
        value = next((vision[k] for k in keys if isinstance(vision.get(k), int)), default)
        return int(value)

    width = number("hidden_size", "embed_dim", default=1024)
    return VisionTower(image_size=number("image_size", default=336), patch_size=number("patch_size", default=14),
                       width=width, heads=number("num_attention_heads", "num_heads", default=max(1, width // 64)),
                       ffn=number("intermediate_size", default=4 * width))


@dataclass(frozen=True)
class Projector:
    """What the fit needs of a projector file: its bytes and its image encoder."""

    path: Path
    weights_bytes: int
    projector_type: str
    tower: VisionTower
    dynamic: bool  # the image token count follows the image's size (clip.vision.image_max_pixels is set)
    output_width: int | None = None  # clip.vision.projection_dim: the text model's width it feeds (llama.cpp checks)

    def encoder_bytes(self, image_max_tokens: int | None) -> int:
        """A dynamic encoder sees up to `image_max_tokens` x 4 patches (2x2 patches merge into one token), a fixed
        one its own size."""
        return self.tower.encoder_bytes(image_max_tokens * 4 if self.dynamic and image_max_tokens else None)


def read_projector(path: Path) -> Projector:
    """A projector's facts from its header; a clear error for a file that is not one."""
    from desktop.core.models.gguf_file import read_gguf_model, tensor_bytes

    try:
        model = read_gguf_model(path)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable header is the same advice
        raise ModelError(f"{path.name} is not a readable GGUF projector ({exc})",
                         "download the repo's mmproj file again (switchyard pull REPO)") from exc
    meta = model.metadata
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder", True):
        raise NotVision(f"{path.name} is not a vision projector (architecture "
                         f"{meta.get('general.architecture')!r})", "pass the repo's mmproj-*.gguf file")

    def number(key: str, default: int) -> int:
        value = meta.get(key)
        return int(value) if isinstance(value, int | float) else default

    width = number("clip.vision.embedding_length", 1024)
    tower = VisionTower(image_size=number("clip.vision.image_size", 336), patch_size=number("clip.vision.patch_size", 14),
                        width=width, heads=number("clip.vision.attention.head_count", max(1, width // 64)),
                        ffn=number("clip.vision.feed_forward_length", 4 * width))
    return Projector(
        path=path, weights_bytes=sum(tensor_bytes(shape, kind) for _, shape, kind in model.tensors),
        projector_type=str(meta.get("clip.projector_type") or meta.get("clip.vision.projector_type") or "mlp"),
        tower=tower, dynamic="clip.vision.image_max_pixels" in meta,
        output_width=number("clip.vision.projection_dim", 0) or None)


def projector_for(model: Path, text_width: int) -> Path | None:
    """The projector beside a GGUF that feeds a text model `text_width` wide: a folder of several models may hold
    another model's projector, which llama-server refuses ("mismatch between text model and mmproj"); an audio
    projector (Ultravox, Voxtral) gives no sight. One that cannot be read is an error saying how to go on."""
    found = projector_beside(model)
    if found is None:
        return None
    try:
        projector = read_projector(found)
    except NotVision:
        return None
    except ModelError as exc:
        raise ModelError(f"{found.name} beside {model.name}: {exc.message}",
                         "download the repo again (switchyard pull REPO), or serve the model without images: "
                         "-- --no-mmproj") from exc
    return found if projector.output_width in (None, text_width) else None
