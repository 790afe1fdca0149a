"""The mat-mul weights of a GGUF model, grouped by shape: what llama-server may copy into a repacked CPU buffer
(planning/repack.py holds the rule of which it copies, and how large the copy is).

The op each weight is used in comes from its name, as llama.cpp b11434 assigns it (src/llama-arch.cpp:749+, paths
relative to that build's tree): token_embd is GET_ROWS (never repacked), `*_exps` MUL_MAT_ID, norms and biases are
not mat-muls, the other 2-D weights and `output` MUL_MAT; a head tied to the embedding (no output.weight) is
token_embd loaded a second time as the output, a MUL_MAT (src/llama-model-loader.cpp:1163-1168).

Kept in the model's facts as (weight, count) groups: a model has thousands of tensors but a dozen shapes, and the
fit has to stay a pure function of (facts, snapshot, plan). Each file's *edges* are kept too, in file order: with
mmap, llama-server unmaps a file's head and tail outside the span of the tensors it still reads from the mapping
(src/llama-model-loader.cpp:1776-1787), so repacked weights at a file's very start or end leave the mapping, those
in between stay mapped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

MUL_MAT = "MUL_MAT"
MUL_MAT_ID = "MUL_MAT_ID"


@dataclass(frozen=True)
class Weight:
    """One weight tensor: its GGUF type name, its first two dims (ne0: values per row, ne1: rows), how many
    matrices of that shape it holds (experts), the op llama.cpp uses it in, and whether it is the output head
    (which a GPU plan places apart from the layers)."""

    type: str
    ne0: int
    ne1: int
    op: str
    matrices: int = 1
    head: bool = False


def op_of(name: str, dims: int) -> str | None:
    """The op llama.cpp uses a weight in, from its GGUF name: MUL_MAT, MUL_MAT_ID, or None (token_embd's GET_ROWS,
    norms, biases, anything not a mat-mul weight)."""
    if not name.endswith(".weight") or "norm" in name or name.startswith("token_embd"):
        return None
    if "_exps." in name:
        return MUL_MAT_ID if dims == 3 else None
    return MUL_MAT if dims == 2 else None


def weights_of(tensors: Iterable[tuple[str, tuple[int, ...], str]]) -> list[Weight]:
    """The mat-mul weights of a GGUF's tensors ((name, shape as ne0.., type name)); a head tied to the embedding
    (no output.weight) adds token_embd once more as the output."""
    out: list[Weight] = []
    embedding: Weight | None = None
    has_output = False
    for name, shape, kind in tensors:
        if len(shape) < 2:
            continue
        if name == "token_embd.weight":
            embedding = Weight(kind, shape[0], shape[1], MUL_MAT, head=True)
        has_output = has_output or name == "output.weight"
        op = op_of(name, len(shape))
        if op is not None:
            out.append(Weight(kind, shape[0], shape[1], op, shape[2] if len(shape) > 2 else 1,
                              head=name == "output.weight"))
    if not has_output and embedding is not None:
        out.append(embedding)
    return out


@dataclass(frozen=True)
class Edges:
    """One file's mat-mul weights before its first and after its last tensor that is never repacked (token_embd, a
    norm, ...), in file order (`tail` from the file's end backwards); `whole`: the file holds nothing else."""

    lead: tuple[Weight, ...] = ()
    tail: tuple[Weight, ...] = ()
    whole: bool = False


def edges_of(tensors: list[tuple[str, tuple[int, ...], str]]) -> Edges:
    """A file's edges, from its tensors in file order ((name, shape as ne0.., type name))."""

    def run(ordered: Iterable[tuple[str, tuple[int, ...], str]]) -> tuple[Weight, ...]:
        out = []
        for name, shape, kind in ordered:
            op = op_of(name, len(shape))
            if op is None:
                break
            out.append(Weight(kind, shape[0], shape[1], op, shape[2] if len(shape) > 2 else 1))
        return tuple(out)

    lead = run(tensors)
    if len(lead) == len(tensors):
        return Edges(lead, (), whole=True)
    return Edges(lead, run(reversed(tensors)))


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's rule for which layers' attn_v and ffn_down a *_K_M file keeps at Q6_K (the first and last
    eighth, every third in between; src/llama-quant.cpp)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def grouped(weights: Iterable[Weight]) -> tuple[tuple[Weight, int], ...]:
    """(weight, how many) per distinct weight, in first-seen order."""
    return tuple(Counter(weights).items())


__all__ = ["MUL_MAT", "MUL_MAT_ID", "Edges", "Weight", "edges_of", "grouped", "op_of", "use_more_bits", "weights_of"]
