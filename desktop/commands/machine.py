"""`switchyard detect | fit | recommend`: what this machine has, whether a model fits, and how to run it."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from typing import TYPE_CHECKING, Any

from desktop.commands import _numbers as N
from desktop.commands._common import emit_json
from desktop.core.common.errors import SwitchyardError

if TYPE_CHECKING:  # hardware probing and the model readers (gguf, numpy) load when a command runs
    from desktop.core.machine.hardware import HardwareSnapshot
    from desktop.core.planning.evidence import Evidence
    from desktop.core.planning.fit import FitResult
    from desktop.core.planning.recommend import Workload


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p_detect = subparsers.add_parser("detect", help="GPUs, CPU, RAM and disk of this machine")
    p_detect.add_argument("--models-dir", help="where models are stored (for free disk space)")
    p_detect.add_argument("--json", action="store_true")
    p_detect.set_defaults(func=cmd_detect)

    p_fit = subparsers.add_parser("fit", help="will MODEL fit on this (or another) machine with an engine")
    p_fit.add_argument("model", help="a .gguf file, a config.json, a Hugging Face folder, a Hub repo id, or demo")
    p_fit.add_argument("--engine", default="llama.cpp", help="llama.cpp or vllm (default llama.cpp)")
    p_fit.add_argument("--quant", help="answer for another quantization (Q4_K_M, Q8_0 ... or bf16, fp8, awq)")
    p_fit.add_argument("--ctx", type=N.count, help="context tokens per request (vLLM max_model_len; llama.cpp's -c is "
                                                "ctx x parallel)")
    p_fit.add_argument("--parallel", type=N.count, help="requests at once: llama.cpp slots (default 1), vLLM "
                                                    "max_num_seqs (default 256)")
    p_fit.add_argument("--kv-type", help="llama.cpp KV cache type: f16 (default), q8_0, q4_0 ...")
    p_fit.add_argument("--gpu-layers", type=N.non_negative, help="llama.cpp -ngl (default: as many as fit)")
    p_fit.add_argument("--util", type=N.fraction, help="vLLM gpu_memory_utilization (default: what a launch asks: "
                                                       "0.9, or less where other processes hold GPU memory)")
    p_fit.add_argument("--max-num-seqs", type=N.count, help="vLLM max_num_seqs (same as --parallel)")
    p_fit.add_argument("--max-num-batched-tokens", type=N.count, help="vLLM max_num_batched_tokens")
    p_fit.add_argument("--kv-cache-dtype", help="vLLM kv_cache_dtype: auto (default) or fp8")
    p_fit.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs")
    p_fit.add_argument("--tp", type=N.count, default=1, help="vLLM tensor parallel size")
    _hardware_options(p_fit)
    p_fit.add_argument("--no-history", action="store_true",
                       help="the estimate alone, not corrected by this machine's past launches or calibration")
    p_fit.add_argument("--engine-check", action="store_true",
                       help="also launch the engine briefly and show its own memory report (llama-server: its "
                            "--fit projection) next to the estimate")
    p_fit.add_argument("--json", action="store_true")
    p_fit.set_defaults(func=cmd_fit)

    p_rec = subparsers.add_parser("recommend", help="engine, quantization and settings for MODEL and a workload")
    p_rec.add_argument("model", help="a .gguf file, a config.json, a Hugging Face folder, a Hub repo id, or demo")
    p_rec.add_argument("--concurrency", type=N.count, help="requests in flight at busy times (default 1)")
    p_rec.add_argument("--prompt-len", type=N.count, help="typical prompt tokens (default 512)")
    p_rec.add_argument("--output-len", type=N.count, help="typical output tokens (default 256)")
    p_rec.add_argument("--lifetime-hours", type=N.seconds, help="how long one server run lives (default 8)")
    p_rec.add_argument("--restarts-per-day", type=N.non_negative_number, help="restarts (model/setting switches) a "
                                                                              "day (default 0)")
    p_rec.add_argument("--from-traffic", action="store_true",
                       help="take the workload from the endpoint's request log (`switchyard profile`); typed "
                            "numbers still override")
    p_rec.add_argument("--since", default="7d", help="with --from-traffic: how far back (default 7d)")
    p_rec.add_argument("--traffic-model", help="with --from-traffic: only requests that asked for this name")
    _hardware_options(p_rec)
    p_rec.add_argument("--no-history", action="store_true",
                       help="answer from the default figures alone (not from this machine's measured runs)")
    p_rec.add_argument("--json", action="store_true")
    p_rec.set_defaults(func=cmd_recommend)


def _hardware_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-mem-gib", type=N.positive, help="answer for a GPU with this much memory (all free)")
    parser.add_argument("--gpu", help="answer for a GPU from the table (H100, A100 40GB, 4090 ...)")
    parser.add_argument("--gpus", type=N.count, default=1, help="how many of --gpu / --gpu-mem-gib")
    parser.add_argument("--hardware", help="a snapshot from `switchyard detect --json` instead of this machine")


def _hardware(args: argparse.Namespace) -> HardwareSnapshot:
    from desktop.core.machine.hardware import HardwareSnapshot, detect, hypothetical

    base = HardwareSnapshot.load(args.hardware) if getattr(args, "hardware", None) else detect()
    if args.gpu_mem_gib is not None and args.gpu_mem_gib <= 0:
        raise SwitchyardError(f"--gpu-mem-gib must be positive, not {args.gpu_mem_gib}")
    if args.gpu or args.gpu_mem_gib is not None:
        return hypothetical(base, gpu_name=args.gpu, gpu_count=args.gpus, gpu_mem_gib=args.gpu_mem_gib)
    if args.gpus != 1:
        raise SwitchyardError("--gpus needs --gpu NAME or --gpu-mem-gib X")
    return base


def _this_machine(args: argparse.Namespace) -> bool:
    """History describes this machine: it is no evidence for a hypothetical GPU or another machine's snapshot."""
    return not (getattr(args, "hardware", None) or args.gpu or args.gpu_mem_gib is not None)


def _evidence(args: argparse.Namespace, facts: Any) -> Evidence:
    from desktop.core.planning.evidence import Evidence, gather

    if args.no_history:
        return Evidence.none(facts.name)
    if not _this_machine(args):
        return Evidence.none(facts.name, "another machine (--gpu/--gpu-mem-gib/--hardware): this machine's "
                                         "history does not apply; default figures")
    return gather(facts)


def _gib(value: int | None) -> str:
    from desktop.core.machine.hardware import GIB

    return "?" if value is None else f"{value / GIB:.1f} GiB"


def cmd_detect(args: argparse.Namespace) -> int:
    from desktop.core.machine.hardware import detect

    snapshot = detect(args.models_dir)
    if args.json:
        emit_json(snapshot.to_json())
        return 0
    print(f"OS:    {snapshot.os}")
    cpu = snapshot.cpu
    feats = [f for f, on in (("AVX2", cpu.avx2), ("AVX-512", cpu.avx512), ("AMX", cpu.amx), ("NEON", cpu.neon)) if on]
    print(f"CPU:   {cpu.model} ({cpu.physical_cores} cores / {cpu.logical_cores} threads; {', '.join(feats) or '-'})")
    print(f"RAM:   {_gib(snapshot.ram_available_bytes)} free of {_gib(snapshot.ram_total_bytes)}")
    print(f"Disk:  {_gib(snapshot.disk_free_bytes)} free in {snapshot.models_dir}")
    for gpu in snapshot.gpus:
        extra = f", compute {gpu.compute_capability}" if gpu.compute_capability else ""
        print(f"GPU {gpu.index}: {gpu.name} ({gpu.backend}) {_gib(gpu.memory_free_bytes)} free of "
              f"{_gib(gpu.memory_total_bytes)}{extra}")
    if not snapshot.gpus:
        print("GPU:   none")
    for note in snapshot.notes:
        print(f"note:  {note}")
    return 0


def _print_fit(result: FitResult) -> None:
    label = {"yes": "fits", "partial": "fits partially (some layers on the CPU)", "no": "does NOT fit"}[result.fits]
    print(f"{result.engine} on {result.device}: {label}")
    copy = result.breakdown.get("repacked", 0.0) if result.device == "CPU" else 0.0  # in the CPU plan's total
    repacked = f" + repacked copy {copy:.2f} GiB" if copy else ""
    print(f"  weights {result.weights_gib:.2f} GiB{repacked} + KV cache {result.kv_cache_gib:.2f} GiB + overhead "
          f"{result.overhead_gib:.2f} GiB = {result.total_gib:.2f} GiB; available {result.available_gib:.2f} GiB, "
          f"headroom {result.headroom_gib:.2f} GiB")
    if result.gpu_layers is not None and result.total_layers:
        print(f"  GPU layers: {result.gpu_layers}/{result.total_layers}; CPU RAM needed {result.cpu_ram_gib:.2f} GiB")
    if result.kv_cache_tokens is not None:
        print(f"  KV cache: {result.kv_cache_tokens:,} tokens, max concurrency {result.max_concurrency} at "
              f"{result.ctx:,} tokens per request")
    for note in result.notes:
        print(f"  note: {note}")


def cmd_fit(args: argparse.Namespace) -> int:
    from desktop.core.models.facts import facts_for
    from desktop.core.planning.evidence import corrected_fit, memory_checks
    from desktop.core.planning.fit import default_ctx, estimate, normalise_engine, sizing_plan, validate_plan

    engine = normalise_engine(args.engine)
    vllm = engine == "vllm"
    slots = args.parallel or args.max_num_seqs or (256 if vllm else 1)
    fields: dict[str, Any] = {
        "slots": slots, "gpu_layers": args.gpu_layers, "kv_cache_type": args.kv_cache_dtype if vllm else args.kv_type,
        "gpu_memory_utilization": args.util if vllm else None, "tensor_parallel": args.tp,
        "max_num_batched_tokens": args.max_num_batched_tokens, "eager": args.enforce_eager}
    validate_plan(sizing_plan(engine, ctx_per_request=args.ctx or 1, **fields))  # before any download or probe
    hardware = _hardware(args)
    facts = facts_for(args.model)
    ctx = args.ctx or default_ctx(facts, engine)
    result = estimate(facts, hardware, sizing_plan(engine, model_path=facts.path or args.model, ctx_per_request=ctx,
                                                   **fields), quant=args.quant)
    if not args.ctx:
        result.notes.insert(0, f"ctx not given: sized for {ctx:,} tokens per request (pass --ctx)")
    found = _evidence(args, facts).get(engine)
    if found is not None and found.load_memory is not None:
        result = corrected_fit(result, memory_checks(facts, hardware, found.load_memory))
    if not args.no_history and _this_machine(args):
        from desktop.core.planning import calibration

        result = calibration.corrected(result, hardware)
    check = _engine_check(facts, hardware, result) if args.engine_check else None
    if args.json:
        emit_json({**result.to_json(), **({"engine_check": check} if check is not None else {})})
    else:
        _print_fit(result)
        if check is not None:
            _print_engine_check(check)
    return 0 if result.fits != "no" else 1


def _engine_check(facts: Any, hardware: HardwareSnapshot, result: FitResult) -> dict[str, Any]:
    """The engine's own answer for the checked plan on this machine: a probe launch and its memory report."""
    from desktop.core.engines import get_adapter
    from desktop.core.planning import calibration
    from desktop.core.runtime.calibrate import gpu_only_note
    from desktop.core.runtime.memprobe import probe

    local = facts.hf_dir if result.engine == "vllm" and facts.hf_dir else facts.path
    if result.plan is None or not local:
        raise SwitchyardError("--engine-check needs a local model file or folder", "pass a path, or demo")
    adapter = get_adapter(result.engine)
    install = adapter.find_install()
    if install is None:
        raise SwitchyardError(f"{result.engine} is not installed", f"switchyard engines install {result.engine}")
    from dataclasses import replace
    from pathlib import Path

    probed = probe(adapter, install, replace(result.plan, model_path=Path(local)))
    out: dict[str, Any] = {"started": probed.started, "error": probed.error, "argv": probed.argv,
                           "lines": probed.report.lines}
    if probed.retried:
        out["retried"] = probed.retried
    note = gpu_only_note(result.engine, hardware)
    if note:
        out["gpu_only"] = note
    if probed.started:
        out["components"] = {k: {"predicted_bytes": p, "measured_bytes": m}
                             for k, (p, m) in calibration.components(result.engine, probed.report, result).items()}
    opinion = calibration.second_opinion(probed.report, result)
    if opinion is not None:
        out["engine_fit"] = opinion.to_json()
    return out


def _print_engine_check(check: dict[str, Any]) -> None:
    if check.get("retried"):
        print(f"  engine check: {check['retried']}")
    if not check["started"]:
        print(f"  engine check: the engine did not start: {check['error']}")
    for name, row in (check.get("components") or {}).items():
        if name == "kv_tokens":
            print(f"  engine check: KV tokens predicted {row['predicted_bytes']:,.0f}, engine {row['measured_bytes']:,.0f}")
        else:
            print(f"  engine check: {name} predicted {row['predicted_bytes'] / 2**20:.1f} MiB, engine "
                  f"{row['measured_bytes'] / 2**20:.1f} MiB")
    opinion = check.get("engine_fit")
    if opinion:
        print(f"  llama-server's own --fit projects {opinion['engine_mib']:.1f} MiB for this plan; the estimate "
              f"{opinion['ours_mib']:.1f} MiB ({opinion['relative'] * 100:+.1f}%)"
              + (f": {opinion['explanation']}" if opinion.get("explanation") else ""))
    if check.get("gpu_only"):
        print(f"  engine check: {check['gpu_only']}")


def cmd_recommend(args: argparse.Namespace) -> int:
    from desktop.core.models.facts import facts_for
    from desktop.core.planning.basis import memory_check, quality_lines
    from desktop.core.planning.launch import describe
    from desktop.core.planning.recommend import Workload, recommend

    typed = {"concurrency": args.concurrency, "prompt_len": args.prompt_len, "output_len": args.output_len,
             "lifetime_hours": args.lifetime_hours, "restarts_per_day": args.restarts_per_day}
    traffic = _traffic_workload(args, typed) if args.from_traffic else None
    workload = traffic[0] if traffic else Workload(**{k: v for k, v in typed.items() if v is not None})
    workload.validate()
    hardware = _hardware(args)
    facts = facts_for(args.model)
    evidence = _evidence(args, facts)
    rec = recommend(facts, hardware, workload, evidence=evidence)
    launch = describe(rec.fit) if rec.fit is not None else None
    if args.json:
        data: dict[str, Any] = rec.to_json()
        data["evidence"] = evidence.to_json()
        data["workload"] = {**dataclasses.asdict(workload), "source": traffic[1] if traffic else "typed"}
        if launch is not None:
            data.update(argv=launch["argv"], env=launch["env"])
        emit_json(data)
        return 0
    if traffic:
        print(f"Workload {traffic[1]}")
    print(f"Recommended: {rec.engine} with {rec.quant}")
    for key, value in rec.key_settings.items():
        print(f"  {key}: {value}")
    if launch is not None:
        print(f"  command: {shlex.join(launch['argv'])}")
    for reason in rec.reasons:
        print(f"  - {reason}")
    for check in rec.numbers.get("memory_checks") or []:
        print(f"  {memory_check(check)}")
    for line in quality_lines(rec.numbers.get("quality")):
        print(f"  {line}")
    if rec.runner_up:
        print(f"Runner-up: {rec.runner_up['engine']} ({rec.runner_up.get('quant') or '-'}): {rec.runner_up['why_lost']}")
    return 0


def _traffic_workload(args: argparse.Namespace, typed: dict[str, Any]) -> tuple[Workload, str]:
    """The workload the request log profiles, typed numbers overriding it, and a line saying where it came from
    ("from 4,212 requests over 3 days: p95 concurrency 11, lifetime 9 h"). Too little traffic is an error: the
    user asked for the traffic's numbers, and defaults would pass for them silently."""
    from desktop.core.measure.profile import MIN_REQUESTS, load_profile, parse_since
    from desktop.core.storage.history import Store

    with Store() as store:
        profile = load_profile(store, since=parse_since(args.since), model=args.traffic_model)
    if not profile.enough:
        raise SwitchyardError(f"too little traffic for --from-traffic: {profile.requests} requests in the request "
                              f"log since {args.since} (at least {MIN_REQUESTS} answered ones needed)",
                              "serve through the endpoint for a while, widen --since, or type the numbers")
    workload = profile.workload(**typed)
    overridden = [name.replace("_", "-") for name, value in typed.items() if value is not None]
    line = profile.summary_line()
    if overridden:
        line += f" (typed {', '.join('--' + name for name in overridden)} override it)"
    return workload, line
