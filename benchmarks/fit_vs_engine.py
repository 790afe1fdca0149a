"""The fit measured against the engines themselves: tiny checkpoints of real architectures, launched for real.

For each architecture of desktop.core.models.archs (Llama 3, Llama 3.2 tied, Qwen3, Gemma 3, Mistral, Phi-3,
Qwen3-MoE, Mixtral) this launches the real llama-server (`-v`, each GGUF type, three -c/-np settings) and the
real vLLM CPU build (--enforce-eager, three --max-model-len/--max-num-seqs/KV-space settings), reads each
engine's own memory report (desktop.core.engines.memory_report), and compares it with `planning/fit.py`'s
estimate per component (weights as mapped, the repacked copy, KV cache, compute) and in total over every buffer
row, and vLLM's KV cache tokens.

llama-server runs as the app launches it (its CPU weight repack on; `--no-repack` only where a crash retry adds
it, as the app does). `--no-repack` runs the earlier harness configuration instead (weights = the file's bytes,
no repacked copy), written to `points-no-repack.json`.

Each point records the engine version, argv, the log lines the numbers came from, and the fit's numbers. The
architectures are split: the fit's formulas were adjusted looking at the *tuning* architectures only; the
*held-out* ones are reported separately (they share features with tuning ones, never their shapes).

    python benchmarks/fit_vs_engine.py                      # everything (~20 min on 2 cores)
    python benchmarks/fit_vs_engine.py --engines llama.cpp  # llama-server only (~3 min)
    python benchmarks/fit_vs_engine.py --quick              # 2 architectures, 1 setting each (CI-sized)
    python benchmarks/fit_vs_engine.py --from-json FILE     # re-print a committed run's summary

Memory numbers do not depend on load; the load average is recorded anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from desktop.core.engines import get_adapter  # noqa: E402
from desktop.core.engines.base import LaunchPlan  # noqa: E402
from desktop.core.engines.memory_report import MemoryReport  # noqa: E402
from desktop.core.machine.hardware import HardwareSnapshot, detect  # noqa: E402
from desktop.core.models import archs  # noqa: E402
from desktop.core.models.facts import facts_from_gguf, facts_from_hf_folder  # noqa: E402
from desktop.core.planning import calibration  # noqa: E402
from desktop.core.planning.fit import estimate, exact_bytes  # noqa: E402
from desktop.core.runtime.memprobe import probe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fit"
TUNING = ("llama3", "qwen3", "gemma3", "qwen3moe")
HELD_OUT = ("llama32-tied", "mistral", "phi3", "mixtral")
LLAMA_SETTINGS = ((1024, 1), (2048, 2), (4096, 4))  # (ctx per request, slots): -c 1024, 4096, 16384
VLLM_SETTINGS = ((1024, 1, 1.0), (2048, 2, 1.0), (4096, 4, 2.0))  # (max-model-len, max-num-seqs, KV GiB)
COMPONENTS = ("weights", "repacked", "kv_cache", "compute", "total", "kv_tokens")


def split_of(arch: str) -> str:
    return "tuning" if arch in TUNING else "held_out"


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def compare(engine: str, report: MemoryReport, fit: Any) -> dict[str, Any]:
    """Measured and predicted bytes per component, and the relative error (predicted - measured) / measured
    (planning.calibration.components: the same comparison `switchyard calibrate` stores)."""
    pairs = calibration.components(engine, report, fit)
    measured = {k: pairs[k][1] if k in pairs else None for k in COMPONENTS}
    predicted = {k: pairs[k][0] if k in pairs else None for k in COMPONENTS}
    errors = {k: _rel(predicted[k], measured[k]) for k in COMPONENTS}
    return {"measured": measured, "predicted": predicted, "relative_error": errors}


# The earlier harness ran llama-server with --no-repack (an AMX VM whose repack died with SIGILL on quantized
# types): weights are then the GGUF's own bytes. The app launches without it; a crash retry adds it.
NO_REPACK_ARGS = ("--no-repack",)
DEFAULT, NO_REPACK = "default", "no-repack"


def _plan(engine: str, model_path: Path, setting: dict[str, Any], launch: str = DEFAULT) -> LaunchPlan:
    if engine == "llama.cpp":
        return LaunchPlan(engine=engine, model_path=model_path, ctx_per_request=setting["ctx_per_request"],
                          slots=setting["slots"], threads=2, extra_args=NO_REPACK_ARGS if launch == NO_REPACK else ())
    return LaunchPlan(engine=engine, model_path=model_path, ctx_per_request=setting["ctx_per_request"],
                      slots=setting["slots"], eager=True, kv_cache_gib=setting["kv_cache_gib"], threads=2)


def _facts(engine: str, arch: str, quant: str | None) -> tuple[Path, Any]:
    model = archs.ensure_arch(arch)
    if engine == "llama.cpp":
        path = model.gguf_paths[quant or "F16"]
        return path, facts_from_gguf(path)
    return model.hf_dir, facts_from_hf_folder(model.hf_dir)


def _fit_part(fit: Any) -> dict[str, Any]:
    return {"fits": fit.fits, "weights_gib": fit.weights_gib, "kv_cache_gib": fit.kv_cache_gib,
            "overhead_gib": fit.overhead_gib, "total_gib": fit.total_gib, "kv_cache_tokens": fit.kv_cache_tokens,
            "bytes": exact_bytes(fit)}


def _memory_failure(error: str | None) -> bool:
    """A refusal about memory (the verdict's business), not an unsupported architecture or a crash."""
    text = (error or "").lower()
    return any(word in text for word in ("memory", "kv cache", "allocate", "oom", "too large"))


def evaluate(point: dict[str, Any], hardware: HardwareSnapshot) -> dict[str, Any]:
    """The fit's side of a point, from the current code: the engine's side (report, started) stays as measured."""
    engine, setting = point["engine"], point["setting"]
    path, facts = _facts(engine, point["arch"], point.get("quant"))
    plan = _plan(engine, path, setting, point.get("launch", NO_REPACK))  # the first committed run: --no-repack
    if point.get("retried"):  # the engine crashed and ran with the crash retry's arguments: fit what ran
        plan = replace(plan, extra_args=tuple(dict.fromkeys((*plan.extra_args, *NO_REPACK_ARGS))))
    fit = estimate(facts, hardware, plan)
    point = {**point, "fit": _fit_part(fit)}
    for key in ("measured", "predicted", "relative_error"):
        point.pop(key, None)
    if point["started"]:
        point["verdict_ok"] = fit.fits != "no"
        point.update(compare(engine, report_from_json(point["report"]), fit))
    else:
        point["verdict_ok"] = fit.fits == "no" if _memory_failure(point.get("error")) else None
    return point


def report_from_json(data: dict[str, Any]) -> MemoryReport:
    known = {f.name for f in fields(MemoryReport)}
    return MemoryReport(**{k: v for k, v in data.items() if k in known})


def run_point(engine: str, arch: str, quant: str | None, setting: dict[str, Any],
              hardware: HardwareSnapshot, launch: str = DEFAULT) -> dict[str, Any]:
    adapter = get_adapter(engine)
    install = adapter.find_install()
    if install is None:
        raise SystemExit(f"{engine} is not installed: switchyard engines install {engine}")
    path, facts = _facts(engine, arch, quant)
    plan = _plan(engine, path, setting, launch)
    fit = estimate(facts, hardware, plan)
    result = probe(adapter, install, replace(fit.plan or plan, port=0, threads=2), timeout=900)
    home = str(Path.home())
    point = {"engine": engine, "engine_version": result.version, "arch": arch, "split": split_of(arch),
             "features": list(archs.ARCHS[arch].features), "quant": quant, "model": path.name, "setting": setting,
             "argv": ["~" + a[len(home):] if a.startswith(home) else a for a in result.argv],
             "env": result.env, "started": result.started, "error": result.error, "launch": launch,
             "retried": result.retried,
             "seconds": round(result.seconds, 1), "lines": result.report.lines, "report": result.report.to_json(),
             "engine_fit": result.report.engine_fit_bytes}
    if not result.started:
        point["tail"] = result.tail[-10:]
    return evaluate(point, hardware)


def summarise(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst |relative error| per engine, split and component; wrong verdicts counted."""
    out: dict[str, Any] = {}
    for engine in sorted({p["engine"] for p in points}):
        for split in ("tuning", "held_out", "all"):
            chosen = [p for p in points if p["engine"] == engine and (split == "all" or p["split"] == split)]
            if not chosen:
                continue
            row: dict[str, Any] = {"points": len(chosen),
                                   "wrong_verdicts": sum(1 for p in chosen if p["verdict_ok"] is False),
                                   "not_started": sum(1 for p in chosen if not p["started"])}
            for component in COMPONENTS:
                values = [abs(p["relative_error"][component]) for p in chosen
                          if p.get("relative_error", {}).get(component) is not None]
                if values:
                    worst = max(chosen, key=lambda p: abs((p.get("relative_error") or {}).get(component) or 0))
                    row[component] = {"n": len(values), "median": round(statistics.median(values), 4),
                                      "worst": round(max(values), 4),
                                      "worst_point": f"{worst['arch']} {worst.get('quant') or ''} "
                                                     f"{worst['setting']}".strip()}
            out[f"{engine}/{split}"] = row
    return out


def print_summary(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"fit vs engine: {meta.get('points')} points, {meta.get('archs')} architectures; "
             f"llama.cpp {meta.get('versions', {}).get('llama.cpp')} ({meta.get('launch', NO_REPACK)} launch), "
             f"vLLM {meta.get('versions', {}).get('vllm')}; "
             f"load average {meta.get('loadavg_before')} -> {meta.get('loadavg_after')}",
             f"{'engine/split':22}{'points':>7}{'wrong':>6}  " + "".join(f"{c + ' med/worst':>22}" for c in COMPONENTS)]
    for key, row in summary.items():
        cells = []
        for component in COMPONENTS:
            cell = row.get(component)
            cells.append(f"{cell['median'] * 100:9.2f}% /{cell['worst'] * 100:8.2f}%" if cell else f"{'-':>20}")
        lines.append(f"{key:22}{row['points']:>7}{row['wrong_verdicts']:>6}  " + "  ".join(f"{c:>20}" for c in cells))
    text = "\n".join(lines)
    print(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=",".join(archs.ARCHS), help="comma-separated architecture keys")
    parser.add_argument("--engines", default="llama.cpp,vllm")
    parser.add_argument("--quants", default=",".join(archs.GGUF_TYPES), help="GGUF types for llama.cpp")
    parser.add_argument("--quick", action="store_true", help="llama3 + gemma3, one setting, F16 and Q4_K_M")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--from-json", type=Path, help="print the summary of a saved points.json")
    parser.add_argument("--vllm-settings", default="0,1,2", help="which of VLLM_SETTINGS to run (indexes)")
    parser.add_argument("--llama-settings", default="0,1,2", help="which of LLAMA_SETTINGS to run (indexes)")
    parser.add_argument("--append", action="store_true",
                        help="add to the points already in OUT/points.json (or its .partial.json), skipping points "
                             "measured there: a long run can be done in passes")
    parser.add_argument("--no-repack", action="store_true",
                        help="run llama-server with --no-repack (the earlier harness), into points-no-repack.json")
    parser.add_argument("--refit", type=Path, help="recompute the fit's side of a saved points.json (the engines' "
                                                   "measurements are kept) and rewrite it")
    args = parser.parse_args()
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        print_summary(summarise(data["points"]), data["meta"])
        return 0
    if args.refit:
        # The engines' measurements stay as recorded; the fit's side is recomputed by the code as it is now.
        data = json.loads(args.refit.read_text())
        hardware = detect()
        data["points"] = [evaluate(p, hardware) for p in data["points"]]
        data["meta"]["refit"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data["summary"] = summarise(data["points"])
        text = print_summary(data["summary"], data["meta"])
        args.refit.write_text(json.dumps(data, indent=1) + "\n")
        args.refit.with_name(args.refit.stem + "-summary.txt").write_text(text + "\n")
        return 0
    keys = ["llama3", "gemma3"] if args.quick else [k.strip() for k in args.archs.split(",") if k.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    quants = ["F16", "Q4_K_M"] if args.quick else [q.strip() for q in args.quants.split(",")]
    llama_settings = LLAMA_SETTINGS[1:2] if args.quick else [LLAMA_SETTINGS[int(i)] for i in args.llama_settings.split(",") if i]
    vllm_settings = VLLM_SETTINGS[1:2] if args.quick else [VLLM_SETTINGS[int(i)] for i in args.vllm_settings.split(",") if i]
    hardware = detect()
    started = time.time()
    load_before = [round(x, 2) for x in os.getloadavg()]
    points: list[dict[str, Any]] = []
    launch = NO_REPACK if args.no_repack else DEFAULT
    name = ("quick" if args.quick else "points") + ("-no-repack" if args.no_repack else "")
    out_file = args.out / f"{name}.json"
    previous_meta: dict[str, Any] = {}
    if args.append:
        for candidate in (out_file.with_suffix(".partial.json"), out_file):
            if candidate.exists():
                saved = json.loads(candidate.read_text())
                points = saved["points"]
                previous_meta = saved.get("meta", {})
                break
    done = {_key(p) for p in points}
    for engine in engines:  # every llama.cpp point first: they take seconds, vLLM's take a minute or more each
        for key in keys:
            archs.ensure_arch(key)
            todo: list[tuple[str | None, dict[str, Any]]] = []
            if engine == "llama.cpp":
                todo = [(quant, {"ctx_per_request": ctx, "slots": slots})
                        for quant in quants for ctx, slots in llama_settings]
            else:
                todo = [(None, {"ctx_per_request": ctx, "slots": slots, "kv_cache_gib": kv_gib})
                        for ctx, slots, kv_gib in vllm_settings]
            for quant, setting in todo:
                if (engine, key, quant, json.dumps(setting, sort_keys=True)) in done:
                    continue
                points.append(run_point(engine, key, quant, setting, hardware, launch))
                _progress(points[-1])
                args.out.mkdir(parents=True, exist_ok=True)  # partial results survive an interrupted run
                out_file.with_suffix(".partial.json").write_text(json.dumps({"points": points}, indent=1) + "\n")
    passes = [*previous_meta.get("passes", []), {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.time() - started),
        "loadavg_before": load_before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "engines": engines, "vllm_settings": args.vllm_settings, "llama_settings": args.llama_settings}]
    meta = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "passes": passes,
            "seconds": sum(p["seconds"] for p in passes), "launch_seconds": round(sum(p["seconds"] for p in points)),
            "loadavg_before": passes[0]["loadavg_before"], "loadavg_after": passes[-1]["loadavg_after"],
            "cpu": hardware.cpu.model if hardware.cpu else platform.processor(),
            "cpu_features": {"avx2": hardware.cpu.avx2, "avx512": hardware.cpu.avx512, "amx": hardware.cpu.amx}
            if hardware.cpu else {},
            "launch": launch, "cores": os.cpu_count(), "ram_gib": round(hardware.ram_total_bytes / 1024**3, 1),
            "versions": {p["engine"]: p["engine_version"] for p in points}, "points": len(points),
            "archs": len({p["arch"] for p in points}), "tuning": list(TUNING), "held_out": list(HELD_OUT), "quick": args.quick}
    summary = summarise(points)
    text = print_summary(summary, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    out_file.with_suffix(".partial.json").unlink(missing_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "summary": summary, "points": points},
                                                      indent=1) + "\n")
    (args.out / f"{name}-summary.txt").write_text(text + "\n")
    return 0


def _key(point: dict[str, Any]) -> tuple[str, str, str | None, str]:
    return point["engine"], point["arch"], point.get("quant"), json.dumps(point["setting"], sort_keys=True)


def _progress(point: dict[str, Any]) -> None:
    err = point.get("relative_error") or {}
    shown = " ".join(f"{k}={v * 100:+.1f}%" for k, v in err.items() if v is not None)
    print(f"[{point['engine']:9}] {point['arch']:12} {point.get('quant') or '':7} {point['setting']} "
          f"{point['seconds']:6.1f}s "
          f"{'started' if point['started'] else 'FAILED: ' + str(point['error'])[:120]} {shown}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
