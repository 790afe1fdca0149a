"""SQLite history: every benchmark run, every telemetry sample and the endpoint's request log, in one file under
`paths.data_dir()`.

WAL mode lets the GUI read while telemetry writes. The schema version lives in `PRAGMA user_version`;
`MIGRATIONS[i]` upgrades version i to i + 1, so an old history file is upgraded in place and never lost.
One connection per Store, guarded by a lock, so telemetry threads and the GUI thread can share it.
"""

from __future__ import annotations

import json
import platform
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from desktop.core.common import paths, private
from desktop.core.common.errors import SwitchyardError

DB_NAME = "history.sqlite3"

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 0 -> 1
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            created_at REAL NOT NULL,
            kind TEXT NOT NULL,
            machine TEXT NOT NULL,
            engine TEXT,
            engine_version TEXT,
            model TEXT,
            settings_json TEXT NOT NULL DEFAULT '{}',
            summary_json TEXT NOT NULL DEFAULT '{}',
            report_path TEXT
        )""",
        "CREATE INDEX runs_created ON runs (created_at)",
        """CREATE TABLE samples (
            ts REAL NOT NULL,
            source TEXT NOT NULL,
            series TEXT NOT NULL,
            value REAL NOT NULL
        )""",
        "CREATE INDEX samples_lookup ON samples (source, series, ts)",
    ),
    (  # 1 -> 2: runs can be labelled (e.g. "A/B llama.cpp vs vllm")
        "ALTER TABLE runs ADD COLUMN label TEXT",
    ),
    (  # 2 -> 3: the endpoint's request log (bodies only when the user turned capture on)
        """CREATE TABLE requests (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            t REAL NOT NULL,
            seq INTEGER NOT NULL DEFAULT 0,
            method TEXT,
            path TEXT,
            model TEXT,
            engine TEXT,
            upstream TEXT,
            status INTEGER NOT NULL,
            streamed INTEGER NOT NULL DEFAULT 0,
            prompt_tokens INTEGER,
            output_tokens INTEGER,
            ttft_s REAL,
            e2e_s REAL,
            client TEXT,
            error TEXT,
            request_body TEXT,
            response_body TEXT
        )""",
        "CREATE INDEX requests_t ON requests (t)",
    ),
    (  # 3 -> 4: per-component memory the engines reported next to what the fit predicted, keyed by the
       # accelerator set (not the host name: a GPU moved to another box keeps its corrections)
        """CREATE TABLE memory_points (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            created_at REAL NOT NULL,
            accelerators TEXT NOT NULL,
            engine TEXT NOT NULL,
            engine_version TEXT,
            model TEXT,
            component TEXT NOT NULL,
            predicted_bytes REAL NOT NULL,
            measured_bytes REAL NOT NULL,
            source TEXT NOT NULL,
            run_id INTEGER,
            settings_json TEXT NOT NULL DEFAULT '{}'
        )""",
        "CREATE INDEX memory_points_key ON memory_points (accelerators, engine, component, created_at)",
    ),
    (  # 4 -> 5: the endpoint's events beside its requests (the hybrid autopilot's decisions and their reasons)
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            t REAL NOT NULL,
            kind TEXT NOT NULL,
            action TEXT,
            reason TEXT,
            data_json TEXT NOT NULL DEFAULT '{}'
        )""",
        "CREATE INDEX events_t ON events (t)",
    ),
    (  # 5 -> 6: what the endpoint changed in a request for its engine (serving.normalize), beside the request
        "ALTER TABLE requests ADD COLUMN note TEXT",
    ),
)
# The request log's columns (besides the row id): the keys of the endpoint's RequestRecord.to_json() it keeps.
REQUEST_COLUMNS = ("t", "seq", "method", "path", "model", "engine", "upstream", "status", "streamed",
                   "prompt_tokens", "output_tokens", "ttft_s", "e2e_s", "client", "error", "request_body",
                   "response_body", "note")
SCHEMA_VERSION = len(MIGRATIONS)


def machine_name() -> str:
    return f"{platform.node()} ({platform.system()} {platform.machine()})"


@dataclass
class RunRecord:
    """One stored run. `summary` and `settings` are the JSON the reports also use."""

    kind: str  # "bench" | "ab"
    engine: str | None = None
    engine_version: str | None = None
    model: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    report_path: str | None = None
    label: str | None = None
    machine: str = field(default_factory=machine_name)
    created_at: float = field(default_factory=time.time)
    id: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MemoryPoint:
    """One component of one launch: what the engine reported and what the fit predicted (bytes)."""

    accelerators: str
    engine: str
    component: str  # weights | kv_cache | compute | total
    predicted_bytes: float
    measured_bytes: float
    source: str  # "calibrate" | "launch"
    engine_version: str | None = None
    model: str | None = None
    run_id: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    id: int | None = None


@dataclass(frozen=True)
class Sample:
    """One telemetry value: when, from where (e.g. "llama.cpp:8080"), which series, how much."""

    ts: float
    source: str
    series: str
    value: float


class Store:
    """The history database. Use as a context manager, or call `close()`."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path else paths.data_dir() / DB_NAME
        self._lock = threading.Lock()
        try:
            private.private_database(self.path)  # captured prompts live here: 0600 whatever the umask
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._migrate()
        except (sqlite3.DatabaseError, OSError) as exc:
            raise SwitchyardError(f"cannot open the history database {self.path}: {exc}",
                                  "move the file aside to start a fresh history") from exc

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        if self.schema_version == SCHEMA_VERSION:
            return
        # The version is read again and the schema written under the write lock (BEGIN IMMEDIATE): two openers of
        # a fresh file at once (the GUI's pages on first start) otherwise both create it ("table runs already
        # exists"). One transaction: a failed step leaves the version it started from intact.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            version = self.schema_version
            if version > SCHEMA_VERSION:
                raise SwitchyardError(f"the history database {self.path} is from a newer Switchyard "
                                      f"(schema {version} > {SCHEMA_VERSION})", "update Switchyard")
            for target in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[target]:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {target + 1}")
            self._db.commit()
        except BaseException:
            self._db.rollback()
            raise

    # --- runs -------------------------------------------------------------------------------------------
    def add_run(self, run: RunRecord) -> int:
        with self._lock, self._db:
            cursor = self._db.execute(
                "INSERT INTO runs (created_at, kind, machine, engine, engine_version, model, settings_json, "
                "summary_json, report_path, label) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run.created_at, run.kind, run.machine, run.engine, run.engine_version, run.model,
                 json.dumps(run.settings, default=str), json.dumps(run.summary, default=str), run.report_path,
                 run.label),
            )
        run.id = int(cursor.lastrowid or 0)
        return run.id

    def set_report_path(self, run_id: int, report_path: str) -> None:
        with self._lock, self._db:
            self._db.execute("UPDATE runs SET report_path = ? WHERE id = ?", (report_path, run_id))

    def runs(self, limit: int = 100, kind: str | None = None, engine: str | None = None) -> list[RunRecord]:
        """Newest first."""
        query = ("SELECT id, created_at, kind, machine, engine, engine_version, model, settings_json, "
                 "summary_json, report_path, label FROM runs")
        clauses, args = [], []
        if kind:
            clauses.append("kind = ?")
            args.append(kind)
        if engine:
            clauses.append("engine = ?")
            args.append(engine)
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        query += " ORDER BY created_at DESC, id DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(query, (*args, limit)).fetchall()
        return [self._run(row) for row in rows]

    def get_run(self, run_id: int) -> RunRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, created_at, kind, machine, engine, engine_version, model, settings_json, "
                "summary_json, report_path, label FROM runs WHERE id = ?", (run_id,)).fetchone()
        return self._run(row) if row else None

    @staticmethod
    def _run(row: Sequence[Any]) -> RunRecord:
        return RunRecord(id=row[0], created_at=row[1], kind=row[2], machine=row[3], engine=row[4],
                         engine_version=row[5], model=row[6], settings=json.loads(row[7]),
                         summary=json.loads(row[8]), report_path=row[9], label=row[10])

    # --- telemetry samples ------------------------------------------------------------------------------
    def add_samples(self, rows: Iterable[Sample | tuple[float, str, str, float]]) -> int:
        """Append samples in one transaction; returns how many were written."""
        values = [(float(r[0]), str(r[1]), str(r[2]), float(r[3])) if isinstance(r, tuple)
                  else (r.ts, r.source, r.series, r.value) for r in rows]
        with self._lock, self._db:
            self._db.executemany("INSERT INTO samples (ts, source, series, value) VALUES (?, ?, ?, ?)", values)
        return len(values)

    def samples(self, source: str, series: str, since: float = 0.0, until: float | None = None) -> list[Sample]:
        """Samples of one series from one source with `since <= ts (< until)`, oldest first."""
        query = "SELECT ts, source, series, value FROM samples WHERE source = ? AND series = ? AND ts >= ?"
        args: list[Any] = [source, series, since]
        if until is not None:
            query += " AND ts < ?"
            args.append(until)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY ts", args).fetchall()
        return [Sample(*row) for row in rows]

    def prune_samples(self, before: float) -> int:
        """Drop samples older than `before` (telemetry retention)."""
        with self._lock, self._db:
            return self._db.execute("DELETE FROM samples WHERE ts < ?", (before,)).rowcount

    # --- engine-reported memory vs the fit (calibration) -----------------------------------------------
    def add_memory_points(self, rows: Iterable[MemoryPoint]) -> int:
        values = [(r.created_at, r.accelerators, r.engine, r.engine_version, r.model, r.component,
                   float(r.predicted_bytes), float(r.measured_bytes), r.source, r.run_id,
                   json.dumps(r.settings, default=str)) for r in rows]
        with self._lock, self._db:
            self._db.executemany(
                "INSERT INTO memory_points (created_at, accelerators, engine, engine_version, model, component, "
                "predicted_bytes, measured_bytes, source, run_id, settings_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, "
                "?, ?)", values)
        return len(values)

    def memory_points(self, accelerators: str, engine: str | None = None, limit: int = 200) -> list[MemoryPoint]:
        """Newest first, for one accelerator set (and engine)."""
        query = ("SELECT created_at, accelerators, engine, engine_version, model, component, predicted_bytes, "
                 "measured_bytes, source, run_id, settings_json, id FROM memory_points WHERE accelerators = ?")
        args: list[Any] = [accelerators]
        if engine:
            query += " AND engine = ?"
            args.append(engine)
        query += " ORDER BY created_at DESC, id DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(query, (*args, limit)).fetchall()
        return [MemoryPoint(created_at=r[0], accelerators=r[1], engine=r[2], engine_version=r[3], model=r[4],
                            component=r[5], predicted_bytes=r[6], measured_bytes=r[7], source=r[8], run_id=r[9],
                            settings=json.loads(r[10] or "{}"), id=r[11]) for r in rows]

    # --- the endpoint's request log --------------------------------------------------------------------
    def add_requests(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Append finished requests (dicts keyed by REQUEST_COLUMNS; missing keys are NULL) in one transaction."""
        defaults: dict[str, Any] = {"seq": 0, "streamed": False}
        values = [tuple(row.get(column, defaults.get(column)) for column in REQUEST_COLUMNS) for row in rows]
        placeholders = ", ".join("?" for _ in REQUEST_COLUMNS)
        with self._lock, self._db:
            self._db.executemany(f"INSERT INTO requests ({', '.join(REQUEST_COLUMNS)}) VALUES ({placeholders})",
                                 values)
        return len(values)

    def requests(self, limit: int = 100) -> list[dict[str, Any]]:
        """The last `limit` requests, oldest first (as a log reads), each a dict of REQUEST_COLUMNS plus `id`."""
        query = (f"SELECT id, {', '.join(REQUEST_COLUMNS)} FROM requests ORDER BY id DESC LIMIT ?")
        with self._lock:
            rows = self._db.execute(query, (limit,)).fetchall()
        names = ("id", *REQUEST_COLUMNS)
        out = [dict(zip(names, row, strict=True)) for row in reversed(rows)]
        for row in out:
            row["streamed"] = bool(row["streamed"])
        return out

    def requests_between(self, since: float = 0.0, until: float | None = None, model: str | None = None,
                         limit: int = 1_000_000) -> list[dict[str, Any]]:
        """Finished requests that arrived in [since, until), oldest first (the workload profile's input); only
        those that asked for `model` when given. Bodies are included (NULL unless capture was on)."""
        query = f"SELECT id, {', '.join(REQUEST_COLUMNS)} FROM requests WHERE t >= ?"
        args: list[Any] = [since]
        if until is not None:
            query += " AND t < ?"
            args.append(until)
        if model is not None:
            query += " AND model = ?"
            args.append(model)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY t, id LIMIT ?", (*args, limit)).fetchall()
        names = ("id", *REQUEST_COLUMNS)
        out = [dict(zip(names, row, strict=True)) for row in rows]
        for row in out:
            row["streamed"] = bool(row["streamed"])
        return out

    def add_events(self, events: Iterable[Mapping[str, Any]]) -> int:
        """Append endpoint events (dicts with `t`, `kind`, and for decisions `action` and `reason`)."""
        values = [(float(e.get("t") or time.time()), str(e.get("kind") or "event"), e.get("action"), e.get("reason"),
                   json.dumps(dict(e), default=str)) for e in events]
        with self._lock, self._db:
            self._db.executemany("INSERT INTO events (t, kind, action, reason, data_json) VALUES (?, ?, ?, ?, ?)",
                                 values)
        return len(values)

    def events(self, limit: int = 100, kind: str | None = None) -> list[dict[str, Any]]:
        """The last `limit` events (of `kind`), oldest first, each the dict that was added."""
        query = "SELECT data_json FROM events" + (" WHERE kind = ?" if kind else "") + " ORDER BY id DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(query, (kind, limit) if kind else (limit,)).fetchall()
        return [dict(json.loads(r[0])) for r in reversed(rows)]

    def prune_requests(self, keep: int) -> int:
        """Keep only the newest `keep` requests (request-log retention)."""
        with self._lock, self._db:
            return self._db.execute("DELETE FROM requests WHERE id <= (SELECT MAX(id) FROM requests) - ?",
                                    (keep,)).rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
