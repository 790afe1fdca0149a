"""The installer recipes agree with each other and with the app, without building anything (fast).

build.spec is executed for real against stand-ins for PyInstaller's build steps, so what it would hand
PyInstaller (plugins, resources, names, icons) is checked per platform; the Inno Setup script, the dmgbuild
settings, the .desktop entry and the .deb files are checked against installers/metadata.py; the uninstall hook
that all three installers call is run against real processes.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import psutil
import pytest

import desktop
from desktop import _frozen
from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import provision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "installers"))
import icon_formats  # noqa: E402
import metadata  # noqa: E402

META_DEFAULT = ROOT / "build" / "installer"
ISS = ROOT / "installers" / "windows" / "switchyard.iss"
DESKTOP_ENTRY = ROOT / "resources" / "switchyard.desktop"

PLUGINS_BY_PLATFORM = {
    "linux": ["platforms/libqxcb.so", "platforms/libqwayland.so", "platforms/libqoffscreen.so",
              "platforms/libqeglfs.so", "platforms/libqvnc.so", "platforms/libqlinuxfb.so",
              "platformthemes/libqgtk3.so", "platformthemes/libqxdgdesktopportal.so",
              "egldeviceintegrations/libqeglfs-kms-integration.so", "iconengines/libqsvgicon.so"],
    "win32": ["platforms/qwindows.dll", "platforms/qoffscreen.dll", "platforms/qminimal.dll",
              "iconengines/qsvgicon.dll"],
    "darwin": ["platforms/libqcocoa.dylib", "platforms/libqoffscreen.dylib", "platforms/libqminimal.dylib",
               "iconengines/libqsvgicon.dylib"],
}


# --- build.spec, run against stand-ins -------------------------------------------------------------------------
class Recorder:
    """Stands in for one of PyInstaller's spec-file classes: records its arguments."""

    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]]

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, *args: Any, **kwargs: Any) -> types.SimpleNamespace:
        Recorder.calls.append((self.kind, args, kwargs))
        return types.SimpleNamespace(kind=self.kind, args=args, kwargs=kwargs)


def run_spec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, platform: str, plugins: list[str] | None = None,
             libraries: dict[str, set[str]] | None = None) -> dict[str, Any]:
    """Execute build.spec as PyInstaller would on `platform`; return its namespace and the recorded calls.
    `libraries` maps a collected library (and a plugin's file name) to the libraries it links."""
    links = libraries or {}
    plugin_paths = PLUGINS_BY_PLATFORM[platform] if plugins is None else plugins
    analysis_binaries = [(f"PySide6/Qt/plugins/{rel}", f"/src/{Path(rel).name}", "BINARY") for rel in plugin_paths]
    analysis_binaries += [(f"PySide6/Qt/lib/{name}", f"/src/{name}", "BINARY") for name in links
                          if not name.startswith("libq")]
    analysis_datas = [("PySide6/Qt/translations/qtbase_de.qm", "/src/qtbase_de.qm", "DATA"),
                      ("resources/icons/switchyard.svg", str(ROOT / "resources/icons/switchyard.svg"), "DATA")]
    analysis_datas += [(name, f"PySide6/Qt/lib/{name}", "SYMLINK") for name in links if not name.startswith("libq")]

    def analysis(scripts: list[str], **kwargs: Any) -> types.SimpleNamespace:
        Recorder.calls.append(("Analysis", (scripts,), kwargs))
        return types.SimpleNamespace(binaries=list(analysis_binaries), datas=list(analysis_datas),
                                     pure=[], scripts=scripts)

    hooks = types.ModuleType("PyInstaller.utils.hooks")
    hooks.collect_submodules = lambda package, filter=None: [f"{package}.cli"]  # type: ignore[attr-defined]
    bindepend = types.ModuleType("PyInstaller.depend.bindepend")
    bindepend.get_imports = lambda filename: {  # type: ignore[attr-defined]
        (name, f"/src/{name}") for name in links.get(Path(filename).name, set())}
    for name, module in {"PyInstaller": types.ModuleType("PyInstaller"),
                         "PyInstaller.utils": types.ModuleType("PyInstaller.utils"),
                         "PyInstaller.utils.hooks": hooks,
                         "PyInstaller.depend": types.ModuleType("PyInstaller.depend"),
                         "PyInstaller.depend.bindepend": bindepend}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("SWITCHYARD_INSTALLER_META", str(tmp_path / "meta"))
    Recorder.calls = []
    namespace: dict[str, Any] = {
        "SPECPATH": str(ROOT), "__file__": str(ROOT / "build.spec"), "__name__": "__main__",
        "Analysis": analysis, "PYZ": Recorder("PYZ"), "EXE": Recorder("EXE"), "COLLECT": Recorder("COLLECT"),
        "BUNDLE": Recorder("BUNDLE"),
    }
    code = compile((ROOT / "build.spec").read_text(encoding="utf-8"), str(ROOT / "build.spec"), "exec")
    exec(code, namespace)  # noqa: S102 - our own build recipe
    namespace["calls"] = list(Recorder.calls)
    return namespace


def calls_of(spec: dict[str, Any], kind: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return [(args, kwargs) for name, args, kwargs in spec["calls"] if name == kind]


def kept_plugins(spec: dict[str, Any]) -> set[str]:
    return {entry[0].split("plugins/", 1)[1] for entry in spec["a"].binaries if "plugins/" in entry[0]}


def test_build_spec_compiles_as_python() -> None:
    compile((ROOT / "build.spec").read_text(encoding="utf-8"), "build.spec", "exec")


@pytest.mark.parametrize("platform, wanted", [
    ("linux", {"platforms/libqxcb.so", "platforms/libqwayland.so", "platforms/libqoffscreen.so"}),
    ("win32", {"platforms/qwindows.dll", "platforms/qoffscreen.dll"}),
    ("darwin", {"platforms/libqcocoa.dylib", "platforms/libqoffscreen.dylib"}),
])
def test_build_spec_keeps_the_platform_plugins_the_app_needs_and_drops_the_rest(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, platform: str, wanted: set[str]) -> None:
    spec = run_spec(monkeypatch, tmp_path, platform)
    kept = kept_plugins(spec)
    assert {p for p in kept if p.startswith("platforms/")} == wanted
    assert not any(p.startswith(("egldeviceintegrations/", "platformthemes/libqgtk3")) for p in kept)
    assert any(p.startswith("iconengines/") for p in kept), "the SVG icon engine draws the app's icons"
    assert not any(entry[0].endswith(".qm") for entry in spec["a"].datas)


def test_build_spec_drops_libraries_only_dropped_plugins_needed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    links = {
        "libqeglfs.so": {"libQt6EglFSDeviceIntegration.so.6", "libQt6Gui.so.6"},
        "libqxcb.so": {"libQt6XcbQpa.so.6", "libQt6Gui.so.6"},
        "libQt6EglFSDeviceIntegration.so.6": {"libQt6Gui.so.6"},
        "libQt6XcbQpa.so.6": {"libQt6Gui.so.6"},
        "libQt6Gui.so.6": set(),
    }
    spec = run_spec(monkeypatch, tmp_path, "linux", libraries=links)
    kept = {Path(entry[0]).name for entry in spec["a"].binaries}
    assert {"libQt6XcbQpa.so.6", "libQt6Gui.so.6"} <= kept
    assert "libQt6EglFSDeviceIntegration.so.6" not in kept
    symlinks = {entry[0] for entry in spec["a"].datas if entry[2] == "SYMLINK"}
    assert symlinks == {"libQt6XcbQpa.so.6", "libQt6Gui.so.6"}, "no symlink may point at a dropped library"


def test_build_spec_fails_when_a_needed_platform_plugin_is_missing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="offscreen"):
        run_spec(monkeypatch, tmp_path, "linux", ["platforms/libqxcb.so", "platforms/libqwayland.so"])


def test_build_spec_bundles_every_resource_file_and_all_command_modules(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = run_spec(monkeypatch, tmp_path, "linux")
    [((scripts,), kwargs)] = calls_of(spec, "Analysis")
    assert scripts == [str(ROOT / "desktop" / "_frozen.py")]
    bundled = {(Path(src).relative_to(ROOT).as_posix(), dest) for src, dest in kwargs["datas"]}
    for path in (ROOT / "resources").rglob("*"):
        if path.is_file() and path.suffix in {".svg", ".png", ".qss"}:
            rel = path.relative_to(ROOT)
            assert (rel.as_posix(), rel.parent.as_posix()) in bundled, f"{rel} is not bundled"
    assert kwargs["hiddenimports"] == ["desktop.cli"]  # collect_submodules("desktop") is what fills it
    for module in ("PySide6.QtWebEngineCore", "PySide6.Qt3DCore", "PySide6.QtMultimedia", "PySide6.QtQml"):
        assert module in kwargs["excludes"]
    for module in ("PySide6.QtCore", "PySide6.QtGui", "PySide6.QtWidgets", "PySide6.QtSvg"):
        assert module not in kwargs["excludes"]


def test_build_spec_names_icons_and_version_per_platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    version = metadata.read_version()
    linux = run_spec(monkeypatch, tmp_path, "linux")
    assert [kw["name"] for _a, kw in calls_of(linux, "EXE")] == ["switchyard"]
    assert [kw["name"] for _a, kw in calls_of(linux, "COLLECT")] == ["switchyard"]
    assert calls_of(linux, "BUNDLE") == []

    windows = run_spec(monkeypatch, tmp_path, "win32")
    exes = {kw["name"]: kw for _a, kw in calls_of(windows, "EXE")}
    assert set(exes) == {"switchyard", "SwitchyardApp"}
    assert exes["switchyard"]["console"] and not exes["SwitchyardApp"]["console"]
    assert {kw["icon"] for kw in exes.values()} == {str(tmp_path / "meta" / "switchyard.ico")}
    assert (tmp_path / "meta" / "version.iss").read_text() == f'#define AppVersion "{version}"\n'

    mac = run_spec(monkeypatch, tmp_path, "darwin")
    [(_args, bundle)] = calls_of(mac, "BUNDLE")
    assert bundle["name"] == "Switchyard.app" and bundle["version"] == version
    assert bundle["bundle_identifier"] == metadata.BUNDLE_ID
    assert bundle["icon"] == str(tmp_path / "meta" / "switchyard.icns")
    assert bundle["info_plist"]["CFBundleShortVersionString"] == version


# --- icons ---------------------------------------------------------------------------------------------------
def test_windows_and_macos_icons_carry_the_apps_own_pngs(tmp_path: Path) -> None:
    pngs = icon_formats.app_pngs(metadata.ICONS_DIR)
    assert {16, 32, 48, 256, 512} <= set(pngs)
    ico_path, icns_path = icon_formats.write_platform_icons(metadata.ICONS_DIR, tmp_path)

    ico = ico_path.read_bytes()
    reserved, kind, count = struct.unpack("<HHH", ico[:6])
    assert (reserved, kind) == (0, 1) and count == len([s for s in pngs if s <= 256])
    for index in range(count):
        width, height, _c, _r, planes, bits, length, offset = struct.unpack(
            "<BBBBHHII", ico[6 + 16 * index: 22 + 16 * index])
        size = width or 256
        assert (height or 256) == size and (planes, bits) == (1, 32)
        assert ico[offset:offset + length] == pngs[size]

    icns = icns_path.read_bytes()
    assert icns[:4] == b"icns" and struct.unpack(">I", icns[4:8])[0] == len(icns)
    position, found = 8, {}
    while position < len(icns):
        kind_code, length = icns[position:position + 4], struct.unpack(">I", icns[position + 4:position + 8])[0]
        found[kind_code] = icns[position + 8:position + length]
        position += length
    assert found[b"ic09"] == pngs[512] and found[b"ic07"] == pngs[128] and found[b"icp4"] == pngs[16]
    assert all(icon_formats.png_size(data)[0] in pngs for data in found.values())


# --- the Linux package ---------------------------------------------------------------------------------------
def test_desktop_entry_names_the_app_command_and_icon() -> None:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(DESKTOP_ENTRY, encoding="utf-8")
    entry = parser["Desktop Entry"]
    assert entry["Type"] == "Application"
    assert entry["Name"] == metadata.APP_NAME
    assert entry["Exec"].split()[0] == metadata.EXE_NAME
    assert entry["Icon"] == metadata.EXE_NAME
    assert entry["Terminal"] == "false"
    assert entry["Categories"].endswith(";")
    assert (metadata.ICONS_DIR / "256x256" / f"{metadata.EXE_NAME}.png").is_file()


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None,
                    reason="desktop-file-validate not installed (apt-get install desktop-file-utils)")
def test_desktop_entry_passes_desktop_file_validate() -> None:
    result = subprocess.run(["desktop-file-validate", str(DESKTOP_ENTRY)], capture_output=True, text=True,
                            check=False)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert result.returncode == 0 and not errors, result.stdout + result.stderr


def test_deb_recipe_installs_to_opt_links_the_command_and_stops_engines_first() -> None:
    script = (ROOT / "scripts" / "build-installer-linux.sh").read_text(encoding="utf-8")
    assert 'cp -a dist/switchyard "$stage/opt/$package"' in script
    assert 'ln -s "/opt/$package/switchyard" "$stage/usr/bin/switchyard"' in script
    assert "resources/switchyard.desktop" in script and "hicolor" in script
    assert "installers/metadata.py" in script  # the package version is desktop/__init__.py's
    control = (ROOT / "installers" / "linux" / "control.in").read_text(encoding="utf-8")
    assert re.search(r"^Package: @PACKAGE@$", control, re.M) and re.search(r"^Version: @VERSION@$", control, re.M)
    prerm = ROOT / "installers" / "linux" / "prerm"
    assert f"/opt/switchyard/switchyard {metadata.UNINSTALL_FLAG} --all-users" in prerm.read_text()
    assert "install -m 0755 installers/linux/prerm" in script
    for shell_script in (prerm, ROOT / "scripts" / "build-installer-linux.sh",
                         ROOT / "scripts" / "smoke-linux-installer.sh"):
        subprocess.run(["bash", "-n", str(shell_script)], check=True)


# --- Windows and macOS recipes agree with the Linux one --------------------------------------------------------
def iss_defines() -> dict[str, str]:
    return dict(re.findall(r'^#define (\w+) "([^"]*)"', ISS.read_text(encoding="utf-8"), re.M))


def iss_setup() -> dict[str, str]:
    section = ISS.read_text(encoding="utf-8").split("[Setup]", 1)[1].split("\n[", 1)[0]
    return dict(line.split("=", 1) for line in section.splitlines() if "=" in line and not line.startswith(";"))


def test_inno_setup_script_matches_the_bundle_name_version_icon_and_uninstall() -> None:
    text = ISS.read_text(encoding="utf-8")
    defines, setup = iss_defines(), iss_setup()
    windows_dir = ISS.parent
    assert defines["AppName"] == metadata.APP_NAME
    assert defines["AppExe"] == f"{metadata.APP_NAME}App.exe"  # build.spec's windowed EXE
    assert defines["CliExe"] == f"{metadata.EXE_NAME}.exe"
    assert setup["AppId"] == metadata.WINDOWS_APP_ID
    assert setup["AppVersion"] == "{#AppVersion}" and setup["AppPublisher"] == metadata.PUBLISHER
    include = re.search(r'^#include "([^"]+)"', text, re.M)
    assert include is not None
    assert (windows_dir / include.group(1).replace("\\", "/")).resolve() == META_DEFAULT / "version.iss"
    assert (windows_dir / setup["SetupIconFile"].replace("\\", "/")).resolve() == META_DEFAULT / "switchyard.ico"
    source = re.search(r'^Source: "([^"]+)"', text, re.M)
    assert source is not None
    assert (windows_dir / source.group(1).replace("\\", "/")).resolve().parent == ROOT / "dist" / metadata.EXE_NAME
    assert re.search(r'^Name: "\{group\}\\\{#AppName\}"; Filename: "\{app\}\\\{#AppExe\}"', text, re.M)
    uninstall = text.split("[UninstallRun]", 1)[1].split("\n[", 1)[0]
    assert f'Filename: "{{app}}\\{{#CliExe}}"; Parameters: "{metadata.UNINSTALL_FLAG}"' in uninstall
    assert "waituntilterminated" in uninstall


def test_dmg_settings_match_the_bundle_name_version_icon_and_uninstall() -> None:
    settings: dict[str, Any] = {"defines": {"root": str(ROOT)}}
    path = ROOT / "installers" / "macos" / "dmg_settings.py"
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), settings)  # noqa: S102 - as dmgbuild does
    version = metadata.read_version()
    assert settings["volume_name"] == f"{metadata.APP_NAME} {version}"
    assert settings["filename"] == str(ROOT / "dist" / f"{metadata.APP_NAME}-{version}.dmg")
    assert settings["files"][0] == str(ROOT / "dist" / f"{metadata.APP_NAME}.app")  # build.spec's BUNDLE
    assert settings["icon"] == str(META_DEFAULT / "switchyard.icns")
    assert settings["symlinks"] == {"Applications": "/Applications"}
    assert set(settings["icon_locations"]) == {Path(f).name for f in settings["files"]} | {"Applications"}
    uninstaller = Path(settings["files"][1])
    assert os.access(uninstaller, os.X_OK)
    assert f'Contents/MacOS/{metadata.EXE_NAME}" {metadata.UNINSTALL_FLAG}' in uninstaller.read_text()


def test_every_recipe_reads_the_apps_version() -> None:
    assert metadata.read_version() == desktop.__version__
    assert metadata.APP_NAME == desktop.APP_NAME
    assert metadata.UNINSTALL_FLAG == _frozen.STOP_ENGINES_FLAG


# --- the uninstall hook and the frozen-app fixes -----------------------------------------------------------------
def spawn_engine(run_dir: Path, **popen: Any) -> subprocess.Popen[bytes]:
    """A stand-in engine: `sleep` copied into the engines folder beside `run_dir`, in its own session."""
    program = run_dir.parent / "engines" / "llama.cpp" / "bin" / "llama-server"
    if not program.exists():
        program.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(shutil.which("sleep") or "/bin/sleep", program)
    return subprocess.Popen([str(program), "60"], start_new_session=True, **popen)  # noqa: S603


def write_pidfile(run_dir: Path, pid: int, created: float | None, owner_pid: int = 0,
                  owner_created: float | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"engine-{pid}.json"
    path.write_text(json.dumps({"pid": pid, "created": created, "owner_pid": owner_pid,
                                "owner_created": owner_created, "engine": "llama.cpp", "port": 1}))
    return path


def test_uninstall_hook_stops_orphaned_engines_and_spares_others(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    orphan, supervised, reused = spawn_engine(run_dir), spawn_engine(run_dir), spawn_engine(run_dir)
    try:
        orphan_file = write_pidfile(run_dir, orphan.pid, psutil.Process(orphan.pid).create_time())
        me = psutil.Process()
        supervised_file = write_pidfile(run_dir, supervised.pid, psutil.Process(supervised.pid).create_time(),
                                        owner_pid=os.getppid() or 1,
                                        owner_created=psutil.Process(os.getppid() or 1).create_time())
        reused_file = write_pidfile(run_dir, reused.pid, me.create_time() - 1000)  # pid now someone else's
        garbage = run_dir / "engine-1.json"
        garbage.write_text("{not json")

        stopped = _frozen.stop_recorded_engines([run_dir], grace=5.0)

        assert [item.pid for item in stopped] == [orphan.pid]
        assert orphan.wait(timeout=10) is not None
        assert not orphan_file.exists() and not garbage.exists()
        assert supervised.poll() is None and supervised_file.exists(), "a live owner elsewhere keeps its engine"
        assert reused.poll() is None and not reused_file.exists(), "a reused pid is never killed"
        assert stopped[0].to_json()["engine"] == "llama.cpp"
    finally:
        for proc in (orphan, supervised, reused):
            proc.kill()
            proc.wait()


def test_uninstall_flag_runs_the_hook_on_this_users_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path))
    engine = spawn_engine(tmp_path / "run")
    try:
        write_pidfile(tmp_path / "run", engine.pid, psutil.Process(engine.pid).create_time())
        assert _frozen.main([_frozen.STOP_ENGINES_FLAG]) == 0
        assert engine.wait(timeout=10) is not None
        assert "1 running engine(s) stopped" in capsys.readouterr().out
    finally:
        engine.kill()
        engine.wait()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")
def test_uninstall_hook_spares_a_process_that_runs_no_engine_of_this_user(tmp_path: Path) -> None:
    """A pidfile naming some other program of the same user (its pid and start time right) stops nothing."""
    run_dir = tmp_path / "run"
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # noqa: S607 - not in the engines folder
    try:
        pidfile = write_pidfile(run_dir, other.pid, psutil.Process(other.pid).create_time())
        assert _frozen.stop_recorded_engines([run_dir], grace=1.0) == []
        assert other.poll() is None and not pidfile.exists()
    finally:
        other.kill()
        other.wait()


def _another_user() -> tuple[int, int]:
    import pwd

    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user here")
    return entry.pw_uid, entry.pw_gid


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX users")
def test_uninstall_hook_as_root_does_nothing_to_another_users_process() -> None:
    """The .deb's prerm runs as root over every user's pidfiles: a pidfile naming another user's process (even one
    that runs from the engines folder) must not get it killed, nor its group."""
    import tempfile

    uid, gid = _another_user()
    base = Path(tempfile.mkdtemp(prefix="switchyard-uninstall-"))  # readable by the other user, unlike tmp_path
    try:
        base.chmod(0o755)
        run_dir = base / "run"
        victim = spawn_engine(run_dir, user=uid, group=gid, extra_groups=[])
        try:
            assert psutil.Process(victim.pid).uids().real == uid
            record = write_pidfile(run_dir, victim.pid, psutil.Process(victim.pid).create_time())
            json_record = json.loads(record.read_text())
            record.write_text(json.dumps({**json_record, "pgid": victim.pid}))
            assert _frozen.stop_recorded_engines([run_dir], grace=1.0) == []
            assert victim.poll() is None, "another user's process was signalled"
        finally:
            victim.kill()
            victim.wait()
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX users")
def test_uninstall_hook_ignores_a_pidfile_another_user_wrote(tmp_path: Path) -> None:
    """A pidfile not owned by the user whose run folder holds it (planted there) is neither trusted nor removed."""
    uid, _gid = _another_user()
    run_dir = tmp_path / "run"
    engine = spawn_engine(run_dir)
    try:
        pidfile = write_pidfile(run_dir, engine.pid, psutil.Process(engine.pid).create_time())
        os.chown(pidfile, uid, -1)
        assert _frozen.stop_recorded_engines([run_dir], grace=1.0) == []
        assert engine.poll() is None and pidfile.exists()
    finally:
        engine.kill()
        engine.wait()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX user database")
def test_all_users_sweeps_each_local_users_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pwd

    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "mine"))
    alice, bob = tmp_path / "alice", tmp_path / "bob"
    (alice / ".local/share/switchyard/run").mkdir(parents=True)
    bob.mkdir()
    users = [types.SimpleNamespace(pw_dir=str(alice)), types.SimpleNamespace(pw_dir=str(bob))]
    monkeypatch.setattr(pwd, "getpwall", lambda: users)
    assert _frozen.default_run_dirs(all_users=False) == [tmp_path / "mine" / "run"]
    assert _frozen.default_run_dirs(all_users=True) == [tmp_path / "mine" / "run",
                                                        alice / ".local/share/switchyard/run"]


def test_frozen_app_gives_children_the_users_library_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/switchyard/_internal")
    monkeypatch.setenv("LD_LIBRARY_PATH_ORIG", "/usr/local/cuda/lib64")
    _frozen.restore_child_environment()  # not frozen: nothing changes
    assert os.environ["LD_LIBRARY_PATH"] == "/opt/switchyard/_internal"

    monkeypatch.setattr(sys, "frozen", True, raising=False)
    _frozen.restore_child_environment()
    assert os.environ["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64" and "LD_LIBRARY_PATH_ORIG" not in os.environ
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/switchyard/_internal")
    _frozen.restore_child_environment()
    assert "LD_LIBRARY_PATH" not in os.environ


def test_frozen_app_provisions_engines_with_a_system_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWITCHYARD_BASE_PYTHON", raising=False)
    assert provision.python_executable() == sys.executable
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert provision.python_executable() == str(fake)
    monkeypatch.setenv("SWITCHYARD_BASE_PYTHON", "/custom/python")
    assert provision.python_executable() == "/custom/python"
    monkeypatch.delenv("SWITCHYARD_BASE_PYTHON")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SwitchyardError, match="Python 3"):
        provision.python_executable()


def test_self_command_runs_the_cli_from_a_checkout_and_names_the_bundle_when_frozen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    result = subprocess.run([*_frozen.self_command(), "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"switchyard {desktop.__version__}"
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert _frozen.self_command() == [sys.executable]
