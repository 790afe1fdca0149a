"""`switchyard calibrate` on this machine with the real llama-server, then `switchyard fit` using what it stored;
the per-accelerator-set correction arithmetic; the history migration; the Machine page's button."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.models import archs
from desktop.core.planning import calibration
from desktop.core.planning.fit import exact_bytes
from desktop.core.storage.history import MIGRATIONS, SCHEMA_VERSION, MemoryPoint, Store

SNAPSHOTS = Path(__file__).parent / "snapshots"


def _cli(*args: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SWITCHYARD_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_calibrate_stores_measured_components_and_the_next_fit_uses_them(tmp_path: Path,
                                                                         llama_install: Any) -> None:
    """Real llama-server, as the app launches it (repacking on): calibrate measures each component, and `fit`
    for the same model here then shows the measured numbers, not the formula's; `--no-history` shows the formula."""
    model = archs.ensure_arch("qwen3").gguf_paths["F16"]
    home = tmp_path / "home"
    done = _cli("calibrate", "--engine", "llama.cpp", "--model", str(model), "--json", home=home)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["results"][0]
    assert found["started"] and "-v" in found["argv"]
    parts = found["components"]
    # what the engine itself reported: a repacked copy of the F16 weights where this CPU's AMX kernels take them
    # (an AMX host, unless its kernels fault there and the build runs with --no-repack), none elsewhere
    repacked = any(re.search(r"\b(AMX|CPU_REPACK) model buffer size", line) for line in found["lines"])
    expected = {"weights", "kv_cache", "compute", "total"} | ({"repacked"} if repacked else set())
    assert set(parts) == expected, found["lines"]
    assert all(row["measured_bytes"] > 0 and row["predicted_bytes"] > 0 for row in parts.values())
    with Store(home / "history.sqlite3") as store:
        points = store.memory_points(found["accelerators"], "llama.cpp")
    assert {p.component for p in points} == expected
    assert all(p.source == "calibrate" for p in points)

    plain = _cli("fit", str(model), "--ctx", "1024", "--no-history", "--json", home=home)
    fixed = _cli("fit", str(model), "--ctx", "1024", "--json", home=home)
    assert plain.returncode == 0 and fixed.returncode == 0, (plain.stderr, fixed.stderr)
    before, after = json.loads(plain.stdout), json.loads(fixed.stdout)
    measured_total = sum(row["measured_bytes"] for k, row in parts.items() if k != "total")
    predicted_total = sum(row["predicted_bytes"] for k, row in parts.items() if k != "total")
    # the fit adds llama-server's host-RAM prompt cache (--cache-ram, MiB) to what calibrate measures at load
    for shown in (before, after):
        assert shown["breakdown"]["prompt_cache"] == pytest.approx(shown["settings"]["cache_ram_mib"] / 1024, abs=1e-3)
    before_at_load = before["total_gib"] - before["breakdown"]["prompt_cache"]
    after_at_load = after["total_gib"] - after["breakdown"]["prompt_cache"]
    assert before_at_load == pytest.approx(predicted_total / GIB, abs=2e-3)
    assert not any("calibrate" in note for note in before["notes"])
    # the same plan as the calibration launch: the corrected fit is what the engine measured
    assert after_at_load == pytest.approx(measured_total / GIB, abs=2e-3)
    assert any("switchyard calibrate" in note for note in after["notes"])
    assert after["breakdown"]["predicted.weights"] == pytest.approx(parts["weights"]["predicted_bytes"])
    text = _cli("calibrate", "--engine", "llama.cpp", "--model", str(model), home=home)
    assert "predicted MiB" in text.stdout and "measured MiB" in text.stdout and "weights" in text.stdout
    # what a GPU-less probe cannot measure is said, and only where there is no GPU
    from desktop.core.machine.hardware import detect

    gpu_less = not detect().gpus
    assert ("measured only on a GPU" in found.get("gpu_only", "")) == gpu_less
    assert ("measured only on a GPU (none here)" in text.stdout) == gpu_less


@pytest.mark.engine
@pytest.mark.llamacpp
def test_fit_engine_check_shows_llama_servers_own_fit(tmp_path: Path, llama_install: Any) -> None:
    model = archs.ensure_arch("llama3").gguf_paths["Q8_0"]
    done = _cli("fit", str(model), "--ctx", "2048", "--parallel", "2", "--engine-check", "--no-history", "--json",
                home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)["engine_check"]
    opinion = check["engine_fit"]
    assert opinion["engine_mib"] > 0 and opinion["ours_mib"] > 0
    if abs(opinion["relative"]) > calibration.ENGINE_FIT_MARGIN:
        assert opinion["explanation"]  # a disagreement beyond the margin is explained
    assert any("projected to use" in line for line in check["lines"])
    text = _cli("fit", str(model), "--ctx", "2048", "--parallel", "2", "--engine-check", "--no-history",
                home=tmp_path / "home")
    assert "llama-server's own --fit projects" in text.stdout
    from desktop.core.machine.hardware import detect

    assert ("engine check: measured only on a GPU (none here)" in text.stdout) == (not detect().gpus)


def _result(total_bytes: float, available_gib: float) -> Any:
    from desktop.core.planning.fit import FitResult

    third = total_bytes / 3
    return FitResult("llama.cpp", "yes", third / GIB, third / GIB, third / GIB, total_bytes / GIB, available_gib,
                     available_gib - total_bytes / GIB, "CPU", 1024,
                     breakdown={"bytes.weights": third, "bytes.kv_cache": third, "bytes.compute": third})


def test_corrections_are_per_accelerator_set_and_can_flip_the_verdict(tmp_path: Path) -> None:
    cpu = HardwareSnapshot.from_json((SNAPSHOTS / "cpu_laptop.json").read_text())
    gpu = HardwareSnapshot.from_json((SNAPSHOTS / "rtx4090.json").read_text())
    assert calibration.accelerator_set(cpu).startswith("cpu:")
    assert "4090" in calibration.accelerator_set(gpu)
    renamed = replace(gpu, label="another-host", os="another OS")
    assert calibration.accelerator_set(renamed) == calibration.accelerator_set(gpu)  # not the host name
    with Store(tmp_path / "h.sqlite3") as store:
        key = calibration.accelerator_set(cpu)
        store.add_memory_points([MemoryPoint(key, "llama.cpp", "weights", 100.0, 200.0, "calibrate"),
                                 MemoryPoint(key, "llama.cpp", "compute", 100.0, 100.0, "launch")])
        found = calibration.corrections(store, cpu, "llama.cpp")
        assert found["weights"].ratio == pytest.approx(2.0) and found["compute"].ratio == pytest.approx(1.0)
        assert calibration.corrections(store, gpu, "llama.cpp") == {}  # another accelerator set: nothing
        result = _result(3 * GIB, available_gib=3.5)
        fixed = calibration.corrected(result, cpu, store)
    assert exact_bytes(fixed)["weights"] == pytest.approx(2 * GIB)
    assert fixed.total_gib == pytest.approx(4.0, abs=1e-3) and fixed.fits == "no"  # 4 GiB no longer fits in 3.5
    assert fixed.breakdown["predicted.weights"] == pytest.approx(GIB)
    assert any("weights x2.00" in note for note in fixed.notes)


def test_history_schema_4_adds_memory_points_and_upgrades_an_old_file(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    raw = sqlite3.connect(path)
    for statements in MIGRATIONS[:3]:
        for statement in statements:
            raw.execute(statement)
    raw.execute("PRAGMA user_version = 3")
    raw.execute("INSERT INTO runs (created_at, kind, machine) VALUES (1, 'launch', 'm')")
    raw.commit()
    raw.close()
    with Store(path) as store:
        assert store.schema_version == SCHEMA_VERSION >= 4  # upgraded through 4 (and any later migration)
        assert len(store.runs()) == 1  # nothing lost
        store.add_memory_points([MemoryPoint("cpu:x", "vllm", "kv_tokens", 10.0, 11.0, "launch", run_id=1,
                                             settings={"ctx_per_request": 1024})])
        (point,) = store.memory_points("cpu:x")
    assert (point.engine, point.component, point.measured_bytes, point.run_id) == ("vllm", "kv_tokens", 11.0, 1)
    assert point.settings == {"ctx_per_request": 1024}


def test_machine_page_calibrate_button_shows_the_lines(qtbot: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from PySide6.QtCore import Qt

    from desktop.ui.pages import machine

    monkeypatch.setattr(machine, "calibrate_engines",
                        lambda: [["llama.cpp 1 on cpu:x: demo", "  weights  1.00  2.00  2.000"]])
    page = machine.MachinePage()
    qtbot.addWidget(page)
    qtbot.mouseClick(page.calibrate_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "weights" in page.calibration_label.text(), timeout=10000)
    assert page.calibrate_button.isEnabled()
    page.shutdown()


@pytest.mark.engine
@pytest.mark.llamacpp
def test_a_launch_that_prints_memory_lines_records_calibration_points(tmp_path: Path, llama_install: Any) -> None:
    """Every launch the app records also stores the engine's own memory lines (here a plan whose extra args turn
    llama-server's -v on) as calibration points for this accelerator set, next to the fit's prediction."""
    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import LaunchPlan
    from desktop.core.machine.hardware import detect
    from desktop.core.runtime.launches import record_launch
    from desktop.core.runtime.supervisor import EngineProcess

    model = archs.ensure_arch("llama3").gguf_paths["Q4_K_M"]
    plan = LaunchPlan("llama.cpp", model, ctx_per_request=1024, slots=1, extra_args=("-v", "--no-repack"))
    with EngineProcess(get_adapter("llama.cpp"), plan, llama_install, log_dir=tmp_path) as process:
        process.start()
        process.wait_ready(timeout=300)
        with Store(tmp_path / "h.sqlite3") as store:
            run = record_launch(process, str(model), store=store)
            assert run is not None
            record = store.get_run(run)
            points = store.memory_points(calibration.accelerator_set(detect(), "llama.cpp"), "llama.cpp")
    assert record is not None and record.summary["load_memory"]["engine_report"]["weights_gib"] > 0
    assert {p.component for p in points} == {"weights", "kv_cache", "compute", "total"}
    assert all(p.source == "launch" and p.run_id == run for p in points)
    weights = next(p for p in points if p.component == "weights")
    assert weights.measured_bytes == pytest.approx(weights.predicted_bytes, rel=0.01)  # --no-repack: the file


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    # one error line (and the CLI's hint line under it, saying what to do)
    assert lines[0].startswith("switchyard: error: ") and len(lines) <= 2, done.stderr
    assert len(lines) == 1 or lines[1].startswith("switchyard: hint: "), done.stderr
    return " ".join(lines)


def test_calibrate_bad_input_is_one_clear_line_and_starts_nothing(tmp_path: Path) -> None:
    """A missing file, a file that is no GGUF and a corrupt GGUF header are refused before any engine starts."""
    home = tmp_path / "home"
    missing = _one_error_line(_cli("calibrate", "--model", str(tmp_path / "nope.gguf"), home=home, timeout=120))
    assert "nope.gguf does not exist" in missing and "pass a .gguf file" in missing
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    assert "not a GGUF file" in _one_error_line(_cli("calibrate", "--engine", "llama.cpp", "--model", str(text),
                                                     home=home, timeout=120))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + os.urandom(256))
    assert "GGUF" in _one_error_line(_cli("calibrate", "--engine", "llama.cpp", "--model", str(corrupt), home=home,
                                          timeout=120))
    assert "unknown engine" in _one_error_line(_cli("calibrate", "--engine", "tgi", home=home, timeout=120)).lower()
    logs = home / "logs"
    assert not logs.exists() or not any(logs.iterdir())  # no engine was started: it would have left its log
