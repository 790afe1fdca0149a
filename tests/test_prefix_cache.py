"""Issue 48: the prefix cache is on wherever the app serves, off where it measures (A/B, bench), and can be turned
off per model; llama-server's host-RAM prompt cache (`--cache-ram`) is sized by the plan and counted by the fit.

The end-to-end tests send the same ~1,500-token chat request twice through the stable endpoint that
`switchyard serve --endpoint` starts, and read the reuse from the engines themselves: llama-server's
`timings.cache_n` (prompt tokens taken from its cache) against `timings.prompt_n` (tokens evaluated), vLLM's
`vllm:prefix_cache_hits` against `vllm:prefix_cache_queries` on its own /metrics (over the engine's private socket:
the endpoint does not forward /metrics)."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import run_cli, serve_until_ready

from desktop.core.common import unixhttp
from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineInstall, LaunchPlan
from desktop.core.machine.hardware import GIB, MIB, HardwareSnapshot
from desktop.core.models.facts import facts_for
from desktop.core.planning.fit import estimate, exact_bytes, sizing_plan
from desktop.core.planning.planner import plan_launch
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving.fleet import parse_models_config
from desktop.core.serving.models_file import dump_models_yaml

HERE = Path(__file__).parent
LAPTOP = HardwareSnapshot.load(HERE / "snapshots" / "cpu_laptop.json")  # 9 GiB of RAM available, no GPU
RTX4090 = HardwareSnapshot.load(HERE / "snapshots" / "rtx4090.json")
INSTALL = EngineInstall("llama.cpp", "x", "cache", Path("/opt/llama-server"))
DEFAULT_CACHE_RAM_MIB = 8192  # llama.cpp b11434 common/common.h:638 `cache_ram_mib = 8192`


def _argv(plan: LaunchPlan) -> list[str]:
    return get_adapter(plan.engine).build_command(plan, INSTALL).argv


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# --- the plans ---------------------------------------------------------------------------------------------------
def test_serving_plans_keep_the_prefix_cache_on_and_the_opt_out_turns_it_off() -> None:
    llama = plan_launch("llama.cpp", "demo", LAPTOP).plan
    vllm = plan_launch("vllm", "demo", LAPTOP).plan
    assert llama.prefix_cache and "--no-cache-prompt" not in _argv(llama)
    assert "--enable-prefix-caching" in _argv(vllm) and "--no-enable-prefix-caching" not in _argv(vllm)
    off_llama = plan_launch("llama.cpp", "demo", LAPTOP, {"prefix_cache": False}).plan
    off_vllm = plan_launch("vllm", "demo", LAPTOP, {"prefix_cache": False}).plan
    assert "--no-cache-prompt" in _argv(off_llama) and _flag(_argv(off_llama), "--cache-ram") == "0"
    assert "--no-enable-prefix-caching" in _argv(off_vllm)
    # the opt-out is an ask every engine reads: a switch to the other engine keeps it
    from desktop.core.planning.planner import replan

    assert replan(off_llama, LAPTOP, engine="vllm").plan.prefix_cache is False
    assert replan(llama, LAPTOP, engine="vllm").plan.prefix_cache is True


def test_serve_no_prefix_cache_flag_reaches_the_argv() -> None:
    common = ("serve", "--engine", "llama.cpp", "--model", "demo", "--hardware", str(HERE / "snapshots" /
                                                                                      "cpu_laptop.json"),
              "--dry-run", "--json")
    on = run_cli(*common)
    off = run_cli(*common, "--no-prefix-cache")
    assert on.returncode == 0 and off.returncode == 0, (on.stderr, off.stderr)
    on_argv, off_argv = json.loads(on.stdout)["argv"], json.loads(off.stdout)["argv"]
    assert "--no-cache-prompt" not in on_argv and int(_flag(on_argv, "--cache-ram") or -1) > 0
    assert "--no-cache-prompt" in off_argv and _flag(off_argv, "--cache-ram") == "0"


def test_models_yaml_prefix_cache_false_per_entry_round_trips() -> None:
    config = parse_models_config({"models": [
        {"name": "chat", "engine": "llama.cpp", "model": "demo"},
        {"name": "bench", "engine": "vllm", "model": "demo", "prefix_cache": False},
    ]})
    chat, bench = config.models
    assert chat.prefix_cache and "prefix_cache" not in chat.asks()
    assert bench.prefix_cache is False and bench.asks()["prefix_cache"] is False
    assert "--no-enable-prefix-caching" in _argv(bench.plan(LAPTOP).plan)
    assert "--no-cache-prompt" not in _argv(chat.plan(LAPTOP).plan)
    text = dump_models_yaml(config)
    written = yaml.safe_load(text)["models"]
    assert "prefix_cache" not in written[0] and written[1]["prefix_cache"] is False
    with pytest.raises(Exception, match="prefix_cache must be true or false"):
        parse_models_config({"models": [{"name": "x", "engine": "llama.cpp", "model": "demo",
                                         "prefix_cache": "no"}]})
    # the engines' own spellings are the plan's: refused, naming the key
    with pytest.raises(Exception, match="prefix_cache: false"):
        parse_models_config({"models": [{"name": "x", "engine": "llama.cpp", "model": "demo",
                                         "args": ["--no-cache-prompt"]}]})


def test_ab_and_bench_measure_with_the_cache_off() -> None:
    from desktop.core.measure.ab import ABConfig, plan_ab

    plans = {name: checked.plan for name, checked in plan_ab(ABConfig(model="demo"), LAPTOP).items()}
    assert "--no-cache-prompt" in _argv(plans["llama.cpp"]) and _flag(_argv(plans["llama.cpp"]), "--cache-ram") == "0"
    assert "--no-enable-prefix-caching" in _argv(plans["vllm"])
    on = {name: checked.plan for name, checked in plan_ab(ABConfig(model="demo", prefix_cache=True),
                                                           LAPTOP).items()}
    assert "--no-cache-prompt" not in _argv(on["llama.cpp"]) and "--enable-prefix-caching" in _argv(on["vllm"])


# --- --cache-ram: sized by the plan, counted by the fit -------------------------------------------------------
def _engine_bytes(hardware: HardwareSnapshot) -> float:
    """What llama-server itself holds for the demo on a CPU (the fit's parts, without any prompt cache)."""
    off = estimate(facts_for("demo"), hardware, sizing_plan("llama.cpp", prefix_cache=False))
    assert off.breakdown["prompt_cache"] == 0 and off.plan is not None and off.plan.cache_ram_mib == 0
    return sum(exact_bytes(off).get(k, 0.0) for k in ("weights", "kv_cache", "compute", "repacked"))


@pytest.mark.parametrize("left_mib, expected_mib", [(3001, 1500), (40_000, DEFAULT_CACHE_RAM_MIB), (0, 0)])
def test_cache_ram_is_half_of_what_the_plan_leaves_free_at_most_the_engines_default(left_mib: int,
                                                                                   expected_mib: int) -> None:
    """RAM available = the engine's own need + `left_mib`: the cache gets min(8192, half of that) MiB, in the argv
    and in the fit's host-RAM sum (total, cpu_ram and headroom on a CPU plan)."""
    need = _engine_bytes(LAPTOP)
    machine = replace(LAPTOP, ram_available_bytes=int(need + left_mib * MIB))
    demo = facts_for("demo")
    fit = estimate(demo, machine, sizing_plan("llama.cpp"))
    assert fit.plan is not None and fit.plan.cache_ram_mib == expected_mib
    assert _flag(_argv(fit.plan), "--cache-ram") == str(expected_mib)
    assert fit.total_gib == pytest.approx((need + expected_mib * MIB) / GIB, abs=0.0015)
    assert fit.cpu_ram_gib == fit.total_gib and fit.fits == "yes"
    assert fit.headroom_gib == pytest.approx((left_mib - expected_mib) * MIB / GIB, abs=0.0015)
    if expected_mib < DEFAULT_CACHE_RAM_MIB:
        assert any(f"--cache-ram {expected_mib}" in note for note in fit.notes)


def test_an_asked_cache_ram_is_counted_and_refused_when_it_does_not_fit() -> None:
    need = _engine_bytes(LAPTOP)
    machine = replace(LAPTOP, ram_available_bytes=int(need + 1000 * MIB))
    demo = facts_for("demo")
    from desktop.core.engines.engine_args import plan_fields_from_args

    fields = plan_fields_from_args("llama.cpp", ["--cache-ram", "512"])  # `serve -- --cache-ram 512`, `args:`
    assert fields == {"cache_ram_mib": 512}
    asked = plan_launch("llama.cpp", "demo", machine, fields)
    assert asked.plan.cache_ram_mib == 512 and asked.plan.extra_args == ()
    assert _argv(asked.plan).count("--cache-ram") == 1 and _flag(_argv(asked.plan), "--cache-ram") == "512"
    assert asked.fit.total_gib == pytest.approx((need + 512 * MIB) / GIB, abs=0.0015)
    too_big = estimate(demo, machine, sizing_plan("llama.cpp", cache_ram_mib=2000))
    assert too_big.fits == "no" and any("--cache-ram 2000" in note for note in too_big.notes)
    with pytest.raises(Exception, match="whole number of MiB"):
        plan_fields_from_args("llama.cpp", ["--cache-ram", "-1"])


def test_a_gpu_plan_counts_the_cache_in_host_ram_only() -> None:
    """Layers on the GPU: the cache is host RAM (llama-server copies a slot's KV into a std::vector), so it adds to
    cpu_ram and leaves the GPU numbers alone."""
    demo = facts_for("demo")
    on = estimate(demo, RTX4090, sizing_plan("llama.cpp"))
    off = estimate(demo, RTX4090, sizing_plan("llama.cpp", prefix_cache=False))
    assert on.device != "CPU" and on.plan is not None
    spare_mib = (RTX4090.ram_available_bytes - off.cpu_ram_gib * GIB) / 2 / MIB
    assert on.plan.cache_ram_mib == min(DEFAULT_CACHE_RAM_MIB, int(spare_mib))
    assert on.cpu_ram_gib == pytest.approx(off.cpu_ram_gib + on.plan.cache_ram_mib * MIB / GIB, abs=0.0015)
    assert (on.total_gib, on.headroom_gib, on.gpu_layers) == (off.total_gib, off.headroom_gib, off.gpu_layers)


def test_vllm_plans_have_no_cache_ram() -> None:
    plan = plan_launch("vllm", "demo", LAPTOP).plan
    assert plan.cache_ram_mib is None and "--cache-ram" not in _argv(plan)


# --- through the stable endpoint, on the real engines ------------------------------------------------------------
def _long_chat() -> list[dict[str, str]]:
    """A chat whose prompt is ~1,500 demo-model tokens (well under the 2,048-token context per request)."""
    facts = " ".join(f"Station {i} lies {i * 7 % 97} km north of depot {i % 13}." for i in range(55))
    return [{"role": "system", "content": "You answer from this list of facts only. " + facts},
            {"role": "user", "content": "Which station lies closest to depot 4?"}]


def _chat(url: str) -> dict[str, Any]:
    answer = httpx.post(url + "/chat/completions", trust_env=False, timeout=300,
                        json={"model": "switchyard", "messages": _long_chat(), "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _stop(proc: subprocess.Popen[str], port: int) -> None:
    try:
        if proc.poll() is None:
            run_cli("stop", "--port", str(port))
            proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _llama_reuse(*flags: str) -> tuple[dict[str, Any], dict[str, Any]]:
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port), *flags)
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        url = f"http://127.0.0.1:{port}/v1"
        return _chat(url), _chat(url)
    finally:
        _stop(proc, port)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_llama_server_behind_the_endpoint_reuses_the_repeated_prompt(llama_install: Any, demo_model: Any) -> None:
    first, second = _llama_reuse()
    prompt = second["usage"]["prompt_tokens"]
    assert 1200 <= prompt <= 1900, prompt
    assert first["timings"]["cache_n"] == 0 and first["timings"]["prompt_n"] == prompt
    timings = second["timings"]
    print(f"llama-server, second request: cache_n {timings['cache_n']}, prompt_n {timings['prompt_n']} of {prompt}")
    assert timings["cache_n"] + timings["prompt_n"] == prompt
    assert timings["cache_n"] >= 0.9 * prompt, timings  # the engine's own count of tokens it did not evaluate again


@pytest.mark.engine
@pytest.mark.llamacpp
def test_serve_no_prefix_cache_evaluates_the_whole_prompt_again(llama_install: Any, demo_model: Any) -> None:
    _first, second = _llama_reuse("--no-prefix-cache")
    print(f"llama-server --no-prefix-cache, second request: timings {second['timings']}")
    assert second["timings"]["cache_n"] == 0
    assert second["timings"]["prompt_n"] == second["usage"]["prompt_tokens"]


_COUNTER = re.compile(r"^(vllm:prefix_cache_(?:hits|queries))_total\{[^}]*\}\s+([0-9.e+]+)$", re.M)


def _vllm_prefix_counters(base_url: str) -> dict[str, float]:
    """vLLM's own prefix-cache counters, from its /metrics on the engine's private socket."""
    with unixhttp.client(base_url, timeout=30) as client:
        text = client.get(unixhttp.http_url(base_url) + "/metrics").text
    found = {name: float(value) for name, value in _COUNTER.findall(text)}
    assert set(found) == {"vllm:prefix_cache_hits", "vllm:prefix_cache_queries"}, text[:2000]
    return found


def vllm_reuses_the_repeated_prompt(active: Any, proxy: Any) -> None:
    """The same ~1,500-token chat twice through the endpoint: vLLM's own counters say the second was read from its
    prefix cache. Run on the real vLLM behind the endpoint by tests/test_engine_sockets.py (one vLLM start)."""
    url = proxy.url + "/v1"
    first = _chat(url)
    before = _vllm_prefix_counters(active.process.base_url)
    second = _chat(url)
    after = _vllm_prefix_counters(active.process.base_url)
    prompt = second["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens"] == prompt and 1200 <= prompt <= 1900, prompt
    queries = after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"]
    hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
    print(f"vLLM, second request: prefix_cache_hits +{hits:g}, prefix_cache_queries +{queries:g} of {prompt}")
    assert queries == prompt, (queries, prompt)
    assert hits >= 0.9 * prompt, (hits, prompt)
    assert "--enable-prefix-caching" in get_adapter("vllm").build_command(
        active.process.plan, EngineInstall("vllm", "x", "cache", Path("python"))).argv
