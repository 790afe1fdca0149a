"""Do the app's launch flags cost serving speed? The same model, context and slots served by llama-server as the
app launches it (desktop.core.engines.llamacpp: --metrics, --slots, --no-ui, --no-cache-prompt, default log
verbosity) and by a plain `llama-server -m MODEL -c CTX -np SLOTS`, under the same closed-loop load, in paired
rounds (app, plain, app, plain, ...: drift in the machine's load hits both alike). Prints the throughput ratio
app / plain at the chosen concurrency (goal >= 0.97) and the load average around every round: a busy machine
makes the ratio noisy, so read it with the load beside it.

Only one server is alive at a time: two llama-servers would fight over the cores.

    .venv/bin/python benchmarks/bench_launch_flags.py [--model demo] [--concurrency 32] [--requests 128]
        [--rounds 4] [--input-len 128] [--output-len 64] [--ctx 512] [--json] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop.core.engines import get_adapter  # noqa: E402
from desktop.core.engines.base import LaunchPlan  # noqa: E402
from desktop.core.engines.model_path import resolve_model  # noqa: E402
from desktop.core.machine.hardware import detect  # noqa: E402
from desktop.core.measure.ab import _token_counter  # noqa: E402
from desktop.core.measure.loadgen import LoadConfig, RandomWorkload, Target, run_load_sync  # noqa: E402
from desktop.core.models.facts import facts_for  # noqa: E402
from desktop.core.planning.fit import estimate  # noqa: E402
from desktop.core.runtime.ports import find_free_port  # noqa: E402
from desktop.core.runtime.supervisor import EngineProcess  # noqa: E402


class PlainServer:
    """`llama-server -m MODEL --host 127.0.0.1 --port P -c CTX -np SLOTS`, nothing else."""

    def __init__(self, executable: Path, model: Path, ctx_total: int, slots: int, threads: int | None) -> None:
        self.port = find_free_port("127.0.0.1")
        self.argv = [str(executable), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                     "-c", str(ctx_total), "-np", str(slots)]
        if threads:
            self.argv += ["-t", str(threads)]
        self.env = {**os.environ, "LD_LIBRARY_PATH": str(executable.parent)}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"plain llama-server exited with {self.proc.returncode}: {self.argv}")
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)  # polling a child's health, not synchronising tests
        raise RuntimeError("plain llama-server did not become ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _round(base_url: str, args: argparse.Namespace, counter: Any) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    result = run_load_sync(Target(base_url), RandomWorkload(input_len=args.input_len, output_len=args.output_len,
                                                             seed=args.seed),
                           LoadConfig(concurrency=args.concurrency, num_requests=args.requests,
                                      warmup_requests=min(args.concurrency, args.requests),
                                      cooldown_requests=args.concurrency, seed=args.seed),
                           token_counter=counter)
    s = result.summary
    return {"output_throughput": s.output_throughput, "completed": s.completed, "failed": s.failed,
            "median_ttft_ms": s.ttft.median, "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2), "mean_prompt_tokens": result.mean_prompt_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128, help="measured requests per round")
    parser.add_argument("--rounds", type=int, default=4, help="pairs of rounds (app, plain)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=512, help="context per slot (both servers get ctx x slots)")
    parser.add_argument("--threads", type=int, help="llama-server -t for both (default: its own default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args()

    adapter = get_adapter("llama.cpp")
    install = adapter.find_install()
    if install is None:
        print("llama.cpp is not installed: switchyard engines install llama.cpp", file=sys.stderr)
        return 2
    model = resolve_model(args.model, adapter)
    slots = args.concurrency
    # the plan as the app launches it: the fit resolves every memory-relevant field (-ngl, KV type, -fa, dtype)
    asked = LaunchPlan(engine=adapter.name, model_path=model, ctx_per_request=args.ctx, slots=slots,
                       threads=args.threads)
    plan = estimate(facts_for(args.model if args.model == "demo" else str(model)), detect(), asked).plan or asked
    counter = _token_counter(args.model, model)
    app_argv = adapter.build_command(plan, install).argv
    rows: list[dict[str, Any]] = []
    for pair in range(args.rounds):
        for mode in ("app", "plain"):
            if mode == "app":
                app = EngineProcess(adapter, plan, install)
                try:
                    app.start()
                    app.wait_ready(timeout=300, first_request=False)
                    row = _round(app.base_url, args, counter)
                finally:
                    app.stop()
            else:
                plain = PlainServer(install.executable, model, plan.llama_ctx_size, slots, args.threads)
                try:
                    plain.start()
                    row = _round(plain.base_url, args, counter)
                finally:
                    plain.stop()
            row.update(pair=pair, mode=mode)
            rows.append(row)
            print(f"pair {pair + 1}/{args.rounds} {mode:>5}: {row['output_throughput']:8.1f} tok/s, "
                  f"{row['failed']} failed, load {row['load_before']:.2f} -> {row['load_after']:.2f}",
                  file=sys.stderr)
    ratios = []
    for pair in range(args.rounds):
        app_tput = next(r["output_throughput"] for r in rows if r["pair"] == pair and r["mode"] == "app")
        plain_tput = next(r["output_throughput"] for r in rows if r["pair"] == pair and r["mode"] == "plain")
        if plain_tput:
            ratios.append(app_tput / plain_tput)
    loads = [r["load_before"] for r in rows] + [r["load_after"] for r in rows]
    result = {
        "benchmark": "launch_flags", "model": str(model), "concurrency": args.concurrency,
        "requests": args.requests, "rounds": args.rounds, "ctx_per_slot": args.ctx, "slots": slots,
        "app_argv": app_argv[1:], "plain_argv": PlainServer(install.executable, model, plan.llama_ctx_size, slots,
                                                              args.threads).argv[1:],
        "ratio_median": statistics.median(ratios) if ratios else None, "ratios": ratios,
        "load_average": {"min": min(loads), "max": max(loads), "cpus": os.cpu_count()}, "rounds_detail": rows,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        ratio = result["ratio_median"]
        print(f"throughput app / plain llama-server at c={args.concurrency}: "
              f"{ratio:.3f} (goal >= 0.97; pairs {', '.join(f'{r:.3f}' for r in ratios)}); load average "
              f"{min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} CPUs" if ratio is not None else "no result")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
