"""The benchmark child process the GUI starts (`switchyard gui --run-job JOB`): runs a load sweep against an
endpoint or an engine-vs-engine A/B, writes the reports, records the run in history, and streams what happens
as JSON lines on stdout.

Why a separate process: the load generator is an asyncio loop that parses hundreds of streamed chunks a second;
inside the GUI process it competed with the event loop for the GIL (p99 paint delays of 150 ms). Here it has
its own interpreter, and the GUI only parses about one line a second. Qt-free on purpose (it must start fast).

Protocol. JOB is a JSON object: {"kind": "ab", "config": {ABConfig fields}, ...} or {"kind": "sweep",
"base_url": str, "levels": [int], "requests": int, "input_len": int, "output_len": int, ...}; an A/B's config may
hold "replay": {"since": "1d", "max_requests": int | null} with "replay_speed" (the recorded traffic, read from
the request log here, sent open loop after each sweep: `ab --replay`). Both take optional
"report_dir" (default: a new folder under the data dir) and "record" (default true). Each stdout line is one
JSON object with an "event": "progress" {message, fraction}, "bucket" {engine, overall, ...LiveBucket},
"result" {result, report, run_id}, "error" {message, hint} or "cancelled" {message}.
stdin: a line "stop" (or end of file, e.g. when the GUI died) stops the run: a sweep keeps what it measured,
an A/B stops its engine and reports "cancelled".
"""

from __future__ import annotations

import _thread
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

PROGRESS_MIN_INTERVAL_S = 0.5


class Emitter:
    """JSON lines to the real stdout (anything else that prints goes to stderr, so the protocol stays clean)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, default=str)
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()


class ProgressThrottle:
    """Forward level/phase messages always, per-request progress at most every half second."""

    def __init__(self, emit: Emitter) -> None:
        self.emit = emit
        self.last_message = ""
        self.last_sent = 0.0

    def __call__(self, event: Any) -> None:
        message = str(getattr(event, "message", event))
        fraction = getattr(event, "fraction", None)
        now = time.monotonic()
        if fraction is not None and fraction < 1.0 and now - self.last_sent < PROGRESS_MIN_INTERVAL_S:
            return
        if message == self.last_message and fraction is None:
            return
        self.last_message, self.last_sent = message, now
        self.emit("progress", message=message, fraction=fraction)


def _watch_stdin(stop: threading.Event, interrupt: bool) -> None:
    """`stop` on a "stop" line or end of file; with `interrupt`, also raise KeyboardInterrupt in the main thread
    (an A/B has no abort hook: unwinding stops its engine through the runner's `finally`)."""
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()
    if interrupt:
        _thread.interrupt_main()


def _report_dir(job: dict[str, Any], kind: str) -> Path:
    if job.get("report_dir"):
        return Path(job["report_dir"])
    from desktop.core.common import paths

    return paths.data_dir() / "reports" / time.strftime(f"{kind}-%Y%m%d-%H%M%S")


def run_ab_job(job: dict[str, Any], emit: Emitter) -> None:
    from desktop.core.engines import get_adapter
    from desktop.core.measure.ab import ABConfig, is_attached, run_ab
    from desktop.core.measure.reports import record_ab, write_ab_report

    raw = dict(job["config"])
    raw["engines"] = tuple(raw.get("engines", ("llama.cpp", "vllm")))
    raw["concurrency"] = tuple(raw.get("concurrency", (1, 8, 32)))
    if isinstance(raw.get("replay"), dict):  # the Compare page names the span; the child reads the request log
        from desktop.core.measure.loadgen.replay import schedule_from_log

        span = raw["replay"]
        raw["replay"] = schedule_from_log(str(span.get("since") or "1d"), max_requests=span.get("max_requests"))
    config = ABConfig(**raw)
    names = [name if is_attached(name) else get_adapter(name).name for name in config.engines]  # endpoint:NAME
    total = max(1, len(names) * config.repetitions * len(config.concurrency) * config.requests_per_level)
    state: dict[str, Any] = {"engine": names[0], "done": 0}
    throttle = ProgressThrottle(emit)

    def progress(event: Any) -> None:
        message = str(getattr(event, "message", ""))
        for name in names:  # the runner prefixes every message with the engine it is on
            if message.startswith(name + " "):
                state["engine"] = name
        throttle(event)

    def on_bucket(bucket: Any) -> None:
        state["done"] += bucket.completed + bucket.failed
        emit("bucket", engine=state["engine"], overall=min(1.0, state["done"] / total), **bucket.to_json())

    result = run_ab(config, progress=progress, on_bucket=on_bucket, allow_install=bool(job.get("allow_install")))
    report = write_ab_report(result, _report_dir(job, "ab"))
    run_id = None
    if job.get("record", True):
        from desktop.core.storage.history import Store

        with Store() as store:
            run_id = record_ab(store, result, str(report.html))
    emit("result", result=result.to_json(), report=report.to_json(), run_id=run_id)


def run_sweep_job(job: dict[str, Any], emit: Emitter, stop: threading.Event) -> None:
    from desktop.core.measure.loadgen import LoadConfig, RandomWorkload, Target, run_sweep_sync, sweep_levels
    from desktop.core.measure.reports import record_bench, write_bench_report

    levels = [int(level) for level in job["levels"]]
    requests = int(job.get("requests", 32))
    workload = RandomWorkload(input_len=int(job.get("input_len", 64)), output_len=int(job.get("output_len", 32)))
    configs = sweep_levels(LoadConfig(num_requests=requests), concurrency=levels)
    total = max(1, len(levels) * requests)
    done = [0]

    def on_bucket(bucket: Any) -> None:
        done[0] += bucket.completed + bucket.failed
        emit("bucket", engine=job.get("engine") or "endpoint", overall=min(1.0, done[0] / total), **bucket.to_json())

    sweep = run_sweep_sync(Target(job["base_url"]), workload, configs, on_bucket=on_bucket,
                           progress=ProgressThrottle(emit),
                           abort_check=lambda: "stopped by the user" if stop.is_set() else None)
    meta: dict[str, Any] = {"endpoint": job["base_url"], "engine": job.get("engine"), "engine_version": None,
                            "model": job.get("model"),
                            "settings": {"levels": [c.to_json() for c in configs], "workload": workload.to_json()}}
    report = write_bench_report(sweep, meta, _report_dir(job, "bench"))
    run_id = None
    if job.get("record", True):
        from desktop.core.storage.history import Store

        with Store() as store:
            run_id = record_bench(store, sweep, meta, str(report.html))
    emit("result", result={"kind": "bench", "aborted": sweep.aborted, **sweep.to_json()}, report=report.to_json(),
         run_id=run_id)


def main(job_text: str) -> int:
    events = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints (ours or a library's) go to stderr
    emit = Emitter(events)
    from desktop.core.common.errors import SwitchyardError

    try:
        job = json.loads(job_text)
        if not isinstance(job, dict) or job.get("kind") not in ("ab", "sweep"):
            raise SwitchyardError("the benchmark job must be a JSON object with kind 'ab' or 'sweep'")
        stop = threading.Event()
        threading.Thread(target=_watch_stdin, args=(stop, job["kind"] == "ab"), daemon=True,
                         name="stdin-stop").start()
        if job["kind"] == "ab":
            run_ab_job(job, emit)
        else:
            run_sweep_job(job, emit, stop)
        return 0
    except KeyboardInterrupt:
        emit("cancelled", message="stopped by the user; the engine was stopped and nothing was saved")
        return 130
    except SwitchyardError as exc:
        emit("error", message=exc.message, hint=exc.hint)
        return 1
    except json.JSONDecodeError as exc:
        emit("error", message=f"the benchmark job is not valid JSON: {exc}", hint=None)
        return 2
    except Exception as exc:  # noqa: BLE001 - the GUI shows one readable line; the traceback goes to stderr
        import traceback

        traceback.print_exc()
        emit("error", message=f"Unexpected error: {exc} ({type(exc).__name__})", hint="details in the log")
        return 1
