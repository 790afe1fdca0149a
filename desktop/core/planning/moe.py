"""Where llama.cpp keeps a MoE's expert tensors: on the GPU with their layer, or in RAM.

A MoE that does not fit whole keeps every layer on the GPU and only the experts of some layers in RAM
(llama-server --n-cpu-moe K: the first K layers'): attention, KV and routing stay on the GPU, only those layers'
sparse expert matmuls run on the CPU. Pointless on unified memory (one pool). Kept apart from planning/fit.py so
the fit's memory arithmetic reads a placement, whatever asked for it.

A person may instead write the rules themselves (`-ot PATTERN=BUFFER,...`, what MoE guides show). llama-server
reads them as its loader does (src/llama-model-loader.cpp): every tensor takes the buffer of the FIRST rule whose
pattern `std::regex_search` finds in its name, --n-cpu-moe's own rules (common.h `blk\\.N<LLM_FFN_EXPS_REGEX>`)
first, since the plan's --n-cpu-moe comes before its -ot in the argv. Here the rules are searched in the model's
own tensor names the same way, part by part: the expert tensors a part sends to the CPU are counted in RAM (any
layers, not only a first few), and what the fit does not count (another buffer, other tensors) is named.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.models.facts import EXPERT_TENSOR, ModelFacts
from desktop.core.planning.weights import llama_expert_bytes

CPU_BUFFER = "CPU"  # the name of the CPU device's buffer type, as -ot takes it (exact: llama-server's map key)
EXPERTS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's LLM_FFN_EXPS_REGEX (common.h)
# Tensor names of a MoE layer when the file is not at hand (config-only facts): llama.cpp's usual ones.
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate_inp")
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class RuleReading:
    """What -ot rules do to one model's tensors: per layer, the expert bytes (of the file) sent to the CPU; the
    parts that did that; and the parts, each with why, that the fit does not count."""

    to_cpu: tuple[int, ...]
    counted: tuple[str, ...] = ()
    unaccounted: tuple[str, ...] = ()
    matches_nothing: tuple[str, ...] = ()


def rule_parts(rules: Sequence[str]) -> list[tuple[str, str, str]]:
    """(part as typed, pattern, buffer) of each comma-separated part, split where llama-server splits them."""
    parts = []
    for rule in rules:
        for part in rule.split(","):
            pattern, _, buffer = part.partition("=")
            parts.append((part, pattern, buffer))
    return parts


def model_tensors(facts: ModelFacts, experts: Sequence[int]) -> list[tuple[str, int]]:
    """(name, bytes) of the model's tensors: the GGUF's own, else llama.cpp's usual names for its architecture
    with the experts' bytes spread over a layer's three expert tensors."""
    if facts.tensor_sizes:
        return list(facts.tensor_sizes)
    names = [("token_embd.weight", 0), ("output_norm.weight", 0), ("output.weight", 0)]
    for layer in range(facts.n_layers):
        names += [(f"blk.{layer}.{name}.weight", 0) for name in _LAYER_TENSORS]
        share = experts[layer] // len(_EXPERT_TENSORS) if layer < len(experts) else 0
        names += [(f"blk.{layer}.{name}.weight", share) for name in _EXPERT_TENSORS]
    return names


def read_rules(facts: ModelFacts, experts: Sequence[int], n_cpu_moe: int, rules: Sequence[str]) -> RuleReading:
    """Each tensor to the first rule that finds its pattern in the name (--n-cpu-moe's first), as llama.cpp
    does; a part sending expert tensors to the CPU is counted by those tensors' bytes, per layer."""
    first: list[tuple[int, re.Pattern[str]]] = [(-1, re.compile(rf"blk\.{layer}{EXPERTS_REGEX}"))
                                                for layer in range(n_cpu_moe)]
    parts = rule_parts(rules)
    broken: dict[int, str] = {}
    for index, (_, pattern, _) in enumerate(parts):
        try:
            first.append((index, re.compile(pattern)))
        except re.error as exc:
            broken[index] = f"its pattern is not one Python reads the way llama.cpp does ({exc})"
    to_cpu = [0] * facts.n_layers
    claimed: dict[int, list[str]] = {}
    for name, size in model_tensors(facts, experts):
        owner = next((index for index, regex in first if regex.search(name)), None)
        if owner is None or owner < 0:
            continue
        claimed.setdefault(owner, []).append(name)
        expert = EXPERT_TENSOR.search(name)
        if parts[owner][2] == CPU_BUFFER and expert is not None and int(expert.group(1)) < facts.n_layers:
            to_cpu[int(expert.group(1))] += size
    counted, unaccounted, nothing = [], [], []
    for index, (part, _, buffer) in enumerate(parts):
        names = claimed.get(index, [])
        others = [name for name in names if EXPERT_TENSOR.search(name) is None]
        if index in broken:
            unaccounted.append(f"-ot {part} ({broken[index]})")
        elif not names:
            nothing.append(part)
        elif buffer != CPU_BUFFER:
            unaccounted.append(f"-ot {part} (tensors to {buffer}: the fit keeps them where their layer is)")
        elif others:
            also = "also " if len(others) < len(names) else ""
            unaccounted.append(f"-ot {part} (it {also}sends {_listed(others)} to the CPU; the fit counts the MoE "
                               "expert tensors an -ot rule sends there, no others)")
        if buffer == CPU_BUFFER and len(others) < len(names):
            counted.append(part)
    return RuleReading(tuple(to_cpu), tuple(counted), tuple(unaccounted), tuple(nothing))


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _layers(layers: Sequence[int]) -> str:
    """0-3, 5: layer numbers in runs."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


@dataclass(frozen=True)
class ExpertPlacement:
    """The layers -ngl puts on the GPU and, per layer, the expert bytes kept in RAM."""

    gpu_layers: int  # -ngl: the last N layers (N = n_layers + 1 with the output)
    experts: tuple[int, ...] = ()  # per layer, its MoE expert bytes (empty: a dense model, or one memory pool)
    in_ram: tuple[int, ...] = ()  # per layer, the expert bytes kept in RAM whichever device the layer is on
    n_cpu_moe: int = 0  # --n-cpu-moe K: the experts of the first K layers
    rules: tuple[str, ...] = ()  # the -ot parts that keep expert tensors in RAM

    def moved(self, on_gpu_layers: int) -> int:
        """Expert bytes in RAM that belong to layers on the GPU (-ngl N puts the last N there): what leaves it."""
        first = len(self.experts) - on_gpu_layers
        return sum(size for layer, size in enumerate(self.in_ram) if layer >= first)

    def expert_share(self, cpu_layers: int, moved: int) -> float | None:
        """The share of all expert bytes on the CPU (those of its whole layers and those moved); None: no MoE."""
        total = sum(self.experts)
        return (sum(self.experts[:cpu_layers]) + moved) / total if total else None

    def layers_in_ram(self) -> list[int]:
        return [layer for layer, size in enumerate(self.in_ram) if size]

    def what(self) -> str:
        """Which experts are in RAM, in words: `3 layers` for --n-cpu-moe's first three, else their numbers."""
        whole = [layer for layer in self.layers_in_ram() if self.in_ram[layer] >= self.experts[layer]]
        part = [layer for layer in self.layers_in_ram() if self.in_ram[layer] < self.experts[layer]]
        if whole == list(range(len(whole))) and not part and not self.rules:
            return f"experts of {len(whole)} layers"
        text = [f"experts of layer{'s' if len(whole) > 1 else ''} {_layers(whole)}"] if whole else []
        text += [f"some experts of layer{'s' if len(part) > 1 else ''} {_layers(part)}"] if part else []
        return " and ".join(text)

    def flags(self) -> str:
        return ", ".join(([f"--n-cpu-moe {self.n_cpu_moe}"] if self.n_cpu_moe else [])
                         + [f"-ot {rule}" for rule in self.rules])

    def partial_note(self, moved: int) -> str:
        return (f"partial: {self.what()} in RAM ({self.flags()}, {_gib(moved):.2f} GiB); every layer's attention, "
                "KV and routing on the GPU, only those layers' expert matmuls on the CPU")

    def no_room_note(self, moved: int) -> str:
        return f"the {self.what()} ({_gib(moved):.2f} GiB) do not fit in free RAM either"

    @property
    def any_in_ram(self) -> bool:
        return any(self.in_ram)


def _gib(value: float) -> float:
    return round(value / GIB, 3)


def rule_notes(reading: RuleReading) -> list[str]:
    """The fit's words on the -ot parts it did not count."""
    notes = [f"-ot {part} matches no tensor of this model that an earlier rule has not taken"
             for part in reading.matches_nothing]
    if reading.unaccounted:
        notes.append("not accounted by the fit: " + "; ".join(reading.unaccounted))
    return notes


def cpu_plan_notes(n_cpu_moe: int | None, rules: Sequence[str]) -> list[str]:
    """A plan that runs on the CPU keeps every expert in RAM already: what --n-cpu-moe and -ot rules to the CPU
    change there is nothing, said rather than dropped silently; -ot parts to another buffer are not counted."""
    notes = ["--n-cpu-moe has no effect here: the plan runs on the CPU, where every expert is already"] \
        if n_cpu_moe is not None else []
    parts = rule_parts(rules)
    to_cpu = [part for part, _, buffer in parts if buffer == CPU_BUFFER]
    other = [part for part, _, buffer in parts if buffer != CPU_BUFFER]
    if to_cpu:
        notes.append(f"-ot {','.join(to_cpu)} has no effect here: the plan runs on the CPU")
    if other:
        notes.append("not accounted by the fit: " + "; ".join(f"-ot {part}" for part in other))
    return notes


def place(facts: ModelFacts, hw: HardwareSnapshot, weights: int, quant: str, *, n_cpu_moe: int | None,
          rules: Sequence[str], gpu_layers: int | None, full_gpu: int, gpu_free: int,
          layers_that_fit: Callable[[], int], notes: list[str]) -> ExpertPlacement:
    """-ngl and the experts in RAM for a GPU plan: what was asked (-ngl; --n-cpu-moe, 0 too, or -ot rules that send
    experts to the CPU: every layer on the GPU), else everything when it fits, else every layer with the experts of
    the fewest first layers in RAM, else the whole layers that fit. `full_gpu`: the GPU bytes of every layer and
    the output; `gpu_free`: free now. Notes what was asked and does nothing, and the -ot parts not counted."""
    n_layers = facts.n_layers
    experts = [] if hw.has_unified_memory else llama_expert_bytes(facts, weights, quant)
    if n_cpu_moe is not None and not experts:
        why = "one memory pool (unified memory)" if hw.has_unified_memory and facts.is_moe else \
            "the model has no MoE expert tensors"
        notes.append(f"--n-cpu-moe has no effect here: {why}")
    k = min(n_cpu_moe or 0, n_layers) if experts else 0
    reading = read_rules(facts, experts, k, rules) if rules else RuleReading((0,) * n_layers)
    notes += rule_notes(reading)
    if reading.counted and not experts:
        notes.append(f"-ot {','.join(reading.counted)} has no effect on memory here: one memory pool (unified memory)")
    by_rules = _scaled(reading.to_cpu, experts, facts) if experts else []
    asked = experts and (n_cpu_moe is not None or any(by_rules))
    if gpu_layers is not None:
        layers = min(gpu_layers, n_layers + 1)
    elif asked:  # every layer on the GPU, those experts not
        layers = n_layers + 1
    elif full_gpu <= gpu_free:
        layers = n_layers + 1
    elif experts and full_gpu - sum(experts) <= gpu_free:
        layers = n_layers + 1
        k = next(k for k in range(1, n_layers + 1) if full_gpu - sum(experts[:k]) <= gpu_free)
    else:
        layers = layers_that_fit()
    in_ram = tuple(size if layer < k else by_rules[layer] if by_rules else 0 for layer, size in enumerate(experts))
    counted = reading.counted if any(by_rules) else ()
    return ExpertPlacement(layers, tuple(experts), in_ram, k, counted)


def _scaled(to_cpu: Sequence[int], experts: Sequence[int], facts: ModelFacts) -> list[int]:
    """Per layer, the expert bytes the rules send to the CPU at the load's size: the file's bytes when the file is
    what loads, else the same share of the layer's experts (a what-if quantization)."""
    in_file = facts.expert_layer_bytes or tuple(size // len(_EXPERT_TENSORS) * len(_EXPERT_TENSORS)
                                                for size in experts)
    return [size if size == 0 or layer >= len(in_file) or in_file[layer] == experts[layer]
            else experts[layer] * size // max(in_file[layer], 1)
            for layer, size in enumerate(to_cpu)][:len(experts)]
