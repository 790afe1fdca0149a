"""Issue 60: nothing running as root follows a user's path, and no pid file is trusted blindly.

Other users are faked: `pwd.getpwall` lists temporary homes, and their folders, files and links are handed to
uid 4242 with chown (as root; no real account). Each test here failed on 7638391: a pid file with `"created":
NaN` got a live program reaped (and `stop` signalled any pid a discovery file named), the root uninstaller
followed a user's run-folder link into root's folder and a user's engines link to `/`, and unlinked through a
folder swapped for a link between its check and its unlink.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from desktop import _frozen
from desktop.core.common import paths
from desktop.core.runtime.supervisor import reap_orphans

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes, users and links")
FAKE_UID = 4242
SLEEP = shutil.which("sleep") or "/bin/sleep"


def _program_in(folder: Path) -> Path:
    """`sleep` copied to `folder`/bin/llama-server: a stand-in engine binary there."""
    program = folder / "bin" / "llama-server"
    program.parent.mkdir(parents=True, exist_ok=True)
    if not program.exists():
        shutil.copy2(SLEEP, program)
    return program


@pytest.fixture
def live_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[bytes]]:
    """A live process running from this user's engines folder (a temporary one, not the shared engines cache):
    what a pid file could name to get it killed."""
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(tmp_path / "engines"))
    proc = subprocess.Popen([str(_program_in(paths.engines_dir() / "stand-in")), "600"],  # noqa: S603
                            start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _record(proc: subprocess.Popen[bytes], **fields: Any) -> dict[str, Any]:
    """What the supervisor writes for `proc`, its owner gone, with `fields` changed."""
    return {"pid": proc.pid, "created": psutil.Process(proc.pid).create_time(), "pgid": proc.pid,
            "owner_pid": 0, "owner_created": None, "engine": "llama.cpp", "port": 1,
            "program": psutil.Process(proc.pid).exe(), **fields}


NAN, INF = float("nan"), float("inf")
BAD_FIELDS: list[dict[str, Any]] = [
    {"created": NAN}, {"created": INF}, {"created": -INF}, {"created": -5.0}, {"created": 1e300},
    {"pid": -1}, {"pid": 0}, {"pid": 1}, {"pid": 2 ** 40}, {"pid": True}, {"pgid": -1}, {"pgid": 2 ** 40},
    {"owner_pid": -1}, {"owner_created": NAN}, {"cmdline": "not a list"},
]


def test_the_reaper_drops_pid_files_with_nan_negative_or_huge_numbers_and_kills_nothing(
        live_program: subprocess.Popen[bytes], caplog: pytest.LogCaptureFixture) -> None:
    """Found on 7638391: `"created": NaN` passed the pid-reuse check, so `serve` reaped any live program the file
    named ("reaped orphaned llama.cpp engine")."""
    pidfile = paths.run_dir() / "engine-60.json"
    for fields in BAD_FIELDS:
        pidfile.write_text(json.dumps(_record(live_program, **fields)))  # NaN and Infinity as Python writes them
        with caplog.at_level(logging.WARNING):
            assert reap_orphans() == [], fields
        assert live_program.poll() is None, f"{fields} got a live program killed"
        assert not pidfile.exists(), f"{fields}: the record is dropped"
        assert "dropped engine-60.json" in caplog.text, fields
        caplog.clear()


def test_the_reaper_stops_the_recorded_command_line_only(live_program: subprocess.Popen[bytes]) -> None:
    """Start time right, program right, but the file says the engine ran another command line: not stopped."""
    pidfile = paths.run_dir() / "engine-61.json"
    pidfile.write_text(json.dumps(_record(live_program, cmdline=[psutil.Process(live_program.pid).cmdline()[0], "--model", "x.gguf"])))
    assert reap_orphans() == []
    assert live_program.poll() is None and not pidfile.exists()
    # the same record with the command line the process really runs: reaped (the check can pass)
    pidfile.write_text(json.dumps(_record(live_program, cmdline=psutil.Process(live_program.pid).cmdline())))
    assert reap_orphans() == [live_program.pid]
    assert live_program.wait(timeout=10) is not None


def test_the_uninstaller_drops_pid_files_with_nan_negative_or_huge_numbers(live_program: subprocess.Popen[bytes],
                                                                          ) -> None:
    run_dir = paths.run_dir()
    pidfile = run_dir / "engine-62.json"
    for fields in BAD_FIELDS:
        pidfile.write_text(json.dumps(_record(live_program, **fields)))
        assert _frozen.stop_recorded_engines([run_dir], grace=1.0) == [], fields
        assert live_program.poll() is None, f"{fields} got a live program killed"
        assert not pidfile.exists(), fields


def test_stop_signals_nothing_a_discovery_file_names_without_a_matching_start_and_command_line(
        live_program: subprocess.Popen[bytes]) -> None:
    """`switchyard stop` SIGTERMed the pid of a plain serve's discovery file; with `"created": NaN` (or another
    command line than the one it records) that pid is anyone's."""
    from desktop.cli import main

    discovery = paths.run_dir() / "endpoint-6060.json"
    real = psutil.Process(live_program.pid)
    for fields in ({"created": NAN}, {"created": INF}, {"created": real.create_time(), "pid": 2 ** 40},
                   {"created": real.create_time(), "cmdline": ["switchyard", "serve"]}):
        discovery.write_text(json.dumps({"pid": live_program.pid, "port": 6060, "url": "http://127.0.0.1:6060",
                                         "token": "t", "started_at": 1.0, "kind": "engine", **fields}))
        main(["stop", "--port", "6060"])
        assert live_program.poll() is None, f"{fields}: stop signalled a process that is not the instance"
        discovery.unlink(missing_ok=True)


# --- the root uninstaller over other users' folders ---------------------------------------------------------------
def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("hands folders and links to a fake user with chown: needs root")


def _give(path: Path, uid: int = FAKE_UID) -> None:
    os.lchown(path, uid, uid)


def _home(base: Path, name: str, *folders: str) -> tuple[Path, types.SimpleNamespace]:
    """A fake user's home with its data folder (and `folders` in it), all theirs, and the pwd entry listing it."""
    home = base / name
    data = home / ".local" / "share" / "switchyard"
    data.mkdir(parents=True)
    for folder in (home, home / ".local", home / ".local" / "share", data, *(data / f for f in folders)):
        folder.mkdir(exist_ok=True)
        _give(folder)
    return data, types.SimpleNamespace(pw_name=name, pw_uid=FAKE_UID, pw_gid=FAKE_UID, pw_dir=str(home))


@pytest.fixture
def users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, list[types.SimpleNamespace]]]:
    """A folder for fake homes (readable by uid 4242) and the pwd entries the uninstaller walks."""
    import pwd

    _as_root()
    base = tmp_path / "homes"
    base.mkdir()
    base.chmod(0o755)
    tmp_path.chmod(0o755)
    entries: list[types.SimpleNamespace] = []
    monkeypatch.setattr(pwd, "getpwall", lambda: entries)
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "root-home"))  # root's own data folder: empty
    yield base, entries


def test_root_does_not_follow_a_users_run_folder_link_into_roots_own(
        users: tuple[Path, list[types.SimpleNamespace]], caplog: pytest.LogCaptureFixture) -> None:
    """A user's run folder made a link to a folder of root's, and their engines folder a link to `/`: on 7638391
    root swept root's pid files as if the user's and killed root's process (its program "under" `/`)."""
    base, entries = users
    data, alice = _home(base, "alice")
    entries.append(alice)
    victim_run = base / "roots-run"
    victim_run.mkdir()
    victim = subprocess.Popen([str(_program_in(base / "roots-programs")), "600"],  # noqa: S603
                              start_new_session=True)
    try:
        (victim_run / f"engine-{victim.pid}.json").write_text(json.dumps(_record(victim)))
        (data / "run").symlink_to(victim_run)
        (data / "engines").symlink_to("/")
        _give(data / "run")
        _give(data / "engines")
        with caplog.at_level(logging.WARNING):
            stopped = _frozen.stop_recorded_engines(_frozen.default_run_dirs(all_users=True), grace=1.0)
        assert stopped == []
        assert victim.poll() is None, "root's process was killed through a user's link"
        assert (victim_run / f"engine-{victim.pid}.json").exists(), "root's pid file is not the user's to drop"
        assert f"a link owned by uid {FAKE_UID}" in caplog.text
    finally:
        victim.kill()
        victim.wait()


def test_root_does_not_take_a_users_engines_link_for_their_engines_folder(
        users: tuple[Path, list[types.SimpleNamespace]]) -> None:
    """The user's own run folder is real, their engines folder a link to `/`: a pid file of theirs naming a
    process of theirs that runs no engine (/bin/sleep) got it killed on 7638391 (everything is under `/`)."""
    base, entries = users
    data, alice = _home(base, "alice", "run")
    entries.append(alice)
    run = data / "run"
    (data / "engines").symlink_to("/")
    _give(data / "engines")
    theirs = subprocess.Popen([SLEEP, "600"], user=FAKE_UID, group=FAKE_UID, extra_groups=[],  # noqa: S603
                              start_new_session=True)
    try:
        assert psutil.Process(theirs.pid).uids().real == FAKE_UID
        pidfile = run / f"engine-{theirs.pid}.json"
        pidfile.write_text(json.dumps(_record(theirs)))
        _give(pidfile)
        assert _frozen.stop_recorded_engines(_frozen.default_run_dirs(all_users=True), grace=1.0) == []
        assert theirs.poll() is None, "a process outside the app's engines folder was killed"
        assert not pidfile.exists(), "the user's own pid file is dropped"
    finally:
        theirs.kill()
        theirs.wait()


def test_root_unlinks_the_file_it_read_even_when_the_folder_is_swapped_for_a_link(
        users: tuple[Path, list[types.SimpleNamespace]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the check of a bad pid file and its unlink, the user swaps their run folder for a link to another
    folder holding a file of the same name: 7638391 unlinked by path, so it removed the other folder's file."""
    import desktop.core.common.private as private

    base, entries = users
    data, alice = _home(base, "alice", "run")
    entries.append(alice)
    run = data / "run"
    (run / "engine-7.json").write_text("{not json")
    _give(run / "engine-7.json")
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "engine-7.json").write_text('{"kept": true}')
    _give(elsewhere / "engine-7.json")
    swapped: list[bool] = []
    real_lstat, real_stat = os.lstat, os.stat

    def swap_once(name: Any) -> None:
        if not swapped and str(name).endswith("engine-7.json"):
            swapped.append(True)
            run.rename(data / "run-moved")
            (data / "run").symlink_to(elsewhere)
            _give(data / "run")

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_lstat(path, *args, **kwargs)
        swap_once(path)
        return result

    def stat_(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_stat(path, *args, **kwargs)
        if kwargs.get("follow_symlinks") is False:
            swap_once(path)
        return result

    assert getattr(private, "os") is os  # noqa: B009 - the module both the old and the new code call
    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "stat", stat_)
    _frozen.stop_recorded_engines(_frozen.default_run_dirs(all_users=True), grace=1.0)
    monkeypatch.undo()
    assert swapped, "the swap happened between the check and the unlink"
    assert (elsewhere / "engine-7.json").exists(), "a file in another folder was unlinked"
    assert not (data / "run-moved" / "engine-7.json").exists(), "the file that was read is the one removed"


def test_root_still_follows_an_administrators_link_and_stops_that_users_orphan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the no-follow rule: a link root owns on the way (`/home -> /var/home` style) is followed,
    and an orphaned engine of the user (running as them, from their real engines folder) is still stopped."""
    import pwd
    import tempfile

    _as_root()
    base = Path(tempfile.mkdtemp(prefix="switchyard-homes-"))  # traversable by uid 4242, unlike tmp_path
    try:
        base.chmod(0o755)
        (base / "var-home").mkdir()
        (base / "home").symlink_to(base / "var-home")  # root's link: followed
        data, alice = _home(base / "var-home", "alice", "run", "engines")
        alice.pw_dir = str(base / "home" / "alice")
        monkeypatch.setattr(pwd, "getpwall", lambda: [alice])
        monkeypatch.setenv("SWITCHYARD_HOME", str(base / "root-home"))
        program = _program_in(data / "engines" / "llama.cpp")
        for path in (program.parent.parent, program.parent, program):
            _give(path)
        engine = subprocess.Popen([str(program), "600"], user=FAKE_UID, group=FAKE_UID,  # noqa: S603
                                  extra_groups=[], start_new_session=True)
        try:
            pidfile = data / "run" / f"engine-{engine.pid}.json"
            pidfile.write_text(json.dumps(_record(engine, cmdline=psutil.Process(engine.pid).cmdline())))
            _give(pidfile)
            stopped = _frozen.stop_recorded_engines(_frozen.default_run_dirs(all_users=True), grace=5.0)
            assert [item.pid for item in stopped] == [engine.pid]
            assert engine.wait(timeout=10) is not None and not pidfile.exists()
        finally:
            engine.kill()
            engine.wait()
    finally:
        shutil.rmtree(base)
