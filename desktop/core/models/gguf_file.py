"""GGUF files as llama-server loads them: one file's header and tensor table, read by a small bounded reader, and
a split set (`NAME-00001-of-00003.gguf`, written by gguf-split or gguf-py's split writer) read as one model.

The reader is deliberately small and bounded: it reads the header and tensor table only (never tensor data), caps
every count, string and total header size, and turns any inconsistency into a ModelError. `gguf`'s own GGUFReader
memory-maps the whole file and trusts the counts it finds, which is wrong for a fit check that must survive
truncated downloads and arbitrary files; its constants (value and tensor types, block sizes, split keys) are reused.

A split set keeps all metadata in its first shard and spreads the tensors over the shards (with gguf-split's
`--no-tensor-first-split`, or gguf-py's `small_first_shard`, the first holds none). llama-server is handed the first
shard and opens the others by name (`llama_split_prefix`: `%s-%05d-of-%05d.gguf`), so that is what is checked here:
every shard present by that name, each saying it is shard K of N, each whole, and their tensors adding up to the
first shard's `split.tensors.count`.
"""

from __future__ import annotations

import io
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

from desktop.core.common.errors import ModelError

GGUF_MAGIC = b"GGUF"
MAX_HEADER_BYTES = 512 * 1024 * 1024  # tokenizer arrays of 250k tokens take ~10 MiB; anything near this is garbage
MAX_KV_COUNT = 100_000
MAX_TENSOR_COUNT = 1_000_000
MAX_ARRAY_LEN = 50_000_000
MAX_STRING_BYTES = 64 * 1024 * 1024
MAX_DIMS = 8
DEFAULT_ALIGNMENT = 32  # GGUF's general.alignment when a file does not set it


class _BoundedReader:
    """Sequential little-endian reads that fail cleanly past the file's end or the header budget."""

    def __init__(self, handle: BinaryIO, size: int) -> None:
        self.handle = handle
        self.size = size
        self.pos = 0

    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise ModelError("GGUF header is truncated or corrupt", "re-download the file")
        if self.pos + n > MAX_HEADER_BYTES:
            raise ModelError("GGUF header is implausibly large (corrupt file?)", "re-download the file")
        data = self.handle.read(n)
        if len(data) != n:
            raise ModelError("GGUF header is truncated", "the download may be incomplete; re-download the file")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size or self.pos + n > MAX_HEADER_BYTES:
            raise ModelError("GGUF header is truncated or corrupt", "re-download the file")
        self.handle.seek(n, io.SEEK_CUR)
        self.pos += n

    def unpack(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.read(struct.calcsize("<" + fmt)))[0]


_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


def _read_string(reader: _BoundedReader) -> str:
    length = reader.unpack("Q")
    if length > MAX_STRING_BYTES:
        raise ModelError("GGUF header has an implausible string length (corrupt file?)", "re-download the file")
    return reader.read(length).decode("utf-8", errors="replace")


def _read_value(reader: _BoundedReader, value_type: int, keep_arrays: bool) -> Any:
    if value_type in _SCALAR_FORMATS:
        return reader.unpack(_SCALAR_FORMATS[value_type])
    if value_type == GGUFValueType.STRING:
        return _read_string(reader)
    if value_type == GGUFValueType.ARRAY:
        item_type = reader.unpack("I")
        count = reader.unpack("Q")
        if count > MAX_ARRAY_LEN:
            raise ModelError("GGUF header has an implausible array length (corrupt file?)", "re-download the file")
        if item_type in _SCALAR_FORMATS:
            width = struct.calcsize("<" + _SCALAR_FORMATS[item_type])
            if keep_arrays and count <= 4096:
                return list(struct.unpack(f"<{count}{_SCALAR_FORMATS[item_type]}", reader.read(width * count)))
            reader.skip(width * count)
            return count
        if item_type == GGUFValueType.STRING:
            for _ in range(count):  # strings must be walked; each read is bounded
                reader.skip(reader.unpack("Q"))
            return count
        raise ModelError("GGUF header has nested or unknown array types (corrupt file?)", "re-download the file")
    raise ModelError(f"GGUF header has an unknown value type {value_type} (corrupt or newer file)",
                     "re-download the file or update Switchyard")


@dataclass(frozen=True)
class GgufHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], int]]  # name, shape, ggml type
    offsets: list[int] = field(default_factory=list)  # each tensor's data offset, from the data section's start
    data_start: int = 0  # where the (aligned) data section begins
    size: int = 0  # the file's size in bytes

    def data_end(self) -> int:
        """The bytes a whole file holds: the data section's start plus its furthest tensor's end (a file without
        tensors, such as a metadata-only first shard, needs no data section)."""
        if not self.tensors:
            return 0
        ends = [offset + tensor_bytes(shape, kind)
                for offset, (_name, shape, kind) in zip(self.offsets, self.tensors, strict=True)]
        return self.data_start + max(ends, default=0)


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Parse a GGUF file's metadata and tensor table (not its data). Raises ModelError on anything malformed."""
    file = Path(path)
    try:
        size = file.stat().st_size
        handle = file.open("rb")
    except OSError as exc:
        raise ModelError(f"cannot open {file}: {exc.strerror}", "check the path and permissions") from exc
    with handle:
        reader = _BoundedReader(handle, size)
        if size < 4 or reader.read(4) != GGUF_MAGIC:
            raise ModelError(f"{file.name} is not a GGUF file (no GGUF magic)",
                             "pass a .gguf file, a config.json, a Hugging Face folder or a repo id")
        version = reader.unpack("I")
        if version not in (2, 3):
            raise ModelError(f"{file.name}: unsupported GGUF version {version}", "re-download or convert the model")
        n_tensors = reader.unpack("Q")
        n_kv = reader.unpack("Q")
        if n_tensors > MAX_TENSOR_COUNT or n_kv > MAX_KV_COUNT:
            raise ModelError(f"{file.name}: GGUF header claims {n_tensors} tensors and {n_kv} keys (corrupt file?)",
                             "re-download the file")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _read_string(reader)
            metadata[key] = _read_value(reader, reader.unpack("I"), keep_arrays=not key.startswith("tokenizer."))
        tensors: list[tuple[str, tuple[int, ...], int]] = []
        offsets: list[int] = []
        for _ in range(n_tensors):
            name = _read_string(reader)
            n_dims = reader.unpack("I")
            if n_dims > MAX_DIMS:
                raise ModelError(f"{file.name}: tensor {name!r} has {n_dims} dimensions (corrupt file?)",
                                 "re-download the file")
            shape = tuple(int(reader.unpack("Q")) for _ in range(n_dims))
            ggml_type = reader.unpack("I")
            offsets.append(int(reader.unpack("Q")))
            tensors.append((name, shape, ggml_type))
        alignment = metadata.get("general.alignment")
        alignment = alignment if isinstance(alignment, int) and 0 < alignment <= 1 << 20 else DEFAULT_ALIGNMENT
        data_start = -(-reader.pos // alignment) * alignment
    return GgufHeader(version=version, metadata=metadata, tensors=tensors, offsets=offsets, data_start=data_start,
                      size=size)


def tensor_bytes(shape: tuple[int, ...], ggml_type: int) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelError(f"GGUF tensor has an unknown type {ggml_type} (newer llama.cpp format?)",
                         "update Switchyard or re-convert the model") from None
    elements = math.prod(shape) if shape else 1
    if elements < 0 or elements > 2**50:
        raise ModelError("GGUF tensor has an implausible shape (corrupt file?)", "re-download the file")
    return (elements // block) * type_size


# The shard naming of gguf-split (and of Hub repos that ship split sets); 5 digits each, 1-based.
SHARD_NAME = re.compile(r"^(?P<stem>.*?)-(?P<index>\d{5})-of-(?P<count>\d{5})\.(?P<ext>gguf|safetensors)$", re.I)
SPLIT_HINT = "download every shard of the set into one folder (`switchyard pull` fetches a split set as one unit)"


def shard_name(stem: str, index: int, count: int) -> str:
    """The file name llama-server opens for shard `index` (1-based) of `count`."""
    return f"{stem}-{index:05d}-of-{count:05d}.gguf"


def set_stem(path: Path) -> str:
    """A file's name without `.gguf` and, for a shard, without `-0000K-of-0000N`: the model's name on disk."""
    name = SHARD_NAME.match(path.name)
    return name["stem"] if name is not None else path.stem


@dataclass(frozen=True)
class GgufModel:
    """A GGUF model as llama-server loads it: its metadata (the first shard's) and every tensor of every shard."""

    path: Path  # what to hand llama-server: the file, or the first shard of a split set
    metadata: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], int]]
    shards: tuple[Path, ...]
    file_starts: tuple[int, ...] = (0,)  # where each shard's tensors begin in `tensors` (each is mapped apart)

    def files(self) -> list[list[tuple[str, tuple[int, ...], int]]]:
        """The tensors of each shard, in file order."""
        ends = [*self.file_starts[1:], len(self.tensors)]
        return [self.tensors[start:end] for start, end in zip(self.file_starts, ends, strict=True)]


def read_gguf_model(path: str | Path) -> GgufModel:
    """Read a GGUF file, or the whole split set any one of its shards belongs to. Raises ModelError, in one line
    naming the shard and the fix, when a shard is missing, partial, out of order or from another set."""
    file = Path(path)
    header = read_gguf_header(file)
    count = header.metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT)
    if not isinstance(count, int) or count <= 1:
        return GgufModel(file, header.metadata, header.tensors, (file,))
    name = SHARD_NAME.match(file.name)
    if name is None or int(name["count"]) != count:
        raise ModelError(f"{file.name} is one shard of a GGUF split in {count}, but its name does not say which "
                         "files are the others", f"keep the names the split was written with "
                         f"({shard_name('NAME', 1, count)} ...)")
    shards = tuple(file.with_name(shard_name(name["stem"], index, count)) for index in range(1, count + 1))
    headers = [header if shard == file else None for shard in shards]
    for index, shard in enumerate(shards, 1):
        if not shard.is_file():
            raise ModelError(f"shard {index} of {count} of {name['stem']} is missing ({shard.name}): finish the "
                             "download", SPLIT_HINT)
    tensors: list[tuple[str, tuple[int, ...], int]] = []
    starts: list[int] = []
    for index, shard in enumerate(shards, 1):
        shard_header = headers[index - 1] = headers[index - 1] or read_gguf_header(shard)
        meta = shard_header.metadata
        if meta.get(Keys.Split.LLM_KV_SPLIT_NO) != index - 1 or meta.get(Keys.Split.LLM_KV_SPLIT_COUNT) != count:
            raise ModelError(f"{shard.name} says it is shard {_said(meta.get(Keys.Split.LLM_KV_SPLIT_NO))} of "
                             f"{meta.get(Keys.Split.LLM_KV_SPLIT_COUNT)}, not {index} of {count}: the folder mixes "
                             "files of different splits", SPLIT_HINT)
        if shard_header.size < shard_header.data_end():
            raise ModelError(f"shard {index} of {count} of {name['stem']} is incomplete ({shard_header.size:,} of "
                             f"{shard_header.data_end():,} bytes): finish the download", SPLIT_HINT)
        starts.append(len(tensors))
        tensors.extend(shard_header.tensors)
    metadata = headers[0].metadata if headers[0] is not None else {}
    expected = metadata.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    if isinstance(expected, int) and expected != len(tensors):
        raise ModelError(f"the {count} shards of {name['stem']} hold {len(tensors)} tensors, but the first says "
                         f"{expected}: a shard is from another download", SPLIT_HINT)
    return GgufModel(shards[0], metadata, tensors, shards, tuple(starts))


def _said(value: Any) -> str:
    return str(value + 1) if isinstance(value, int) else "?"


def gguf_in_folder(folder: Path) -> Path | None:
    """The one GGUF model a folder holds (a Hub cache snapshot of a GGUF repo, a download folder), as the path to
    hand llama-server: the file, or the first shard of its split set; None when it holds no GGUF. Subfolders count
    (repos keep large quants in `Q4_K_M/`); `mmproj` projectors are not models. Raises ModelError naming the
    choices when the folder holds several. Paths keep the folder's names: a snapshot's files are symlinks to blobs
    whose names say nothing of a split set."""
    sets: dict[tuple[Path, str], list[Path]] = {}
    for file in sorted(folder.rglob("*.gguf")):
        if "mmproj" in file.name.lower() or not file.is_file():  # a projector (models.projector)
            continue
        sets.setdefault((file.parent, set_stem(file) if SHARD_NAME.match(file.name) else file.name), []).append(file)
    if not sets:
        return None
    if len(sets) > 1:
        names = sorted(str(files[0].relative_to(folder)) for files in sets.values())
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        raise ModelError(f"{folder} holds {len(sets)} GGUF models ({shown})",
                         "name the file to serve (for a split set, any one of its shards)")
    return min(next(iter(sets.values())))
