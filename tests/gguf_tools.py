"""Write a GGUF file again as a split set with gguf-py's own split writer (what `convert_hf_to_gguf.py
--split-max-tensors` uses; gguf-split writes the same keys and names), so split sets are tested without downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf


def split_gguf(source: Path, folder: Path, max_tensors: int, small_first_shard: bool = False) -> list[Path]:
    """`source` rewritten into `folder` as NAME-0000K-of-0000N.gguf, at most `max_tensors` tensors per shard;
    `small_first_shard`: the first shard holds the metadata only (gguf-split's --no-tensor-first-split)."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    folder.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(folder / source.name, arch=arch, split_max_tensors=max_tensors,
                             small_first_shard=small_first_shard)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(folder.glob(f"{source.stem}-*-of-*.gguf"))


def _rewritten(source: Path, dest: Path, replaced: dict[str, tuple[Any, gguf.GGUFValueType]]) -> Path:
    """`source` written again at `dest` with the metadata keys in `replaced` set to new (value, type)s."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(dest, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in replaced:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for name, (value, kind) in replaced.items():
        writer.add_key_value(name, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def with_chat_template(source: Path, dest: Path, template: str) -> Path:
    """`source` written again at `dest` with `template` as its tokenizer.chat_template: a model that ships another
    family's template (what a fine-tune or a re-upload does), without a download."""
    return _rewritten(source, dest, {"tokenizer.chat_template": (template, gguf.GGUFValueType.STRING)})


def with_context_length(source: Path, dest: Path, tokens: int) -> Path:
    """`source` written again at `dest` with a trained window of `tokens` (`<arch>.context_length`): a model
    an agent can work with (Claude Code needs ~25k, Codex 64k), without a download."""
    arch = gguf.GGUFReader(source).fields["general.architecture"].contents()
    return _rewritten(source, dest, {f"{arch}.context_length": (tokens, gguf.GGUFValueType.UINT32)})
