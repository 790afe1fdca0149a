"""The SQLite history: a real file, WAL, migrations from old versions, runs and telemetry samples."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.storage.history import DB_NAME, MIGRATIONS, SCHEMA_VERSION, RunRecord, Sample, Store


def test_default_location_wal_and_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path))
    with Store() as store:
        assert store.path == tmp_path / DB_NAME and store.path.is_file()
        assert store.schema_version == SCHEMA_VERSION
    raw = sqlite3.connect(tmp_path / DB_NAME)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_runs_round_trip_newest_first(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    with Store(path) as store:
        first = store.add_run(RunRecord(kind="bench", engine="llama.cpp", engine_version="b1", model="demo",
                                        settings={"concurrency": [1, 8]}, summary={"output_throughput": 12.5},
                                        created_at=100.0))
        second = store.add_run(RunRecord(kind="ab", model="demo", summary={"ratio": 2.0}, created_at=200.0,
                                         label="A/B"))
        store.set_report_path(first, "/tmp/report.html")
    with Store(path) as store:  # reopened: it is on disk
        runs = store.runs()
        assert [r.id for r in runs] == [second, first]
        old = store.get_run(first)
        assert old is not None and old.settings == {"concurrency": [1, 8]}
        assert old.summary["output_throughput"] == 12.5 and old.report_path == "/tmp/report.html"
        assert [r.id for r in store.runs(engine="llama.cpp")] == [first]
        assert [r.label for r in store.runs(kind="ab")] == ["A/B"]
        assert store.get_run(999) is None


def test_samples_filtered_by_source_series_and_time(tmp_path: Path) -> None:
    with Store(tmp_path / "h.db") as store:
        written = store.add_samples([(1.0, "llama.cpp:1", "requests_running", 2.0),
                                     Sample(2.0, "llama.cpp:1", "requests_running", 3.0),
                                     (3.0, "llama.cpp:1", "kv_cache_usage", 0.5),
                                     (4.0, "vllm:2", "requests_running", 7.0)])
        assert written == 4
        got = store.samples("llama.cpp:1", "requests_running", since=1.5)
        assert got == [Sample(2.0, "llama.cpp:1", "requests_running", 3.0)]
        assert [s.value for s in store.samples("llama.cpp:1", "requests_running")] == [2.0, 3.0]
        assert store.prune_samples(before=3.5) == 3
        assert store.samples("llama.cpp:1", "kv_cache_usage") == []


def test_migrates_an_old_version_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    raw = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        raw.execute(statement)
    raw.execute("PRAGMA user_version = 1")
    raw.execute("INSERT INTO runs (created_at, kind, machine) VALUES (1.0, 'bench', 'box')")
    raw.commit()
    raw.close()
    with Store(path) as store:
        assert store.schema_version == SCHEMA_VERSION
        (run,) = store.runs()
        assert run.machine == "box" and run.label is None


def test_newer_schema_and_garbage_files_are_clear_errors(tmp_path: Path) -> None:
    newer = tmp_path / "newer.db"
    raw = sqlite3.connect(newer)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    raw.commit()
    raw.close()
    with pytest.raises(SwitchyardError, match="newer Switchyard"):
        Store(newer)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database at all" * 100)
    with pytest.raises(SwitchyardError, match="cannot open the history database"):
        Store(garbage)
    assert garbage.read_bytes().startswith(b"not a database")  # nothing was overwritten


def test_threads_share_one_store(tmp_path: Path) -> None:
    with Store(tmp_path / "h.db") as store:
        def write(worker: int) -> None:
            for i in range(50):
                store.add_samples([(float(i), f"w{worker}", "x", float(i))])

        threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(len(store.samples(f"w{n}", "x")) == 50 for n in range(4))


def test_a_version_2_history_gains_the_request_log(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    raw = sqlite3.connect(path)
    for step in MIGRATIONS[:2]:
        for statement in step:
            raw.execute(statement)
    raw.execute("PRAGMA user_version = 2")
    raw.execute("INSERT INTO runs (created_at, kind, machine, label) VALUES (1.0, 'ab', 'box', 'kept')")
    raw.commit()
    raw.close()
    with Store(path) as store:
        assert store.schema_version == SCHEMA_VERSION >= 3
        assert [r.label for r in store.runs()] == ["kept"]
        assert store.requests() == []
        written = store.add_requests([
            {"t": 1.0, "seq": 1, "method": "POST", "path": "/v1/messages", "status": 200, "streamed": True,
             "prompt_tokens": 22, "output_tokens": 8, "ttft_s": 0.25, "e2e_s": 1.5, "client": "127.0.0.1:5000",
             "ignored": "keys other than the columns"},
            {"t": 2.0, "seq": 2, "status": 503, "error": "no engine"},
        ])
        assert written == 2
        first, second = store.requests()
        assert first["streamed"] is True and first["ttft_s"] == 0.25 and first["prompt_tokens"] == 22
        assert second["status"] == 503 and second["model"] is None and second["streamed"] is False
        assert [r["seq"] for r in store.requests(limit=1)] == [2]
        assert store.prune_requests(keep=1) == 1
        assert [r["seq"] for r in store.requests()] == [2]


def test_openers_of_a_fresh_file_at_once_all_get_the_schema(tmp_path: Path) -> None:
    """The GUI's pages open the history on their worker threads at first start; each must find one schema, not
    race to create it ("table runs already exists")."""
    path = tmp_path / "fresh.sqlite3"
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def open_it() -> None:
        start.wait()
        try:
            with Store(path) as store:
                assert store.schema_version == SCHEMA_VERSION
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []


def test_opening_another_store_keeps_the_locks_of_the_open_ones(tmp_path: Path) -> None:
    """A second Store in the same process must not drop the POSIX locks of the first one's connection (closing any
    descriptor of the file does). Without its shared lock, another process closing its own connection thinks it
    is the last one, checkpoints and deletes the -wal and -shm files under the open connection: "disk I/O error"."""
    import subprocess
    import sys

    path = tmp_path / "shared.sqlite3"
    first = Store(path)
    try:
        first.add_run(RunRecord(kind="bench", engine="llama.cpp", model="m"))
        with Store(path):  # another opener here (the GUI opens one per worker)
            pass
        probe = ("import sqlite3, sys\n"
                 "db = sqlite3.connect(sys.argv[1])\n"
                 "print(db.execute('SELECT count(*) FROM runs').fetchone()[0])\n"
                 "db.close()\n")
        out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60,
                             check=True)
        assert out.stdout.strip() == "1"
        assert path.with_name(path.name + "-shm").exists()  # not deleted under the open connection
        first.add_run(RunRecord(kind="bench", engine="vllm", model="m"))
        assert len(first.runs()) == 2
    finally:
        first.close()


def test_a_history_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.sqlite3").touch()
    (tmp_path / "history.sqlite3").symlink_to(tmp_path / "elsewhere.sqlite3")
    with pytest.raises(SwitchyardError, match="cannot open the history database"):
        Store(tmp_path / "history.sqlite3")
