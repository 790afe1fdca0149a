"""A vision model's projector in the llama.cpp fit (issue 58): its weights (from its own header) and the image
encoder's working memory for the largest image the plan lets in, on the GPU beside the layers when there is room,
else in RAM with `--no-mmproj-offload` (llama-server encodes images on the CPU then: slower, not out of memory).

A projector whose image token count grows with the image (Qwen2-VL's family: `clip.vision.image_max_pixels`) is
capped at `--image-max-tokens` (models.projector.DEFAULT_IMAGE_MAX_TOKENS unless asked): uncapped, one 2592x1944
photo is thousands of tokens, and its encoder's attention over them is the first-image out-of-memory crash users
meet on consumer GPUs."""

from __future__ import annotations

from dataclasses import replace

from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.projector import DEFAULT_IMAGE_MAX_TOKENS, read_projector
from desktop.core.planning.fit_result import FitResult

GIB = 1024**3


def count(result: FitResult, plan: LaunchPlan, hardware: HardwareSnapshot) -> FitResult:
    """`result` (a llama.cpp fit of `plan`) with the projector and its image encoder counted where they run, and
    the settings the plan launches with: `mmproj_offload`, `image_max_tokens`."""
    if plan.mmproj is None:
        return result
    projector = read_projector(plan.mmproj)
    cap = plan.image_max_tokens or (DEFAULT_IMAGE_MAX_TOKENS if projector.dynamic else None)
    encoder = projector.encoder_bytes(cap)
    cost = (projector.weights_bytes + encoder) / GIB
    notes = list(result.notes)
    settings = {**result.settings, "image_max_tokens": cap, "mmproj_offload": False}
    breakdown = {**result.breakdown, "projector": round(projector.weights_bytes / GIB, 3),
                 "image_encoder": round(encoder / GIB, 3), "bytes.projector": float(projector.weights_bytes),
                 "bytes.image_encoder": float(encoder)}
    what = f"the {projector.projector_type} projector ({projector.weights_bytes / GIB:.2f} GiB) and its image " \
           f"encoder ({encoder / GIB:.2f} GiB for {'an image of up to ' + format(cap, ',') + ' tokens' if cap else 'one image'})"
    if projector.dynamic:
        notes.append(f"images are capped at {cap:,} tokens each (--image-max-tokens): a larger one is scaled down")
    if result.device != "CPU" and plan.mmproj_offload and result.headroom_gib >= cost:
        settings["mmproj_offload"] = True
        if "gpu_used" in breakdown:  # what the endpoint's memory budget reads (planning/swap.engine_need)
            breakdown["gpu_used"] = round(float(breakdown["gpu_used"]) + cost, 3)
        return replace(result, total_gib=round(result.total_gib + cost, 3),
                       headroom_gib=round(result.headroom_gib - cost, 3), breakdown=breakdown, settings=settings,
                       notes=[*notes, f"on the GPU: {what}"])
    if result.device != "CPU":
        why = "asked" if not plan.mmproj_offload else f"the GPU has {max(result.headroom_gib, 0):.2f} GiB left"
        notes.append(f"in RAM (--no-mmproj-offload, {why}): {what}; images are encoded on the CPU")
    fits = result.fits
    if fits != "no" and (result.cpu_ram_gib + cost) * GIB > hardware.ram_available_bytes:
        fits = "no"
        notes.append(f"{what} do not fit in the RAM left: serve without images (-- --no-mmproj) or a smaller model")
    cpu = result.device == "CPU"
    settings["mmproj_offload"] = plan.mmproj_offload if cpu else False  # no GPU: nothing to offload, no flag
    return replace(result, fits=fits, cpu_ram_gib=round(result.cpu_ram_gib + cost, 3),
                   total_gib=round(result.total_gib + cost, 3) if cpu else result.total_gib,
                   headroom_gib=round(result.headroom_gib - cost, 3) if cpu else result.headroom_gib,
                   breakdown=breakdown, settings=settings, notes=notes)
