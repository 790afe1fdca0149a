"""The foundation's CLI contract: version, engines list/doctor, and clear one-line errors on bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from desktop import __version__


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603 - test drives our own CLI
        [sys.executable, "-m", "desktop", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ},
    )


def assert_clean_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert needle.lower() in result.stderr.lower(), result.stderr
    assert result.stderr.startswith("switchyard: error:"), result.stderr


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"switchyard {__version__}"


HEAVY_MODULES = ("PySide6", "numpy", "httpx", "huggingface_hub", "torch", "gguf", "asyncio")
_IMPORTS_AFTER = """
import contextlib, json, sys
from desktop import cli
with contextlib.redirect_stdout(sys.stderr), contextlib.suppress(SystemExit):
    cli.main(sys.argv[1:])
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["status", "--port", "1"], ["serve", "--help"]])
def test_quick_commands_load_no_heavy_module(args: list[str]) -> None:
    """`--version`, `--help` and `status` answer at once because no command loads its libraries up front."""
    result = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *args], capture_output=True,  # noqa: S603
                            text=True, timeout=60, env={**os.environ})
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert loaded.isdisjoint(HEAVY_MODULES), sorted(loaded & set(HEAVY_MODULES))
    assert "desktop" in loaded


def test_engines_list_json_names_both_engines() -> None:
    result = run_cli("engines", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {row["name"] for row in rows} == {"llama.cpp", "vllm"}
    for row in rows:
        assert row["installed"] == (row["install"] is not None)
        if row["installed"]:
            assert Path(row["install"]["executable"]).exists()


def test_doctor_gives_the_exact_fix_when_an_engine_is_missing(tmp_path: Path) -> None:
    env = {**os.environ, "SWITCHYARD_ENGINES_DIR": str(tmp_path / "engines"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "desktop", "engines", "doctor", "--json"], capture_output=True, text=True,
        env=env, timeout=60,
    )
    assert result.returncode == 1
    findings = json.loads(result.stdout)
    missing = [f for f in findings if not f["ok"]]
    assert {f["engine"] for f in missing} == {"llama.cpp", "vllm"}
    assert all(f["fix"] and "switchyard engines install" in f["fix"] for f in missing if f["check"] != "backend")


def test_unknown_engine_is_one_clear_line() -> None:
    assert_clean_error(run_cli("serve", "--engine", "ollama", "--model", "demo"), "unknown engine 'ollama'")


def test_missing_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    assert_clean_error(run_cli("serve", "--engine", "llama.cpp", "--model", str(missing)), "does not exist")


def test_non_model_file(tmp_path: Path) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    assert_clean_error(run_cli("serve", "--engine", "llama.cpp", "--model", str(junk)), "not a model file")


def test_wrong_format_for_engine(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    assert_clean_error(run_cli("serve", "--engine", "vllm", "--model", str(gguf)), "--engine llama.cpp")


def test_busy_port_is_refused_before_anything_starts() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_cli("serve", "--engine", "llama.cpp", "--model", "demo", "--port", str(port))
    assert_clean_error(result, f"port {port}")
    assert "already in use" in result.stderr


def test_engines_install_rejects_unknown_names_before_installing() -> None:
    assert_clean_error(run_cli("engines", "install", "llama.cpp", "tgi"), "unknown engine 'tgi'")


@pytest.mark.parametrize("alias", ["llamacpp", "llama-server", "LLAMA.CPP"])
def test_engine_aliases(alias: str) -> None:
    from desktop.core.engines import get_adapter

    assert get_adapter(alias).name == "llama.cpp"


BAD_NUMBERS = [
    ("serve", "--engine", "llama.cpp", "--model", "demo", "--parallel", "-3"),
    ("serve", "--engine", "llama.cpp", "--model", "demo", "--ctx", "0"),
    ("serve", "--engine", "llama.cpp", "--model", "demo", "--port", "70000"),
    ("serve", "--engine", "llama.cpp", "--model", "demo", "--proxy-port", "0"),
    ("serve", "--engine", "llama.cpp", "--model", "demo", "--ready-timeout", "-1"),
    ("serve", "--engine", "llama.cpp", "--model", "demo", "--wait-timeout", "nan"),
    ("serve", "--engine", "llama.cpp", "--model", "demo", "--max-tokens", "lots"),
    ("bench", "--engine", "llama.cpp", "--model", "demo", "--concurrency", "0"),
    ("bench", "--engine", "llama.cpp", "--model", "demo", "--requests", "-1"),
    ("bench", "--engine", "llama.cpp", "--model", "demo", "--timeout", "inf"),
    ("ab", "--ctx", "-512"),
    ("export", "--gpu-memory-utilization", "1.5"),
    ("fit", "demo", "--util", "0"),
    ("recommend", "demo", "--concurrency", "-2"),
    ("pull", "x/y", "--retries", "-1"),
]


@pytest.mark.parametrize("args", BAD_NUMBERS, ids=lambda args: " ".join(args[:1] + args[-2:]))
def test_a_bad_number_is_one_clear_line_before_anything_starts(args: tuple[str, ...],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from desktop.cli import main

    with pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"argument {args[-2]}:" in err and "Traceback" not in err


def test_serve_with_negative_parallel_starts_nothing() -> None:
    before = set(Path(os.environ.get("SWITCHYARD_HOME", ".")).glob("run/engine-*.json"))
    result = run_cli("serve", "--engine", "llama.cpp", "--model", "demo", "--parallel", "-3")
    assert result.returncode == 2
    assert result.stderr.strip() == ("switchyard serve: error: argument --parallel: must be at least 1, got -3 "
                                     "(see switchyard serve --help)")
    assert set(Path(os.environ.get("SWITCHYARD_HOME", ".")).glob("run/engine-*.json")) == before


@pytest.mark.engine
@pytest.mark.parametrize(("engine", "cause"), [
    pytest.param("llama.cpp", "context length 1000000000 is out of range", marks=pytest.mark.llamacpp),
    pytest.param("vllm", "context length 1000000000 is out of range", marks=pytest.mark.vllm),
])
def test_an_absurd_context_says_why_the_engine_refused_it(engine: str, cause: str,
                                                          request: pytest.FixtureRequest) -> None:
    """Refused by the launch plan's check before any engine starts (the engine's own cause used to surface ~20 s
    later): one line with the cause, not llama-server's usage text ("run with -h") or vLLM's pydantic link."""
    request.getfixturevalue("llama_install" if engine == "llama.cpp" else "vllm_install")
    request.getfixturevalue("demo_model")
    result = run_cli("serve", "--engine", engine, "--model", "demo", "--ctx", "1000000000", "--no-install",
                     timeout=600)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    error = next(line for line in result.stderr.splitlines() if line.startswith("switchyard: error:"))
    assert cause in error and "run with -h" not in error and "pydantic.dev" not in error, result.stderr
    assert "1000000000" in error or engine == "llama.cpp"
