"""`switchyard bench` (load-test one endpoint or engine) and `switchyard ab` (engine A/B with a report)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from desktop.commands import _numbers as N
from desktop.commands._common import emit_json, print_described, stderr_progress
from desktop.core.common import paths
from desktop.core.common.defaults import DEFAULT_CTX_PER_REQUEST, DEFAULT_READY_TIMEOUT
from desktop.core.common.errors import SwitchyardError

if TYPE_CHECKING:  # the load generator loads when a benchmark runs, not for `--help`
    from desktop.core.measure.loadgen import SLO, LoadConfig, SweepResult, Target, Workload
    from desktop.core.measure.loadgen.metrics import LiveBucket


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be positive integers, e.g. 1,8,32")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive, e.g. 2,4,8")
    return values


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = subparsers.add_parser("bench", help="load-test an OpenAI-compatible endpoint or an engine")
    where = bench.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", help="a running server: an attached endpoint's name (`switchyard endpoints "
                                          "list`, its API key and TLS choice are used) or a base URL")
    where.add_argument("--engine", help="start this engine (llama.cpp or vllm) on --model and benchmark it")
    bench.add_argument("--model", help="with --engine: `demo`, a GGUF file or a HF folder; with --endpoint: "
                                       "the model name to send (default: the server's first model)")
    bench.add_argument("--concurrency", type=_ints, help="closed-loop levels (default 1,8,32,64)")
    bench.add_argument("--rate", type=_floats, help="open-loop request rates in req/s (replaces --concurrency)")
    bench.add_argument("--arrival", choices=("poisson", "constant", "gamma"), default="poisson")
    bench.add_argument("--burstiness", type=N.positive, default=1.0, help="gamma shape (with --arrival gamma)")
    bench.add_argument("--max-concurrency", type=N.count, help="cap in-flight requests in open loop")
    bench.add_argument("--requests", type=N.count, default=64, help="measured requests per level")
    bench.add_argument("--duration", type=N.seconds, help="seconds per level instead of a request count")
    bench.add_argument("--warmup", type=N.non_negative, default=0, help="warm-up requests per level (excluded)")
    bench.add_argument("--cooldown", type=N.non_negative, default=0,
                       help="cool-down requests per level: keep the load steady while the last measured finish")
    bench.add_argument("--workload", default="random",
                       help="random, shared-prefix, or a JSONL file of {\"prompt\"|\"messages\", \"output_tokens\"}")
    bench.add_argument("--input-len", type=N.count, default=128)
    bench.add_argument("--input-sigma", type=N.non_negative_number, default=0.0, help="log-normal sigma of input lengths")
    bench.add_argument("--output-len", type=N.count, default=64)
    bench.add_argument("--output-sigma", type=N.non_negative_number, default=0.0)
    bench.add_argument("--prefixes", type=N.count, default=4, help="shared-prefix workload: number of prefixes")
    bench.add_argument("--api", choices=("completions", "chat"), default="completions")
    bench.add_argument("--api-key-env", help="name of an environment variable holding the API key (overrides "
                                             "an attached endpoint's stored key)")
    bench.add_argument("--slo-ttft-ms", type=N.positive)
    bench.add_argument("--slo-tpot-ms", type=N.positive)
    bench.add_argument("--slo-e2el-ms", type=N.positive)
    bench.add_argument("--timeout", type=N.seconds, default=300.0, help="per-request timeout in seconds")
    bench.add_argument("--ctx", type=N.count, default=DEFAULT_CTX_PER_REQUEST, help="with --engine: context per request")
    bench.add_argument("--parallel", type=N.count, help="with --engine: slots / max_num_seqs (default: top level)")
    bench.add_argument("--prefix-cache", action="store_true",
                       help="with --engine: keep the engine's prefix cache on (off by default here, as in `ab`, so "
                            "every request costs its whole prompt; `serve` has it on)")
    bench.add_argument("--hardware", help="with --engine: plan for a snapshot from `switchyard detect --json`")
    bench.add_argument("--dry-run", action="store_true",
                       help="with --engine: print the checked plan, its exact argv and env; start nothing")
    bench.add_argument("--json", metavar="FILE", nargs="?", const="-",
                       help="write the result JSON here (- or no value: stdout)")
    bench.add_argument("--report", metavar="DIR", help="also write JSON, CSV and HTML reports into DIR")
    bench.add_argument("--requests-detail", action="store_true", help="include per-request records in --json")
    bench.add_argument("--no-history", action="store_true", help="do not record the run in history")
    bench.set_defaults(func=cmd_bench)

    ab = subparsers.add_parser("ab", help="A/B two engines on the same model: cold start, sweep, cost, report")
    ab.add_argument("--model", default="demo", help="`demo` (exists in both formats) or a model path")
    ab.add_argument("--engines", help="two engines, comma-separated (default llama.cpp,vllm); an attached "
                                      "endpoint is spelled endpoint:NAME or endpoint:URL")
    ab.add_argument("--endpoint", metavar="NAME_OR_URL",
                    help="compare one local engine (--engines, default llama.cpp) against this attached endpoint")
    ab.add_argument("--eager", action="store_true",
                    help="vLLM: --enforce-eager (skip torch.compile; starts sooner, may serve slower)")
    ab.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    ab.add_argument("--repetitions", type=N.count, default=1, help="cold starts + sweeps per engine")
    ab.add_argument("--requests", type=N.count, default=32, help="measured requests per level")
    ab.add_argument("--input-len", type=N.count, default=64)
    ab.add_argument("--output-len", type=N.count, default=32)
    ab.add_argument("--ctx", type=N.count, default=512, help="context per request on both engines")
    ab.add_argument("--parallel", type=N.count, help="slots = max_num_seqs (default: highest concurrency)")
    ab.add_argument("--prefix-cache", action="store_true", help="enable the prefix cache on both engines")
    ab.add_argument("--expected-concurrency", type=N.count, help="load the verdict is for (default: middle level)")
    ab.add_argument("--price-per-hour", type=N.non_negative_number, help="price of one GPU-/machine-hour")
    ab.add_argument("--power-watts", type=N.positive, help="power draw, with --price-per-kwh instead of a price")
    ab.add_argument("--price-per-kwh", type=N.non_negative_number)
    ab.add_argument("--lifetime-h", type=N.seconds, default=8.0, help="service lifetime the cold start is amortized over")
    ab.add_argument("--ready-timeout", type=N.seconds, default=DEFAULT_READY_TIMEOUT)
    ab.add_argument("--hardware", help="plan for a snapshot from `switchyard detect --json` instead of this machine")
    ab.add_argument("--dry-run", action="store_true",
                    help="print both checked plans, their exact argv and env; start nothing")
    ab.add_argument("--install", action="store_true", help="install a missing engine instead of failing")
    ab.add_argument("--report", metavar="DIR", help="report folder (default: in the data dir)")
    ab.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    ab.add_argument("--no-history", action="store_true")
    replay = ab.add_argument_group("replay the endpoint's recorded traffic (open loop, after the sweep)")
    replay.add_argument("--replay", action="store_true", help="also send the request log's traffic open loop to "
                                                              "both engines (recorded arrival gaps and lengths)")
    replay.add_argument("--since", default="1d", help="with --replay: how far back the log is read (default 1d)")
    replay.add_argument("--speed", default="1x", help="with --replay: 2x sends twice as fast as recorded")
    replay.add_argument("--replay-max", type=N.count, help="with --replay: at most this many requests (oldest first)")
    ab.set_defaults(func=cmd_ab)


# --- bench ----------------------------------------------------------------------------------------------
def _workload(args: argparse.Namespace) -> Workload:
    from desktop.core.measure.loadgen import JsonlWorkload, RandomWorkload, SharedPrefixWorkload

    if args.workload == "random":
        return RandomWorkload(args.input_len, args.output_len, args.input_sigma, args.output_sigma)
    if args.workload == "shared-prefix":
        return SharedPrefixWorkload(args.prefixes, args.input_len, max(1, args.input_len // 8), args.output_len)
    path = Path(args.workload).expanduser()
    if not path.is_file():
        raise SwitchyardError(f"workload file not found: {path}", "use random, shared-prefix, or a JSONL file")
    return JsonlWorkload(path, args.output_len)


def _live_printer(label: str) -> Any:
    def show(bucket: LiveBucket) -> None:
        ttft = f"{bucket.ttft_p50_ms:.0f} ms" if bucket.ttft_p50_ms is not None else "–"
        print(f"  {label} t={bucket.second:>4}s  {bucket.output_tokens:>5} tok/s  in flight {bucket.in_flight:>3}  "
              f"done {bucket.completed:>3}  failed {bucket.failed:>3}  TTFT p50 {ttft}", file=sys.stderr, flush=True)
    return show


def cmd_bench(args: argparse.Namespace) -> int:
    from desktop.core.measure.loadgen import SLO, LoadConfig, Target, check_target, sweep_levels

    if args.requests < 1:
        raise SwitchyardError("--requests must be at least 1")
    workload = _workload(args)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        raise SwitchyardError(f"environment variable {args.api_key_env} is not set", "export it or drop --api-key-env")
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms) if (
        args.slo_ttft_ms or args.slo_tpot_ms or args.slo_e2el_ms) else None
    base = LoadConfig(concurrency=args.max_concurrency if args.rate else 1, rate=args.rate[0] if args.rate else None,
                      num_requests=None if args.duration else args.requests,
                      duration_s=args.duration, warmup_requests=args.warmup, cooldown_requests=args.cooldown,
                      arrival=args.arrival, burstiness=args.burstiness, request_timeout_s=args.timeout)
    levels = sweep_levels(base, concurrency=args.concurrency, rates=args.rate)
    if args.dry_run:
        if not args.engine:
            raise SwitchyardError("--dry-run plans an engine launch", "use it with --engine and --model")
        described = _bench_plan(args, levels).describe()
        if args.json:
            emit_json(described)
        else:
            print_described(described)
        return 0
    meta: dict[str, Any] = {"endpoint": args.endpoint, "engine": None, "engine_version": None,
                            "model": args.model, "settings": {"levels": [lvl.to_json() for lvl in levels],
                                                              "workload": workload.to_json(), "api": args.api}}
    if args.endpoint:
        from desktop.core.engines.external import resolve_endpoint

        endpoint = resolve_endpoint(args.endpoint)
        target = Target.attached(endpoint, api=args.api, model=args.model, api_key=api_key)
        print(f"checking {endpoint.name} ({endpoint.base_url})", file=sys.stderr)
        target = replace(target, model=check_target(target, timeout=args.timeout))
        meta.update(endpoint=endpoint.base_url, endpoint_name=endpoint.name, model=target.model)
        sweep = _run(target, workload, levels, slo)
    else:
        sweep = _bench_engine(args, workload, levels, slo, meta)
    return _finish_bench(args, sweep, meta)


def _run(target: Target, workload: Workload, levels: list[LoadConfig], slo: SLO | None,
         abort_check: Any = None) -> SweepResult:
    import asyncio

    from desktop.core.measure.loadgen import run_sweep

    started = time.monotonic()
    print(f"benchmarking {target.base_url} ({len(levels)} levels)", file=sys.stderr)
    sweep = asyncio.run(run_sweep(target, workload, levels, slo=slo, progress=_every_tenth(),
                                  on_bucket=_live_printer(target.base_url.split("//")[-1]), abort_check=abort_check))
    print(f"done in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return sweep


def _every_tenth() -> Any:
    """Level starts always; request progress only every 10%."""
    last: dict[str, float] = {"value": -1.0}

    def show(event: Any) -> None:
        fraction = event.fraction
        if fraction is None or fraction >= 1.0 or fraction - last["value"] >= 0.1 or fraction < last["value"]:
            last["value"] = fraction if fraction is not None else -1.0
            stderr_progress(event)
    return show


def _hardware(args: argparse.Namespace) -> Any:
    from desktop.core.machine.hardware import HardwareSnapshot, detect

    return HardwareSnapshot.load(args.hardware) if args.hardware else detect()


def _bench_plan(args: argparse.Namespace, levels: list[LoadConfig]) -> Any:
    """The planner's checked plan for `bench --engine` (slots default to the top load level), or its refusal."""
    from desktop.core.planning.planner import plan_launch

    if not args.model:
        raise SwitchyardError("--engine needs --model", "e.g. --model demo")
    top = max(level.concurrency or 1 for level in levels)
    return plan_launch(args.engine, args.model, _hardware(args),
                       {"ctx_per_request": args.ctx, "slots": args.parallel or top,
                        "prefix_cache": bool(args.prefix_cache)}, progress=stderr_progress)


def _bench_engine(args: argparse.Namespace, workload: Workload, levels: list[LoadConfig], slo: SLO | None,
                  meta: dict[str, Any]) -> SweepResult:
    from desktop.core.engines import get_adapter, require_install
    from desktop.core.measure.loadgen import Target
    from desktop.core.runtime.supervisor import EngineProcess, reap_orphans, start_ready

    plan = _bench_plan(args, levels).plan  # refused before anything starts
    adapter = get_adapter(plan.engine)
    install = require_install(adapter)
    reap_orphans()
    meta.update(engine=adapter.name, engine_version=install.version, model=str(plan.model_path))
    meta["settings"]["plan"] = plan.to_json()
    engine = start_ready(lambda p: EngineProcess(adapter, p, install), plan, timeout=DEFAULT_READY_TIMEOUT,
                         on_start=lambda e: print(f"starting {adapter.display_name} (log: {e.log_path})",
                                                  file=sys.stderr),
                         say=lambda text: print(f"note: {text}", file=sys.stderr))
    with engine:
        cold = engine.cold_start
        meta["cold_start"] = cold.to_json()
        meta["endpoint"] = engine.base_url

        def gone() -> str | None:
            return None if engine.is_running() else engine.failure().message

        return _run(Target(engine.base_url, api=args.api, model=plan.served_model_name,
                           api_key=engine.plan.api_key), workload, levels, slo,
                    abort_check=gone)


def _finish_bench(args: argparse.Namespace, sweep: SweepResult, meta: dict[str, Any]) -> int:
    from desktop.core.measure.reports import bench_json, record_bench, write_bench_report, write_json

    report = None
    if args.report:
        report = write_bench_report(sweep, meta, Path(args.report))
        print(f"report: {report.html}", file=sys.stderr)
    if args.json == "-":
        emit_json(bench_json(sweep, meta, args.requests_detail))
    elif args.json:
        write_json(bench_json(sweep, meta, args.requests_detail), Path(args.json))
    if args.json != "-":
        _print_table(sweep)
    if not args.no_history:
        from desktop.core.storage.history import Store

        with Store() as store:
            record_bench(store, sweep, meta, str(report.html) if report else None)
    for level in sweep.levels:
        for warning in level.warnings:
            print(f"warning ({level.label}): {warning}", file=sys.stderr)
    if sweep.aborted:
        kept = args.json or (report and report.json) or "the history"
        raise SwitchyardError(f"benchmark stopped: {sweep.aborted}",
                              f"partial results of {sum(level.summary.completed for level in sweep.levels)} "
                              f"requests were kept in {kept}")
    return 0


def _print_table(sweep: SweepResult) -> None:
    print(f"{'load':<18}{'done':>6}{'fail':>6}{'out tok/s':>11}{'req/s':>8}{'TTFT p50':>10}{'TTFT p95':>10}"
          f"{'TPOT p50':>10}{'E2E p50':>10}")
    for level in sweep.levels:
        s = level.summary
        print(f"{level.label:<18}{s.completed:>6}{s.failed:>6}{s.output_throughput:>11.1f}{s.request_throughput:>8.2f}"
              f"{s.ttft.median:>10.1f}{s.ttft.p95:>10.1f}{s.tpot.median:>10.1f}{s.e2el.median:>10.1f}")
    measured = [level for level in sweep.levels if level.mean_prompt_tokens is not None]
    if measured:
        level = measured[0]
        sent = f"; sized to {level.sent_prompt_tokens:g}" if level.sent_prompt_tokens is not None else ""
        print(f"prompt tokens: mean {level.mean_prompt_tokens:g} as the server counted them{sent} "
              f"({level.prompt_tokens_source})")


# --- ab -------------------------------------------------------------------------------------------------
def cmd_ab(args: argparse.Namespace) -> int:
    from desktop.core.measure.ab import ABConfig, plan_ab, run_ab
    from desktop.core.measure.reports import record_ab, write_ab_report

    engines = tuple(name.strip() for name in (args.engines or "").split(",") if name.strip())
    if args.endpoint:
        if len(engines) > 1:
            raise SwitchyardError("--endpoint compares one local engine against the endpoint, but --engines names "
                                  f"{len(engines)}", "e.g. --engines llama.cpp --endpoint team-vllm")
        engines = (engines[0] if engines else "llama.cpp", f"endpoint:{args.endpoint}")
    elif not engines:
        engines = ("llama.cpp", "vllm")
    if len(engines) != 2:
        raise SwitchyardError(f"--engines needs exactly two engines, got {args.engines!r}", "e.g. --engines llama.cpp,vllm")
    config = ABConfig(model=args.model, engines=(engines[0], engines[1]), concurrency=tuple(args.concurrency),
                      repetitions=args.repetitions, requests_per_level=args.requests, input_len=args.input_len,
                      output_len=args.output_len, ctx=args.ctx, parallel=args.parallel, prefix_cache=args.prefix_cache,
                      expected_concurrency=args.expected_concurrency, price_per_hour=args.price_per_hour,
                      power_watts=args.power_watts, price_per_kwh=_price_per_kwh(args),
                      service_lifetime_h=args.lifetime_h, ready_timeout_s=args.ready_timeout, eager=args.eager)
    if args.replay:
        config = replace(config, **_replay_options(args))
    hardware = _hardware(args)
    if args.dry_run:
        plans = {name: checked.describe() for name, checked in plan_ab(config, hardware, stderr_progress).items()}
        if args.json:
            emit_json({"engines": plans})
        else:
            for name, described in plans.items():
                print_described(described, name)
        return 0
    directory = Path(args.report) if args.report else paths.data_dir() / "reports" / time.strftime("ab-%Y%m%d-%H%M%S")
    result = run_ab(config, progress=_every_tenth(), allow_install=args.install, hardware=hardware)
    report = write_ab_report(result, directory)
    if not args.no_history:
        from desktop.core.storage.history import Store

        with Store() as store:
            record_ab(store, result, str(report.html))
    if args.json:
        emit_json(result.to_json())
    else:
        _print_ab(result)
    print(f"report: {report.html}", file=sys.stderr)
    if result.errors:
        raise SwitchyardError("A/B incomplete: " + "; ".join(result.errors), f"partial results are in {report.json}")
    return 0


def _price_per_kwh(args: argparse.Namespace) -> float | None:
    """--price-per-kwh, else the price_per_kwh setting (0 there means not set)."""
    if args.price_per_kwh is not None:
        return float(args.price_per_kwh)
    from desktop.core.storage import settings

    saved = settings.load().price_per_kwh
    return saved if saved > 0 else None


def _replay_options(args: argparse.Namespace) -> dict[str, Any]:
    """The recorded schedule and speed for `ab --replay`; a bad span or speed, or an empty log, fails here,
    before any engine starts."""
    from desktop.core.measure.loadgen.replay import parse_speed, schedule_from_log

    speed = parse_speed(args.speed)
    schedule = schedule_from_log(args.since, max_requests=args.replay_max)
    print(f"replay: {len(schedule.items)} recorded requests over {schedule.span_s:.1f} s at {speed:g}x",
          file=sys.stderr)
    return {"replay": schedule, "replay_speed": speed}


def _print_ab(result: Any) -> None:
    a, b = (e.engine for e in result.engines)
    print(f"cold start (s)       {a:>14}{b:>14}{'ratio':>10}")
    for phase in ("t1_health_s", "t2_first_token_s", "t3_first_request_s"):
        row = result.cold_start[phase]
        print(f"{phase:<21}{_f(row[a]['mean']):>14}{_f(row[b]['mean']):>14}{_f(row['ratio']['mean']):>10}")
    print(f"\n{'concurrency':<12}{a + ' tok/s':>16}{b + ' tok/s':>16}{'ratio':>8}{a + ' TTFT p50':>18}"
          f"{b + ' TTFT p50':>18}{'ratio':>8}")
    for row in result.comparison:
        t, f = row["output_throughput"], row["median_ttft_ms"]
        print(f"{row['concurrency']:<12}{_f(t[a]['mean']):>16}{_f(t[b]['mean']):>16}{_f(t['ratio']['mean']):>8}"
              f"{_f(f[a]['mean']):>18}{_f(f[b]['mean']):>18}{_f(f['ratio']['mean']):>8}")
    for engine, note in result.cold_start.get("notes", {}).items():
        print(f"{engine}: {note}")
    print(f"\n{result.amortization.get('verdict', '')}")
    if result.quality and result.quality.get("line"):
        print(f"weights: {result.quality['line']}")
    if result.replay:
        print(f"\nreplay of {result.replay['schedule']['requests']} recorded requests at {result.replay['speed']:g}x "
              "(open loop):")
        for engine, cell in result.replay["engines"].items():
            if cell:
                print(f"  {engine:<16} {_f(cell['output_throughput'])} tok/s, TTFT p50 {_f(cell['median_ttft_ms'])} ms, "
                      f"p95 {_f(cell['p95_ttft_ms'])} ms, failed {cell['failed']:.0f}, send lag p95 "
                      f"{_f(cell['send_lag_p95_ms'])} ms")
    if result.crossover:
        print(result.crossover["verdict"])


def _f(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"
