"""Cold-start phases from the engines' own log lines, vLLM's compile cache per model and plan, the root cause of a
vLLM that fails to start, the app's own polling kept out of the engine log, and the models list the GUI writes.
The log lines here are the installed builds' own (vLLM 0.32 CPU, llama-server b11434), copied from real runs; the
real-engine tests are in test_cold_start_engines.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.engines.llamacpp import LlamaCppAdapter
from desktop.core.engines.vllm import VllmAdapter, compile_cache_key, compile_cache_prepared, root_cause
from desktop.core.runtime.supervisor import COLD_START_PHASES, ColdStart, phases_of

VLLM_START = [  # (seconds since spawn, line) from a vLLM 0.32 CPU start of the demo with an empty compile cache
    (11.0, "(APIServer pid=18392) INFO 12-01 21:55:40 [api_utils.py:286] non-default args: {'host': '127.0.0.1'}"),
    (57.1, "(Worker pid=19355) INFO 12-01 21:56:26 [cpu_model_runner.py:68] Starting to load model /x/hf..."),
    (57.3, "(Worker pid=19355) INFO 12-01 21:56:27 [default_loader.py:501] Loading weights took 0.08 seconds"),
    (58.0, "(Worker pid=19355) INFO 12-01 21:56:28 [cpu_model_runner.py:87] Warming up model for the compilation..."),
    (117.6, "(Worker pid=19355) INFO 12-01 21:57:27 [decorators.py:743] [backbone] saved AOT compiled function to "
            "/c/torch_compile_cache/torch_aot_compile/7a26/rank_0_0/model"),
    (118.4, "(Worker pid=19355) INFO 12-01 21:57:28 [monitor.py:91] [backbone] Initial profiling/warmup run took 1.40 s"),
    (119.4, "(Worker pid=19355) INFO 12-01 21:57:29 [cpu_model_runner.py:91] Warming up done."),
    (119.5, "(EngineCore pid=19172) INFO 12-01 21:57:29 [kv_cache_utils.py:2327] CPU KV cache size: 262,144 tokens, "
            "Maximum concurrency for 2,048 tokens per request: 128.00x"),
    (128.7, "(EngineCore pid=19172) INFO 12-01 21:57:38 [core.py:402] init engine (profile, create kv cache, warmup "
            "model) took 70.32 s"),
    (132.9, "INFO:     Application startup complete."),
]


def replay(adapter: object, lines: list[tuple[float, str]], plan: LaunchPlan) -> ColdStart:
    """What EngineProcess._match_markers does with each line, at the given times."""
    cold = ColdStart(expected=adapter.cold_start_phases(plan))  # type: ignore[attr-defined]
    for seconds, line in lines:
        for marker in adapter.log_markers:  # type: ignore[attr-defined]
            match = marker.match(line)
            if match and marker.name not in cold.markers:
                cold.markers[marker.name] = seconds
                cold.facts.update({f"{marker.name}.{k}": v for k, v in match.groupdict().items() if v})
                if marker.ends:
                    cold.end_phase(marker.ends, seconds)
    return cold


def test_vllm_phases_stack_in_order_from_its_own_lines_and_name_a_compile_miss() -> None:
    plan = LaunchPlan("vllm", Path("/x/hf"))
    cold = replay(VllmAdapter(), VLLM_START, plan)
    cold.t1_health_s, cold.t2_first_token_s, cold.t3_first_request_s = 133.0, 133.4, 133.5
    phases = cold.phases()
    assert [p["phase"] for p in phases] == ["process", "weights", "compile", "memory", "graphs", "api",
                                            "first_token", "first_request"]
    by = {p["phase"]: p for p in phases}
    assert by["process"]["seconds"] == 57.1 and by["compile"]["start_s"] == 57.3
    assert by["compile"]["seconds"] == pytest.approx(119.4 - 57.3)  # to "Warming up done." (CPU: it compiles)
    assert by["memory"]["seconds"] == pytest.approx(119.5 - 119.4)
    assert all(a["end_s"] == b["start_s"] for a, b in zip(phases, phases[1:], strict=False))  # stacked, no gaps
    assert phases[-1]["end_s"] == 133.5
    assert cold.compile_cache == "miss"
    data = cold.to_json()
    assert data["phases"] == phases and data["compile_cache"] == "miss"
    assert phases_of(data) == phases  # what reports and history read back


def test_a_cache_hit_is_named_and_eager_plans_expect_no_compile() -> None:
    hit = [(50.0, "(Worker pid=1) INFO 12-01 10:00:00 [cpu_model_runner.py:68] Starting to load model /x..."),
           (51.0, "(Worker pid=1) INFO 12-01 10:00:01 [decorators.py:320] [backbone] Directly load AOT compilation "
                  "from path /c/torch_compile_cache/torch_aot_compile/7a/rank_0_0/model")]
    cold = replay(VllmAdapter(), hit, LaunchPlan("vllm", Path("/x")))
    assert cold.compile_cache == "hit" and cold.phase_ends["compile"] == 51.0
    assert "compile" not in VllmAdapter().cold_start_phases(LaunchPlan("vllm", Path("/x"), eager=True))
    stale = [(9.0, "(Worker pid=23690) WARNING 12-01 21:59:50 [decorators.py:333] [backbone] Compiling model again "
                   "due to a load failure from /c/torch_compile_cache/torch_aot_compile/7a/rank_0_0/model, reason: "
                   "'function' object has no attribute 'finalize_loading'"),
             (80.0, "(Worker pid=23690) INFO 12-01 22:01:07 [decorators.py:743] [backbone] saved AOT compiled "
                    "function to /c/torch_compile_cache/torch_aot_compile/7a/rank_0_0/model")]
    found = replay(VllmAdapter(), stale, LaunchPlan("vllm", Path("/x")))
    assert found.compile_cache == "stale" and "finalize_loading" in found.facts["compile_cache_stale.why"]


def test_the_phase_under_way_grows_live_and_is_the_next_expected_one() -> None:
    plan = LaunchPlan("vllm", Path("/x/hf"))
    cold = replay(VllmAdapter(), VLLM_START[:3], plan)  # weights loaded, compiling now
    assert cold.current_phase() == "compile"
    live = cold.phases(now=80.0)
    assert live[-1] == {"phase": "compile", "label": "torch.compile", "start_s": 57.3, "end_s": 80.0,
                        "seconds": 22.7, "running": True}
    eager = replay(VllmAdapter(), VLLM_START[:3], LaunchPlan("vllm", Path("/x/hf"), eager=True))
    assert eager.current_phase() == "memory"  # eager: after weights comes the profile run, not a compile
    eager_done = replay(VllmAdapter(), VLLM_START, LaunchPlan("vllm", Path("/x/hf"), eager=True))
    assert "compile" not in [p["phase"] for p in eager_done.phases()]  # its warm-up is no compile


def test_llamacpp_phases_from_its_default_verbosity_lines() -> None:
    lines = [(0.017, "0.00.016.908 I srv    load_model: loading model '/d/demo.gguf'"),
             (0.120, "0.00.119.932 I cmn          init: llama threadpool init, n_threads = 2"),
             (0.239, "0.00.239.365 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 2048"),
             (0.242, "0.00.242.089 I srv  llama_server: model loaded"),
             (0.243, "0.00.242.117 I srv  llama_server: listening on http://127.0.0.1:57293")]
    cold = replay(LlamaCppAdapter(), lines, LaunchPlan("llama.cpp", Path("/d/demo.gguf")))
    cold.t1_health_s = 0.34
    assert [p["phase"] for p in cold.phases()] == ["process", "weights", "memory", "graphs", "api"]
    assert cold.compile_cache is None


def test_phase_names_are_written_once_and_old_history_rows_still_read() -> None:
    keys = [phase.key for phase in COLD_START_PHASES]
    assert len(set(keys)) == len(keys) and keys[-3:] == ["api", "first_token", "first_request"]
    old_row = {"t1_health_s": 2.0, "t2_first_token_s": 2.5, "t3_first_request_s": 2.6}  # before phases existed
    assert [(p["phase"], p["seconds"]) for p in phases_of(old_row)] == [("api", 2.0), ("first_token", 0.5),
                                                                         ("first_request", 0.1)]


@pytest.mark.parametrize("line", [
    'INFO:     127.0.0.1:54321 - "GET /metrics HTTP/1.1" 200 OK',
    'INFO:     127.0.0.1:54321 - "GET /health HTTP/1.1" 200 OK',
    "0.01.226.001 I srv  log_server_r: done request: GET /slots 127.0.0.1 200",
])
def test_the_apps_own_polls_are_recognised(line: str) -> None:
    assert VllmAdapter().is_polling_line(line) and LlamaCppAdapter().is_polling_line(line)


@pytest.mark.parametrize("line", [
    'INFO:     127.0.0.1:54321 - "POST /v1/completions HTTP/1.1" 200 OK',
    "0.01.226.001 I srv  log_server_r: done request: POST /v1/chat/completions 127.0.0.1 200",
    "(APIServer pid=1) INFO 12-01 21:57:41 [launcher.py:195] Route: /metrics, Methods: GET",
])
def test_client_requests_and_engine_lines_stay_in_the_log(line: str) -> None:
    assert not VllmAdapter().is_polling_line(line)


def test_compile_cache_is_per_model_and_plan_and_in_the_apps_folder(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_VLLM_COMPILE_CACHE", str(tmp_path))
    base = LaunchPlan("vllm", tmp_path / "model-a", port=8000, api_key="k1")
    same = LaunchPlan("vllm", tmp_path / "model-a", port=9000, api_key="k2", threads=2)  # ports, keys: not shape
    assert compile_cache_key(base) == compile_cache_key(same)
    assert compile_cache_key(base) != compile_cache_key(LaunchPlan("vllm", tmp_path / "model-b"))
    assert compile_cache_key(base) != compile_cache_key(LaunchPlan("vllm", tmp_path / "model-a", ctx_per_request=4096))
    from desktop.core.engines.base import EngineInstall

    command = VllmAdapter().build_command(base, EngineInstall("vllm", "0.32.0", "cache", Path("/venv/bin/python")))
    assert command.env["VLLM_CACHE_ROOT"] == str(tmp_path / compile_cache_key(base))
    assert command.env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / compile_cache_key(base) / "inductor")
    assert "--disable-access-log-for-endpoints" in command.argv
    eager = VllmAdapter().build_command(LaunchPlan("vllm", tmp_path / "model-a", eager=True),
                                        EngineInstall("vllm", "0.32.0", "cache", Path("/venv/bin/python")))
    assert "VLLM_CACHE_ROOT" not in eager.env
    assert not compile_cache_prepared(base)
    artefact = tmp_path / compile_cache_key(base) / "torch_compile_cache" / "torch_aot_compile" / "ab" / "rank_0_0"
    artefact.mkdir(parents=True)
    (artefact / "model").write_bytes(b"compiled")
    assert compile_cache_prepared(base) and compile_cache_prepared(same)
    assert VllmAdapter().compile_cache_found(base) is True
    # caches switched off in the plan's env: the files left there are not a warm start
    switched_off = LaunchPlan("vllm", tmp_path / "model-a", env={"VLLM_DISABLE_COMPILE_CACHE": "1"})
    assert VllmAdapter().compile_cache_found(switched_off) is False


VLLM_TRUNCATED = """\
(APIServer pid=1) INFO 12-01 05:04:20 [api_utils.py:347] version 0.32.0
(EngineCore pid=7) ERROR 12-01 05:04:30 [core.py:1140] EngineCore failed to start.
(EngineCore pid=7) ERROR 12-01 05:04:30 [core.py:1140] Traceback (most recent call last):
(EngineCore pid=7) ERROR 12-01 05:04:30 [core.py:1140]   File "/v/core.py", line 3, in run
(EngineCore pid=7) ERROR 12-01 05:04:30 [core.py:1140]     raise X
(EngineCore pid=7) ERROR 12-01 05:04:30 [core.py:1140] safetensors_rust.SafetensorError: Error while deserializing \
header: incomplete metadata, file not fully covered
(EngineCore pid=7) Process EngineCore:
(APIServer pid=1) Traceback (most recent call last):
(APIServer pid=1)   File "/v/api_server.py", line 9, in <module>
(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
""".splitlines()


def test_vllm_root_cause_is_the_first_exception_of_the_engine_core_not_the_api_servers_echo() -> None:
    assert root_cause(VLLM_TRUNCATED) == ("SafetensorError: Error while deserializing header: incomplete metadata, "
                                          "file not fully covered")
    reason = VllmAdapter().explain_failure(1, VLLM_TRUNCATED)
    assert "SafetensorError: Error while deserializing header" in reason.reason
    assert "See root cause above" not in reason.reason and "download the model again" in reason.suggestion
    assert root_cause([line for line in VLLM_TRUNCATED if not line.startswith("(EngineCore")]) is None


def test_models_yaml_round_trips_through_the_clis_parser(tmp_path: Path) -> None:
    from desktop.core.serving.fleet import load_models_config
    from desktop.core.serving.models_file import dump_models_yaml, validate_entries, write_models_config

    config = validate_entries([{"name": "chat", "engine": "llama.cpp", "model": "demo", "ttl": 300},
                               {"name": "big", "engine": "vllm", "model": "demo", "ctx": 4096, "parallel": 2}])
    path = write_models_config(config, tmp_path / "models.yaml")
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_models_config(path).models == config.models
    assert yaml.safe_load(dump_models_yaml(config))["models"][0] == {"name": "chat", "engine": "llama.cpp",
                                                                     "model": "demo", "ttl": 300}
    with pytest.raises(SwitchyardError, match="used twice"):
        validate_entries([{"name": "a", "engine": "vllm", "model": "m"}, {"name": "a", "engine": "vllm", "model": "m"}])
    with pytest.raises(SwitchyardError, match="ctx must be"):
        validate_entries([{"name": "a", "engine": "vllm", "model": "m", "ctx": 0}])


def test_recommend_takes_the_warm_cold_start_once_the_compile_cache_is_prepared() -> None:
    from desktop.core.planning.evidence import from_runs
    from desktop.core.storage.history import RunRecord

    def launch(run_id: int, t3: float, cache: str) -> RunRecord:
        return RunRecord(kind="launch", engine="vllm", engine_version="0.32.0", model="demo", settings={},
                         summary={"cold_start": {"t3_first_request_s": t3, "compile_cache": cache}},
                         id=run_id, created_at=1_000_000.0 + run_id, machine="box")

    # newest first: a compile-miss start after a warm one (another plan's first start, say) does not hide it
    evidence = from_runs([launch(3, 130.0, "miss"), launch(2, 70.0, "hit"), launch(1, 140.0, "miss")], "demo", "box")
    figure = evidence.cold_start("vllm")
    assert figure is not None and figure.value == 70.0 and "warm compile cache" in figure.note
    cold_only = from_runs([launch(1, 140.0, "miss")], "demo", "box").cold_start("vllm")
    assert cold_only is not None and cold_only.value == 140.0


def test_unquantized_weights_are_labelled_with_their_float_type() -> None:
    from desktop.ui.widgets import quant_label

    assert quant_label("F32") == "F32 (unquantized)"
    assert quant_label(None, "float32") == "F32 (unquantized)"  # the --dtype vLLM will use
    assert quant_label("", "bfloat16") == "BF16 (unquantized)"
    assert quant_label(None, "auto") == "unquantized (the checkpoint's dtype)"
    assert quant_label("Q4_K_M", "float32") == "Q4_K_M"


@pytest.mark.parametrize(("log", "words"), [
    ("vllm-truncated-safetensors.log", ("SafetensorError: Error while deserializing header: incomplete metadata",)),
    ("vllm-missing-config.log", ("no config.json",)),
    ("vllm-kv-cache-beyond-memory.log", ("ValueError: Available memory on node 0", "less than requested memory")),
    ("vllm-unsupported-architecture.log", ("does not support the model's architecture 'NotARealModelForCausalLM'",)),
])
def test_real_vllm_failure_logs_are_explained_by_their_cause(log: str, words: tuple[str, ...]) -> None:
    """The logs of real failed starts (vLLM 0.32 CPU, recorded by test_vllm_failures.py)."""
    lines = (Path(__file__).parent / "data" / log).read_text().splitlines()
    reason = VllmAdapter().explain_failure(1, lines[-VllmAdapter.failure_tail_lines:])
    for word in words:
        assert word in reason.reason
    assert "See root cause above" not in reason.reason


def test_a_start_that_found_its_inductor_cache_filled_is_warm_even_when_vllm_logs_nothing() -> None:
    plan = LaunchPlan("vllm", Path("/x"))
    expected = VllmAdapter().cold_start_phases(plan)
    assert ColdStart(expected=expected, compile_cache_dir="/c", compile_cache_found=True).compile_cache == "warm"
    assert ColdStart(expected=expected, compile_cache_dir="/c", compile_cache_found=False).compile_cache == "miss"
    eager = VllmAdapter().cold_start_phases(LaunchPlan("vllm", Path("/x"), eager=True))
    assert ColdStart(expected=eager, compile_cache_dir="/c").compile_cache == "off"
    env = VllmAdapter().build_command(plan, __import__("desktop.core.engines.base", fromlist=["EngineInstall"])
                                      .EngineInstall("vllm", "0.32.0", "cache", Path("/p"))).env
    assert env["VLLM_USE_AOT_COMPILE"] == "0"  # CPU: the AOT artefact never loads; Inductor's cache does
