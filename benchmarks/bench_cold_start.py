"""How much of vLLM's cold start does its compile cache save, and what does --enforce-eager cost or save? vLLM
CPU on one plan, as the app launches it (desktop.core.engines.vllm: the compile cache per model and plan in the
app's cache folder), for each configuration:

    cache on,  compiled : first start (empty cache) vs repeat starts of the same plan (warm cache)
    cache off, compiled : VLLM_DISABLE_COMPILE_CACHE=1 TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, every start compiles
    eager               : --enforce-eager, nothing compiled (cache irrelevant)
    fresh               : cache on, emptied before every start: N first starts (the first of 'cache' is one)

N runs each, T1 (health OK) and T3 (first request done), every phase (supervisor.COLD_START_PHASES), the
compile cache outcome (hit / warm / stale / miss) and the load average around every start: a busy machine makes cold
starts slow and noisy, so read the ratios with the load beside them. Prints ratios repeat / first and
config / (cache on, first). One engine runs at a time.

    .venv/bin/python benchmarks/bench_cold_start.py [--model demo] [--runs 3] [--configs cache,nocache,eager]
        [--ctx 2048] [--parallel 4] [--json] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop.core.engines import get_adapter  # noqa: E402
from desktop.core.engines.base import LaunchPlan  # noqa: E402
from desktop.core.engines.vllm import COMPILE_CACHE_ENV  # noqa: E402
from desktop.core.runtime.supervisor import EngineProcess  # noqa: E402
from desktop.core.serving.endpoint import make_launcher  # noqa: E402
from desktop.core.serving.prepare import checked_prepare_plan  # noqa: E402

CONFIGS = {
    "cache": {"eager": False, "env": {}},
    # vLLM's cache and Inductor's (the one that makes a CPU repeat start warm) both off
    "nocache": {"eager": False, "env": {"VLLM_DISABLE_COMPILE_CACHE": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}},
    "eager": {"eager": True, "env": {}},
    # every start is a first start: the compile cache is emptied before each (N first starts, not one)
    "fresh": {"eager": False, "env": {}, "fresh": True},
}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def one_start(asked: LaunchPlan, eager: bool, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Start the plan the endpoint would launch (the planner's, checked here), wait for its first request, stop
    it; its cold start."""
    adapter, plan, install = make_launcher()(checked_prepare_plan(asked, eager=eager))
    plan = replace(plan, env={**plan.env, **env})
    before = load()
    started = time.monotonic()
    with EngineProcess(adapter, plan, install) as process:
        process.start()
        cold = process.wait_ready(timeout=timeout, first_request=True)
    data = cold.to_json()
    return {"t1_s": cold.t1_health_s, "t3_s": cold.t3_first_request_s, "compile_cache": cold.compile_cache,
            "phases": {p["phase"]: p["seconds"] for p in data["phases"]}, "load_before": before,
            "load_after": load(), "wall_s": round(time.monotonic() - started, 2)}


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 2) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--runs", type=int, default=3, help="starts per configuration (the first of 'cache' is "
                                                            "the empty-cache one, the rest repeat it)")
    parser.add_argument("--configs", default="cache,nocache,eager", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or args.runs < 1:
        print(f"unknown config(s) {unknown} or --runs < 1", file=sys.stderr)
        return 2
    if get_adapter("vllm").find_install() is None:
        print("vLLM is not installed: switchyard engines install vllm", file=sys.stderr)
        return 2
    from desktop.core.planning.planner import ask

    spec = ask("vllm", args.model, {"ctx_per_request": args.ctx, "slots": args.parallel})
    cache_root = Path(tempfile.mkdtemp(prefix="bench-cold-start-"))  # an empty compile cache, ours alone
    os.environ[COMPILE_CACHE_ENV] = str(cache_root)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for config in configs:
            shutil.rmtree(cache_root, ignore_errors=True)
            cache_root.mkdir(parents=True)
            results[config] = []
            for run in range(args.runs):
                if CONFIGS[config].get("fresh") and run:
                    shutil.rmtree(cache_root, ignore_errors=True)
                    cache_root.mkdir(parents=True)
                found = one_start(spec, bool(CONFIGS[config]["eager"]), dict(CONFIGS[config]["env"]), args.timeout)
                results[config].append(found)
                print(f"{config} run {run + 1}/{args.runs}: T1 {found['t1_s']:.1f} s, T3 {found['t3_s']:.1f} s, "
                      f"compile cache {found['compile_cache']}, load {found['load_before']} -> "
                      f"{found['load_after']}, phases {found['phases']}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    summary: dict[str, Any] = {}
    for config, runs in results.items():
        first, repeats = runs[0], runs[1:]
        summary[config] = {
            "first": {"t1_s": first["t1_s"], "t3_s": first["t3_s"]},
            "repeat_mean": {"t1_s": mean([r["t1_s"] for r in repeats]), "t3_s": mean([r["t3_s"] for r in repeats])},
            "repeat_over_first": {"t1": ratio(mean([r["t1_s"] for r in repeats]), first["t1_s"]),
                                  "t3": ratio(mean([r["t3_s"] for r in repeats]), first["t3_s"])},
        }
    base = results.get("cache", [None])[0] if "cache" in results else None
    if base is not None:
        for config, runs in results.items():
            summary[config]["mean_over_cache_first"] = {
                "t1": ratio(mean([r["t1_s"] for r in runs]), base["t1_s"]),
                "t3": ratio(mean([r["t3_s"] for r in runs]), base["t3_s"])}
    out = {"model": args.model, "ctx": args.ctx, "parallel": args.parallel, "runs": args.runs,
           "cpu_count": os.cpu_count(), "created_at": time.time(), "summary": summary, "starts": results}
    text = json.dumps(out, indent=2)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n", encoding="utf-8")
    if args.json:
        print(text)
    else:
        for config, numbers in summary.items():
            print(f"{config:8s} first T1 {numbers['first']['t1_s']} s T3 {numbers['first']['t3_s']} s; repeats "
                  f"T1 {numbers['repeat_mean']['t1_s']} s T3 {numbers['repeat_mean']['t3_s']} s; repeat/first "
                  f"T1 {numbers['repeat_over_first']['t1']} T3 {numbers['repeat_over_first']['t3']}"
                  + (f"; vs cache-first T3 {numbers['mean_over_cache_first']['t3']}"
                     if "mean_over_cache_first" in numbers else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
