"""The engines' own memory report, read from their startup log: the ground truth the fit is measured against.

llama-server with `-v` prints, per buffer, `model buffer size`, `KV buffer size` and `compute buffer size`
(MiB, two decimals) and a `common_memory_breakdown_print` table (whole MiB per device); its `--fit` prints the
memory it projects (`projected to use N MiB`). vLLM prints the weights it loaded (`Model loading took X GiB`
on GPUs), the KV cache memory (`Available KV cache memory`; the CPU build says `Explicitly set (X/Y) GiB for KV cache` and
logs its weights only as `Checkpoint size: X GiB`), `KV cache size: N tokens`, `Maximum concurrency for L tokens per request: X`, and on CUDA its activation
peak and CUDA-graph size. One parser for both, shared by the fit benchmark, `switchyard calibrate` and every
launch the app records (desktop.core.runtime.launches): each number keeps the log line it came from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

MIB = 1024**2
GIB = 1024**3

# Components, the fit's names: weights, repacked (llama.cpp's repacked CPU copy of weights: AMX, CPU_REPACK and the
# other extra CPU buffers, beside the mapped file), kv_cache, compute (llama.cpp compute buffers / vLLM activation
# peak), cuda_graphs (vLLM on CUDA), non_torch (vLLM on CUDA).
COMPONENTS = ("weights", "repacked", "kv_cache", "compute", "cuda_graphs", "non_torch")
# llama.cpp's extra CPU buffer types (ggml-cpu.cpp:42-74): a model buffer of one of these is a repacked copy
EXTRA_CPU_BUFFERS = ("AMX", "CPU_REPACK", "CPU_KLEIDIAI", "CPU_RISCV64_SPACEMIT")

_LLAMA_BUFFER = re.compile(
    r"(?P<fn>\w+):\s+(?P<buf>\S+)\s+(?P<kind>model|KV|compute) buffer size\s*=\s*(?P<mib>[\d.]+) MiB")
_LLAMA_TABLE = re.compile(
    r"memory_breakdown_print:\s*\|\s*-\s*(?P<dev>.+?)\s*\|\s*(?P<rest>[\d\s=+()]+?)\s*\|")
_LLAMA_OUTPUT = re.compile(r"llama_context:\s+(?P<buf>\S+)\s+output buffer size\s*=\s*(?P<mib>[\d.]+) MiB")
_LLAMA_FIT = re.compile(r"projected to use (?P<mib>\d+) MiB of (?P<what>host|device) memory vs\. (?P<avail>\d+) MiB")
_LLAMA_KV_CELLS = re.compile(r"llama_kv_cache:\s+size\s*=\s*(?P<mib>[\d.]+) MiB \(\s*(?P<cells>\d+) cells,\s*"
                             r"(?P<layers>\d+) layers")
_VLLM_WEIGHTS = re.compile(r"Model loading took\s*(?P<gib>[\d.]+)\s*GiB")
_VLLM_WEIGHTS_MEM = re.compile(r"Loading (?:model )?weights took\s*(?P<gib>[\d.]+)\s*GiB")
_VLLM_KV_MEM = re.compile(r"Available KV cache memory:\s*(?P<gib>-?[\d.]+)\s*GiB"
                          r"|Explicitly set \((?P<cpu>[\d.]+)/[\d.]+\) GiB for KV cache")
_VLLM_CHECKPOINT = re.compile(r"Checkpoint size:\s*(?P<gib>[\d.]+)\s*GiB")
_VLLM_KV_TOKENS = re.compile(r"KV cache size:\s*(?P<tokens>[\d,]+)\s*tokens")
_VLLM_CONCURRENCY = re.compile(r"Maximum concurrency for\s*(?P<len>[\d,]+)\s*tokens per request:\s*(?P<x>[\d.]+)x?")
_VLLM_ACTIVATION = re.compile(r"(?:activation|torch) peak memory(?: increase)?(?: takes|:)?\s*(?P<gib>[\d.]+)\s*GiB")
_VLLM_NON_TORCH = re.compile(r"non[-_ ]torch (?:peak )?memory(?: takes|:)?\s*(?P<gib>[\d.]+)\s*GiB")
_VLLM_GRAPHS = re.compile(r"Graph capturing finished in\s*[\d.]+\s*secs?,\s*took\s*(?P<gib>[\d.]+)\s*GiB")
_VLLM_GRAPH_ESTIMATE = re.compile(r"CUDA graph memory[^\d]*(?P<gib>[\d.]+)\s*GiB")


@dataclass
class MemoryReport:
    """One launch's memory as the engine reported it (bytes per component) and the lines it came from."""

    engine: str
    components: dict[str, int] = field(default_factory=dict)  # COMPONENTS -> bytes
    devices: dict[str, dict[str, int]] = field(default_factory=dict)  # buffer/device name -> component -> bytes
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_concurrency_len: int | None = None
    kv_cells: int | None = None  # llama.cpp: cells of the (largest) KV cache
    engine_fit_bytes: dict[str, int] = field(default_factory=dict)  # llama.cpp --fit: host/device -> projected
    lines: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(v for k, v in self.components.items()
                   if k in ("weights", "repacked", "kv_cache", "compute", "cuda_graphs"))

    def gib(self, component: str) -> float | None:
        value = self.components.get(component)
        return round(value / GIB, 4) if value is not None else None

    def empty(self) -> bool:
        return not self.components and self.kv_cache_tokens is None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["total_bytes"] = self.total_bytes
        return data

    def summary_gib(self) -> dict[str, float]:
        """Component -> GiB (3 decimals), the form history rows keep."""
        out = {f"{k}_gib": round(v / GIB, 4) for k, v in self.components.items()}
        if self.kv_cache_tokens is not None:
            out["kv_cache_tokens"] = self.kv_cache_tokens
        return out


def _add(report: MemoryReport, device: str, component: str, value: int) -> None:
    report.components[component] = report.components.get(component, 0) + value
    per = report.devices.setdefault(device, {})
    per[component] = per.get(component, 0) + value


def parse_llama(lines: Iterable[str]) -> MemoryReport:
    """llama-server -v. Its `--fit` first loads the model without allocating (every buffer line reads 0.00 MiB,
    then a breakdown table and `projected to use N MiB`): that pass is the engine's own plan, kept in
    `engine_fit_bytes`. The real load follows; its buffer lines are the measurement. A new pass starts at a model
    buffer line after a compute buffer line, and the last pass counts. The output (logits) buffer is counted
    under compute, with the scheduler's compute buffers."""
    report = MemoryReport("llama.cpp")
    passes: list[list[tuple[str, str, int, str]]] = [[]]
    kv_cells: list[list[int]] = [[]]
    for line in lines:
        if (m := _LLAMA_FIT.search(line)) is not None:
            report.engine_fit_bytes[m["what"]] = int(m["mib"]) * MIB
            report.engine_fit_bytes[f"{m['what']}_available"] = int(m["avail"]) * MIB
            report.lines.append(line.strip())
            continue
        if _LLAMA_TABLE.search(line):
            report.lines.append(line.strip())
            continue
        if (m := _LLAMA_KV_CELLS.search(line)) is not None:
            kv_cells[-1].append(int(m["cells"]))
            continue
        m = _LLAMA_BUFFER.search(line)
        if m is None:
            if (o := _LLAMA_OUTPUT.search(line)) is not None:
                passes[-1].append(("compute", o["buf"] + " output", int(round(float(o["mib"]) * MIB)), line.strip()))
            continue
        component = {"model": "weights", "KV": "kv_cache", "compute": "compute"}[m["kind"]]
        if component == "weights" and any(c == "compute" for c, *_ in passes[-1]):
            passes.append([])
            kv_cells.append([])
        passes[-1].append((component, m["buf"], int(round(float(m["mib"]) * MIB)), line.strip()))
    real = passes[-1]
    for component, device, value, text in real:
        if component == "weights" and device in EXTRA_CPU_BUFFERS:
            component = "repacked"
        _add(report, device, component, value)
        report.lines.append(text)
    if kv_cells[-1]:
        report.kv_cells = sum(kv_cells[-1])
    return report


def parse_vllm(lines: Iterable[str]) -> MemoryReport:
    """vLLM's startup lines (API server and EngineCore both write to the log)."""
    report = MemoryReport("vllm")
    for line in lines:
        hit = True
        if (m := _VLLM_WEIGHTS.search(line)) is not None or (m := _VLLM_WEIGHTS_MEM.search(line)) is not None:
            report.components["weights"] = int(float(m["gib"]) * GIB)
        elif (m := _VLLM_KV_MEM.search(line)) is not None:
            report.components["kv_cache"] = int(float(m["gib"] or m["cpu"]) * GIB)
        elif (m := _VLLM_CHECKPOINT.search(line)) is not None and "weights" not in report.components:
            # the CPU build logs no "Model loading took": the checkpoint it loads (2 decimals) is its weights
            report.components["weights"] = int(float(m["gib"]) * GIB)
        elif (m := _VLLM_KV_TOKENS.search(line)) is not None:
            report.kv_cache_tokens = int(m["tokens"].replace(",", ""))
            if (c := _VLLM_CONCURRENCY.search(line)) is not None:
                report.max_concurrency = float(c["x"])
                report.max_concurrency_len = int(c["len"].replace(",", ""))
        elif (m := _VLLM_ACTIVATION.search(line)) is not None:
            report.components["compute"] = int(float(m["gib"]) * GIB)
        elif (m := _VLLM_NON_TORCH.search(line)) is not None:
            report.components["non_torch"] = int(float(m["gib"]) * GIB)
        elif (m := _VLLM_GRAPHS.search(line)) is not None or (m := _VLLM_GRAPH_ESTIMATE.search(line)) is not None:
            report.components["cuda_graphs"] = int(float(m["gib"]) * GIB)
        else:
            hit = False
        if hit:
            report.lines.append(line.strip())
    return report


def parse(engine: str, lines: Iterable[str]) -> MemoryReport:
    """The memory report of `engine` ("llama.cpp" or "vllm") from its log lines."""
    return parse_llama(list(lines)) if engine == "llama.cpp" else parse_vllm(lines)


def memory_lines_done(engine: str, lines: list[str]) -> bool:
    """Whether the engine has printed everything it will about memory at load (a probe launch can stop)."""
    if engine == "llama.cpp":
        return any("compute buffer size" in line for line in lines) and any(
            "memory_breakdown_print" in line or "server is listening" in line or "model loaded" in line
            for line in lines)
    return any(_VLLM_CONCURRENCY.search(line) for line in lines)
