"""The endpoint's request log: the last N requests (and the ones in flight) in memory for the GUI and
`switchyard requests`, and every finished one in history.

It listens to the proxy (`ProxyServer.subscribe_started` / `subscribe`), so its callbacks run on the endpoint's
event loop: they only touch a dict and a deque under a lock and hand finished records to a writer thread, which
stores whatever piled up meanwhile in one transaction (SQLite is never written from the endpoint's loop).

Besides requests it keeps the endpoint's events (`note`): small dicts with a `kind`, such as the hybrid
autopilot's decisions (`{"kind": "autopilot", "action", "reason", "t", "numbers"}`), in memory and in history.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from desktop.core.serving.metering import RequestListener, RequestRecord

log = logging.getLogger("switchyard.requests")


class RequestSource(Protocol):
    """What the log listens to (the endpoint's ProxyServer), named here so that the log never imports the proxy."""

    def subscribe(self, listener: RequestListener) -> None: ...

    def subscribe_started(self, listener: RequestListener) -> None: ...


DEFAULT_CAPACITY = 1000
DEFAULT_HISTORY_KEEP = 100_000

RequestEventListener = Callable[[str, RequestRecord], None]  # ("started" | "finished", record)
EventListener = Callable[[dict[str, Any]], None]  # an endpoint event (`RequestLog.note`)
DEFAULT_EVENTS = 200


class RequestSink(Protocol):
    """Where finished requests are kept (`desktop.core.storage.history.Store` satisfies it)."""

    def add_requests(self, rows: Sequence[Mapping[str, Any]]) -> object: ...

    def prune_requests(self, keep: int) -> object: ...

    # optional: `add_events(rows)` keeps the endpoint's events (Store has it); a sink without it keeps requests only


class _Flush:
    """A marker in the writer's queue: set once everything queued before it is stored."""

    def __init__(self) -> None:
        self.done = threading.Event()


class _Event:
    """An endpoint event in the writer's queue."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data


class RequestLog:
    """In memory: the requests in flight and the last `capacity` finished ones; in history: all finished ones
    (the newest `history_keep`). Thread-safe; listeners are called on the thread that reported the event."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, sink: RequestSink | None = None,
                 history_keep: int = DEFAULT_HISTORY_KEEP) -> None:
        self.capacity = capacity
        self.history_keep = history_keep
        self._sink = sink
        self._lock = threading.Lock()
        self._inflight: dict[int, RequestRecord] = {}
        self._recent: deque[RequestRecord] = deque(maxlen=capacity)
        self._listeners: list[RequestEventListener] = []
        self._events: deque[dict[str, Any]] = deque(maxlen=DEFAULT_EVENTS)
        self._event_listeners: list[EventListener] = []
        self._queue: queue.SimpleQueue[RequestRecord | _Event | _Flush | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self.finished_count = 0

    # --- feeding ---
    def attach(self, proxy: RequestSource) -> None:
        """Listen to `proxy` (before it starts) and start the history writer."""
        proxy.subscribe_started(self.started)
        proxy.subscribe(self.finished)
        self.start()

    def started(self, record: RequestRecord) -> None:
        with self._lock:
            self._inflight[record.seq] = record
        self._notify("started", record)

    def finished(self, record: RequestRecord) -> None:
        with self._lock:
            self._inflight.pop(record.seq, None)
            self._recent.append(record)
            self.finished_count += 1
        if self._sink is not None:
            self._queue.put(record)
        self._notify("finished", record)

    def note(self, event: Mapping[str, Any]) -> None:
        """An endpoint event (a dict with `kind` and `t`, e.g. an autopilot decision): kept with the requests."""
        data = dict(event)
        with self._lock:
            self._events.append(data)
        if self._sink is not None and hasattr(self._sink, "add_events"):
            self._queue.put(_Event(data))
        for listener in list(self._event_listeners):
            try:
                listener(data)
            except Exception:
                log.exception("event listener failed")

    def events(self, limit: int | None = None, since: float = 0.0) -> list[dict[str, Any]]:
        """The last events (t > since), oldest first."""
        with self._lock:
            events = [e for e in self._events if float(e.get("t", 0.0)) > since]
        return events[-limit:] if limit else events

    def subscribe_events(self, listener: EventListener) -> None:
        self._event_listeners.append(listener)

    # --- reading ---
    def recent(self, limit: int | None = None, after: int = 0) -> list[RequestRecord]:
        """Finished requests with `seq > after`, oldest first; the last `limit` of them."""
        with self._lock:
            records = [r for r in self._recent if r.seq > after] if after else list(self._recent)
        return records[-limit:] if limit is not None and limit > 0 else records

    def inflight(self) -> list[RequestRecord]:
        """Requests still being answered (or waiting for an engine), oldest first."""
        with self._lock:
            return sorted(self._inflight.values(), key=lambda r: r.seq)

    def subscribe(self, listener: RequestEventListener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: RequestEventListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self, kind: str, record: RequestRecord) -> None:
        for listener in list(self._listeners):
            try:
                listener(kind, record)
            except Exception:  # a broken view must not break the endpoint
                log.exception("request log listener failed")

    # --- history writer ---
    def start(self) -> None:
        if self._sink is None or self._writer is not None:
            return
        self._writer = threading.Thread(target=self._write_loop, name="switchyard-requestlog", daemon=True)
        self._writer.start()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every finished request reported so far is in history; False if not within `timeout`."""
        if self._writer is None:
            return True
        marker = _Flush()
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def stop(self) -> None:
        """Store what is left and end the writer."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(None)
            writer.join(timeout=15)

    def _write_loop(self) -> None:
        assert self._sink is not None
        sink = self._sink
        running = True
        while running:
            items = [self._queue.get()]  # blocks until there is something
            while True:  # and takes whatever else piled up meanwhile: one transaction for all of it
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows = [item.to_json() for item in items if isinstance(item, RequestRecord)]
            events = [item.data for item in items if isinstance(item, _Event)]
            running = None not in items
            if rows:
                try:
                    sink.add_requests(rows)
                    sink.prune_requests(self.history_keep)
                except Exception:
                    log.exception("could not store %d request records", len(rows))
            if events:
                try:
                    sink.add_events(events)  # type: ignore[attr-defined]  # only queued when the sink has it
                except Exception:
                    log.exception("could not store %d endpoint events", len(events))
            for item in items:
                if isinstance(item, _Flush):
                    item.done.set()
