"""Issue 71: a llama.cpp build whose repacked CPU kernels fault on this machine (an AMX guest: SIGILL, or SIGSEGV,
at the first multiply of a quantized weight; shared/reference/review/amx-host.md) is found once by the kernel
probe (`engines doctor`, `engines install`) and avoided by every path from then on; where it was never probed,
the first start of any path retries at once with --no-repack and every later start of the build begins with it.

The fault is made deterministic on any CPU by stand-in binaries in front of the real llama.cpp tools: a
`llama-server` and a `llama-perplexity` that, given a quantized GGUF without --no-repack, print the load's warm-up
line and kill themselves with the signal, as build 11434 does on that host; otherwise (an F32/F16 file, or
--no-repack) they exec the real tool, which serves or scores for real. Each test runs the real CLI on a fresh home
with a model never started there. Expected values come from the stand-ins' own count of the starts they killed and
from the real engine's report of the launch it made (its argv, its memory lines), not from the code under test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from desktop.core.engines import kernels
from desktop.core.engines.base import EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import NO_REPACK, LlamaCppAdapter
from desktop.core.machine.hardware import HardwareSnapshot, this_cpu
from desktop.core.runtime import kernelprobe
from desktop.core.runtime.ports import find_free_port

HERE = Path(__file__).parent
CPU_LAPTOP = HardwareSnapshot.load(HERE / "snapshots" / "cpu_laptop.json")
WARM_UP = "common_init_from_params: warming up the model with an empty run - please wait ... (--no-warmup to disable)"

# The stand-in: a quantized file without --no-repack dies at the warm-up, the rest is the real tool.
FAULT_SCRIPT = '''
import os, resource, signal, struct, sys
argv = sys.argv[1:]
def file_type(path):
    # general.file_type from the GGUF header's key-value pairs, read until it comes (before the vocabulary)
    sizes = {{0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return None
        _version, _tensors, pairs = struct.unpack("<IQQ", f.read(20))
        for _ in range(pairs):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            kind = struct.unpack("<I", f.read(4))[0]
            if key == "general.file_type":
                return struct.unpack("<I", f.read(4))[0]
            if kind == 8:
                f.seek(struct.unpack("<Q", f.read(8))[0], 1)
            elif kind == 9:
                item, count = struct.unpack("<IQ", f.read(12))
                for _ in range(count if item == 8 else 0):
                    f.seek(struct.unpack("<Q", f.read(8))[0], 1)
                f.seek(0 if item == 8 else sizes[item] * count, 1)
            else:
                f.seek(sizes[kind], 1)
    return None
def quantized(path):
    return file_type(path) not in (None, 0, 1)  # F32, F16 serve
flag = "--model" if "--model" in argv else "-m" if "-m" in argv else None
model = argv[argv.index(flag) + 1] if flag else None
if model and "--no-repack" not in argv and quantized(model):
    with open({count!r}, "a") as handle:
        handle.write({name!r} + " " + os.path.basename(model) + "\\n")
    print("load_tensors: loading model tensors, this can take a while... (mmap = true)", flush=True)
    print({warm_up!r}, flush=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal({signum}, signal.SIG_DFL)
    os.kill(os.getpid(), {signum})
real = {real!r}
os.environ["LD_LIBRARY_PATH"] = os.path.dirname(real) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
os.execv(real, [real, *argv])
'''


def faulting_tools(folder: Path, install: EngineInstall, signum: int) -> tuple[Path, Path]:
    """Stand-in llama-server, llama-perplexity (both faulting) and llama-quantize (the real one) in `folder`;
    returns the server and the file counting the starts they killed."""
    folder.mkdir(parents=True, exist_ok=True)
    count = folder / "faults"
    real_bin = install.executable.parent
    for name in ("llama-server", "llama-perplexity", "llama-quantize"):
        script = folder / name
        text = FAULT_SCRIPT.format(count=str(count), name=name, warm_up=WARM_UP, signum=int(signum),
                                   real=str(real_bin / name))
        if name == "llama-quantize":  # quantizing multiplies nothing: never faults
            text = text.replace("if model and", "if False and")
        script.write_text(f"#!{sys.executable}\n{text}")
        script.chmod(0o755)
    return folder / "llama-server", count


def faults(count: Path) -> list[str]:
    return count.read_text().splitlines() if count.exists() else []


def cli(home: Path, server: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SWITCHYARD_HOME": str(home), "SWITCHYARD_LLAMA_SERVER": str(server)}
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, env=env, check=False)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quantized GGUF (llama.cpp repacks Q4_K on any AVX2 CPU, and AMX takes it) of a small Llama with experts,
    never started in a new home (a Q8_0 copy beside it). Small on purpose: the stand-in reads its header."""
    files = kernelprobe.probe_files(tmp_path_factory.mktemp("models"), ("Q4_K", "Q8_0"))
    q4 = files["Q4_K"].rename(files["Q4_K"].with_name("small-Q4_K_M.gguf"))
    files["Q8_0"].rename(files["Q8_0"].with_name("small-Q8_0.gguf"))
    return q4


# --- the probe ------------------------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.parametrize("signum", [signal.SIGILL, signal.SIGSEGV], ids=["SIGILL", "SIGSEGV"])
def test_doctor_probes_each_family_once_and_every_later_start_avoids_the_fault(
        tmp_path: Path, llama_install: EngineInstall, q4_k_m: Path, signum: int) -> None:
    server, count = faulting_tools(tmp_path / "bin", llama_install, signum)
    home = tmp_path / "home"
    done = cli(home, server, "engines", "doctor", "--json")
    findings = [f for f in json.loads(done.stdout) if f["check"] == "CPU kernels"]
    assert len(findings) == 1 and findings[0]["ok"], done.stdout + done.stderr
    detail = findings[0]["detail"]
    # every family faulted once with repacking on (the stand-in counted them), and served with --no-repack
    assert sorted(line.split()[1] for line in faults(count)) == sorted(
        f"probe-{family}.gguf" for family in kernelprobe.FAMILIES)
    assert all(family in detail for family in kernelprobe.FAMILIES) and NO_REPACK in detail, detail
    assert f"({signal.Signals(signum).name})" in detail, detail

    again = cli(home, server, "engines", "doctor", "--json")  # probed once per build and CPU: not again
    assert len(faults(count)) == len(kernelprobe.FAMILIES), again.stderr
    assert "probed" in next(f for f in json.loads(again.stdout) if f["check"] == "CPU kernels")["detail"]

    # the plan of a model never started here already avoids it, and its fit counts no repacked copy
    dry = cli(home, server, "serve", "--engine", "llama.cpp", "--model", str(q4_k_m), "--ctx", "512",
              "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    described = json.loads(dry.stdout)
    assert NO_REPACK in described["argv"], described["argv"]
    breakdown = described["fit"]["breakdown"]
    assert not breakdown.get("bytes.repacked") and not breakdown.get("repacked"), breakdown
    assert any(NO_REPACK in note for note in described["fit"]["notes"]), described["fit"]["notes"]

    # and the first real start serves without a fault
    prompt = cli(home, server, "serve", "--engine", "llama.cpp", "--model", str(q4_k_m), "--ctx", "512",
                 "--prompt", "Hello", "--max-tokens", "4")
    assert prompt.returncode == 0, prompt.stderr
    assert len(faults(count)) == len(kernelprobe.FAMILIES) and "again at once" not in prompt.stderr, prompt.stderr


# --- never probed: the first command of each path retries at once ---------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.parametrize("signum", [signal.SIGILL, signal.SIGSEGV], ids=["SIGILL", "SIGSEGV"])
def test_the_first_serve_prompt_on_a_fresh_home_retries_at_once_and_the_next_model_starts_avoiding(
        tmp_path: Path, llama_install: EngineInstall, q4_k_m: Path, demo_model: Any, signum: int) -> None:
    server, count = faulting_tools(tmp_path / "bin", llama_install, signum)
    home = tmp_path / "home"
    first = cli(home, server, "serve", "--engine", "llama.cpp", "--model", str(q4_k_m), "--ctx", "512",
                "--prompt", "Hello", "--max-tokens", "4", "--json")
    assert first.returncode == 0, first.stderr
    assert len(faults(count)) == 1, faults(count)
    notes = [line for line in first.stderr.splitlines() if line.startswith("note:") and "again at once" in line]
    assert len(notes) == 1 and NO_REPACK in notes[0] and "crashed while loading" in notes[0], first.stderr
    assert "Traceback" not in first.stderr and "start it again" not in first.stderr.replace("starting it again", "")
    # another quantized model on the same build starts with the lesson: no second fault
    q8 = q4_k_m.with_name(q4_k_m.name.replace("Q4_K_M", "Q8_0"))
    second = cli(home, server, "serve", "--engine", "llama.cpp", "--model", str(q8), "--ctx", "512",
                 "--prompt", "Hello", "--max-tokens", "4")
    assert second.returncode == 0 and len(faults(count)) == 1, second.stderr
    # an F32/F16 file never faulted, and still serves
    plain = cli(home, server, "serve", "--engine", "llama.cpp", "--model", str(demo_model.gguf_path), "--ctx", "512",
                "--prompt", "Hello", "--max-tokens", "4")
    assert plain.returncode == 0 and len(faults(count)) == 1, plain.stderr


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_first_plain_serve_on_a_fresh_home_serves_after_one_fault(
        tmp_path: Path, llama_install: EngineInstall, q4_k_m: Path) -> None:
    """A plain `serve` (the engine itself on TCP, a keyed port) is up after one fault; the engine's own argv has
    --no-repack and its own memory report shows no repacked buffer."""
    server, count = faulting_tools(tmp_path / "bin", llama_install, signal.SIGILL)
    home = tmp_path / "home"
    env = {**os.environ, "SWITCHYARD_HOME": str(home), "SWITCHYARD_LLAMA_SERVER": str(server)}
    proc = subprocess.Popen(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", "--engine", "llama.cpp", "--model", str(q4_k_m), "--ctx", "512",
         "--port", str(find_free_port())], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # ends at the child's exit
            lines.append(line)
            if line.startswith("ready:"):
                break
        assert lines and lines[-1].startswith("ready:"), "".join(lines)
        assert len(faults(count)) == 1 and sum("again at once" in line for line in lines) == 1, "".join(lines)
        logs = sorted((home / "logs").glob("llama.cpp-*.log"), key=lambda p: p.stat().st_mtime)
        served = logs[-1].read_text(errors="replace")
        assert "CPU_REPACK" not in served and "AMX model buffer" not in served, served[-2000:]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    # the lesson is the build's: the next plan of this model (or any) starts with it
    dry = cli(home, server, "serve", "--engine", "llama.cpp", "--model", str(q4_k_m), "--dry-run", "--json")
    assert NO_REPACK in json.loads(dry.stdout)["argv"], dry.stderr


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_first_quality_run_on_a_fresh_home_scores_after_llama_perplexity_faults(
        tmp_path: Path, llama_install: EngineInstall, demo_model: Any) -> None:
    """`quality demo --variants Q8_0`: the F32 reference scores as it is, the Q8_0 variant's llama-perplexity is
    killed once, run again with --no-repack and scored; the build keeps the lesson."""
    from desktop.core.measure.quality import SHIPPED_CORPUS

    server, count = faulting_tools(tmp_path / "bin", llama_install, signal.SIGILL)
    home = tmp_path / "home"
    short = tmp_path / "short.txt"  # the shipped corpus's start, 128-token chunks: a few seconds a pass
    short.write_text(SHIPPED_CORPUS.read_text()[:3000])
    scored = ("--prompts", str(short), "--ctx", "128", "--json")
    done = cli(home, server, "quality", "demo", "--variants", "Q8_0", *scored)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [line.split()[0] for line in faults(count)] == ["llama-perplexity"], faults(count)
    variants = report.get("variants") or report.get("report", {}).get("variants")
    assert variants and variants[0]["variant"] == "Q8_0" and variants[0]["mean_kld"] >= 0, report
    again = cli(home, server, "quality", "demo", "--variants", "Q8_0", *scored)
    assert again.returncode == 0 and len(faults(count)) == 1, again.stderr


# --- the record and the plan (no engine) ----------------------------------------------------------------------
def _version_script(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\nimport sys\nprint('version: 1 (stand-in)', file=sys.stderr)\n")
    binary.chmod(0o755)
    return binary


def test_the_planner_adds_the_lesson_for_this_cpu_only_and_a_rebuilt_binary_learns_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_model: Any) -> None:
    from desktop.core.machine.hardware import detect
    from desktop.core.planning.planner import plan_launch

    binary = _version_script(tmp_path)
    monkeypatch.setenv("SWITCHYARD_LLAMA_SERVER", str(binary))
    install = LlamaCppAdapter().find_install()
    assert install is not None and install.source == "configured"
    here = detect()
    assert NO_REPACK not in plan_launch("llama.cpp", "demo", here).plan.extra_args
    kernels.remember(install, (NO_REPACK,), "test: the repacked kernels fault here")
    checked = plan_launch("llama.cpp", "demo", here)
    assert checked.plan.extra_args.count(NO_REPACK) == 1
    assert any("test: the repacked kernels fault here" in note for note in checked.fit.notes)
    # a snapshot of another CPU (a recorded laptop) plans without this machine's lesson
    assert this_cpu() != CPU_LAPTOP.cpu
    assert NO_REPACK not in plan_launch("llama.cpp", "demo", CPU_LAPTOP).plan.extra_args
    # a person's own --no-repack is not doubled
    asked = plan_launch("llama.cpp", "demo", here, {"extra_args": ("--no-repack",)})
    assert asked.plan.extra_args.count(NO_REPACK) == 1
    # the binary rebuilt in place is another build: it starts without the lesson until it learns its own
    binary.write_text(binary.read_text() + "# rebuilt\n")
    os.utime(binary, (1, 1))
    assert kernels.avoidance(LlamaCppAdapter().find_install() or install) is None
    assert NO_REPACK not in plan_launch("llama.cpp", "demo", here).plan.extra_args


def test_a_segfault_at_the_warm_up_is_a_kernel_fault_and_one_while_reading_the_file_is_not() -> None:
    adapter = LlamaCppAdapter()
    plan = LaunchPlan(engine="llama.cpp", model_path=Path("m.gguf"))
    loading = ["llama_model_loader: loaded meta data with 30 key-value pairs",
               "load_tensors: loading model tensors, this can take a while... (mmap = true)"]
    told = adapter.crash_retry(-signal.SIGSEGV, [*loading, WARM_UP], plan)
    assert told is not None and told.args == (NO_REPACK,) and "signal 11" in told.why
    assert "first matrix multiply" in adapter.explain_failure(-signal.SIGSEGV, [*loading, WARM_UP]).reason
    assert adapter.crash_retry(-signal.SIGSEGV, loading, plan) is None  # while reading: a bad file, not a kernel
    assert adapter.crash_retry(-signal.SIGABRT, [*loading, WARM_UP], plan) is None  # an assert, not a fault
    assert adapter.crash_retry(-signal.SIGSEGV, [*loading, WARM_UP], LaunchPlan(
        engine="llama.cpp", model_path=Path("m.gguf"), extra_args=(NO_REPACK,))) is None  # once only


def test_an_unreadable_or_foreign_record_is_no_lesson(tmp_path: Path) -> None:
    binary = _version_script(tmp_path)
    install = EngineInstall("llama.cpp", "1", "cache", binary, root=tmp_path)
    path = kernels.record_path(install)
    assert path == tmp_path / kernels.RECORD_NAME
    path.write_text("{not json")
    assert kernels.avoidance(install) is None
    kernels.remember(install, (NO_REPACK,), "why")  # an unreadable record is replaced
    assert kernels.avoidance(install) == kernels.Avoidance((NO_REPACK,), "why", "crash")
    data = json.loads(path.read_text())
    for planted in (["rm -rf /"], ["--model", "/etc/shadow"], ["--no-repack", "--no-mmap"], ["--verbose"]):
        data["cpus"][kernels.cpu_key(this_cpu())]["avoid"]["args"] = planted  # no avoiding argument: ignored
        path.write_text(json.dumps(data))
        assert kernels.avoidance(install) is None, planted
    assert kernels.avoidance(install, CPU_LAPTOP.cpu) is None


@pytest.mark.engine
@pytest.mark.llamacpp
def test_a_probe_start_that_fails_without_a_fault_teaches_nothing_and_says_so(
        tmp_path: Path, llama_install: EngineInstall) -> None:
    """A quantized start that exits with an error (no signal: not a kernel's fault) is no lesson: doctor says the
    probe did not run, and nothing is recorded."""
    server, count = faulting_tools(tmp_path / "bin", llama_install, signal.SIGILL)
    server.write_text(server.read_text().replace("    os.kill(os.getpid(), ", "    sys.exit(1)  # ("))
    home = tmp_path / "home"
    done = cli(home, server, "engines", "doctor", "--json")
    finding = next(f for f in json.loads(done.stdout) if f["check"] == "CPU kernels")
    assert "not probed" in finding["detail"] and "kernel probe" in done.stderr, done.stderr
    # each family started once, none again with --no-repack, and nothing kept
    assert len(faults(count)) == len(kernelprobe.FAMILIES) and not list((home / "kernels").glob("*.json"))
