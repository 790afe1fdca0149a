"""summary.json for benchmarks/gpu_check.sh: per step its status and the few numbers worth reading, the engine's
own memory lines (llama.cpp's "CUDA0 model/KV/compute buffer size") next to the fit's, and what could not be done.

    python benchmarks/gpu_check_summary.py OUT BUDGET START MODE
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

BUFFER = re.compile(r"(CUDA\d+|Vulkan\d+|ROCm\d+|MTL\d+|CPU)[_ A-Za-z]*?\s+(model|KV|compute) buffer size\s*=\s*"
                    r"([\d.]+) MiB")


def load(out: Path, name: str) -> Any:
    try:
        return json.loads((out / "steps" / f"{name}.out").read_text())
    except (OSError, ValueError):
        return None


def engine_buffers(log_text: str) -> dict[str, float]:
    """Sum of each buffer kind per device, in GiB, from one llama-server log."""
    found: dict[str, float] = {}
    for device, kind, mib in BUFFER.findall(log_text):
        key = f"{device}_{kind.lower()}_gib"
        found[key] = round(found.get(key, 0.0) + float(mib) / 1024, 3)
    return found


def numbers(out: Path, step: str, data: Any) -> Any:
    if data is None:
        return None
    if step == "detect":
        return {"gpus": [{k: g.get(k) for k in ("name", "uuid", "mig", "memory_total_bytes", "memory_free_bytes",
                                                  "compute_capability", "driver_version", "cuda_version") if k in g}
                         for g in data.get("gpus", [])], "notes": data.get("notes")}
    if step.endswith("_plan"):
        return [{k: r.get(k) for k in ("engine", "variant", "source", "reason", "packages", "cuda_build",
                                       "cmake_flags", "needs") if k in r} for r in data]
    if step == "llama_install":
        rows = data if isinstance(data, list) else [data]
        return [{"version": r.get("version"), "devices": (r.get("details") or {}).get("devices"),
                 "built_seconds": (r.get("details") or {}).get("built_seconds")} for r in rows]
    if step == "engines_doctor":
        return [f for f in data if f.get("check") in ("GPU device", "GPU", "llama-server", "backend")]
    if step.startswith("fit_"):
        fit = data.get("fit") or {}
        return {"argv": data.get("argv"), "fits": fit.get("fits"), "gpu_layers": fit.get("gpu_layers"),
                "total_layers": fit.get("total_layers"), "breakdown": fit.get("breakdown"),
                "total_gib": fit.get("total_gib"), "available_gib": fit.get("available_gib")}
    if step.startswith("engine_memory_"):
        return {k: data.get(k) for k in ("listening", "nvidia_smi_used_mib")}
    if step.startswith("t123_"):
        return {k: data.get(k) for k in ("t1_s", "t2_s", "t3_s", "chunks", "nvidia_smi_used_mib")}
    if step == "sweep":
        levels = data.get("levels") or data.get("results") or []
        return [{"concurrency": (level.get("config") or {}).get("concurrency"),
                 **{k: level.get(k) for k in ("output_throughput", "request_throughput", "median_ttft_ms",
                                              "median_tpot_ms", "completed", "errors") if k in level}}
                for level in levels] if isinstance(levels, list) else levels
    if step == "torch_cuda":
        return data
    return None


def main() -> int:
    out, budget, start, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, rc, secs, status, why = (line.split("\t") + [""] * 5)[:5]
        entry: dict[str, Any] = {"step": name, "status": status, "rc": int(rc) if rc else None,
                                 "seconds": float(secs or 0)}
        if why:
            entry["note"] = why
        try:
            found = numbers(out, name, load(out, name))
        except Exception as exc:  # a surprising shape must not lose the summary
            found = {"unreadable": repr(exc)}
        if found is not None:
            entry["numbers"] = found
        steps.append(entry)
    memory = []
    for log in sorted((out / "logs").glob("llama.cpp-*.log")):
        buffers = engine_buffers(log.read_text(errors="replace"))
        if buffers:
            memory.append({"log": log.name, **buffers})
    fits = {e["step"]: (e.get("numbers") or {}).get("breakdown") for e in steps if e["step"].startswith("fit_")}
    summary = {
        "kind": "gpu_check",
        "mode": mode,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
        "total_seconds": round(time.time() - start, 1),
        "budget_seconds": budget,
        "vllm": "not installed here: no network to PyPI and its CUDA wheel is far over the 64 MiB carry limit "
                "(see vllm_plan for the build the app would choose for this driver)",
        "engine_memory_vs_fit": {"engine_logs": memory, "fit_breakdowns": fits},
        "could_not": [n for n in (out / "notes.txt").read_text().splitlines() if n],
        "counts": {s: sum(1 for e in steps if e["status"] == s)
                   for s in ("ok", "failed", "timeout", "skipped", "dry-run")},
        "steps": steps,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["counts"]), "->", out / "summary.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
