"""`switchyard requests [--follow] [--json]`: the endpoint's request log — the last requests with time, model,
engine, status, prompt/output tokens, TTFT, duration and client — read from the running endpoint's control channel,
or from history when no endpoint runs. Core modules are imported when the command runs, not when the CLI starts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from desktop.commands import _numbers as N
from desktop.commands._common import cell


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("requests", help="the endpoint's last requests (TTFT, tokens, status, client)")
    parser.add_argument("-n", "--limit", type=N.whole(1, 1000), default=20, help="how many of the last requests (default 20)")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="keep printing requests as they finish (needs a running endpoint)")
    parser.add_argument("--history", action="store_true", help="read history even when an endpoint runs")
    parser.add_argument("--port", type=N.port, help="which endpoint, when several run")
    parser.add_argument("--json", action="store_true",
                        help="machine-readable output (with --follow: one JSON object per line)")
    parser.set_defaults(func=cmd_requests)


def cmd_requests(args: argparse.Namespace) -> int:
    from desktop.core.common.errors import SwitchyardError
    from desktop.core.serving import control

    discovery = None
    if not args.history:
        try:
            discovery = control.find_instance(args.port)
        except control.NoInstance:
            if args.follow:
                raise SwitchyardError("--follow needs a running endpoint, and none runs",
                                      "start one with `switchyard serve ... --endpoint`, or drop --follow to "
                                      "read the history") from None
            if args.port is not None:
                raise
    if discovery is None:
        return _from_history(args)
    client = control.ControlClient(discovery)
    data = client.requests(limit=args.limit)
    if args.follow:
        return _follow(args, client, data)
    if args.json:
        _print_json({"source": "endpoint", "url": discovery.url, **data})
        return 0
    _print_table(data["requests"], data["inflight"], data.get("events") or [])
    return 0


def _from_history(args: argparse.Namespace) -> int:
    from desktop.core.storage.history import Store

    with Store() as store:
        rows = store.requests(args.limit)
        events = store.events(args.limit)
    if args.json:
        _print_json({"source": "history", "inflight": [], "requests": rows, "events": events})
    else:
        if not rows:
            print("no requests in history yet", file=sys.stderr)
        _print_table(rows, [], events)
    return 0


def _follow(args: argparse.Namespace, client: Any, data: dict[str, Any]) -> int:
    """Print the last requests, then each one as it finishes, until Ctrl-C or the endpoint stops."""
    from desktop.core.common.errors import SwitchyardError

    records: list[dict[str, Any]] = data["requests"]
    after = max((r["seq"] for r in records), default=0)
    if not args.json:
        print(_HEADER)
    try:
        while True:
            for record in records:
                if args.json:
                    print(json.dumps(record), flush=True)
                else:
                    print(_line(record), flush=True)
            after = max([after, *(r["seq"] for r in records)])
            try:
                records = client.requests(limit=100, after=after, wait=25.0)["requests"]
            except SwitchyardError:
                print("the endpoint stopped", file=sys.stderr)
                return 0
    except KeyboardInterrupt:
        return 0


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


_HEADER = (f"{'TIME':8}  {'#':>5}  {'MODEL':16}  {'ENGINE':9}  {'STATUS':>6}  {'PROMPT':>6}  {'OUTPUT':>6}  "
           f"{'TTFT ms':>8}  {'TIME s':>7}  {'CLIENT':21}  REQUEST")


def _line(record: dict[str, Any]) -> str:
    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    in_flight = record.get("status") == 0
    status = "…" if in_flight else str(record.get("status"))
    ttft = record.get("ttft_s")
    line = (f"{time.strftime('%H:%M:%S', time.localtime(record['t']))}  {cell(record.get('seq') or '-'):>5}  "
            f"{cell(record.get('model') or '-')[:16]:16}  {cell(record.get('engine') or '-')[:9]:9}  {cell(status):>6}  "
            f"{num(record.get('prompt_tokens'), 'd'):>6}  {num(record.get('output_tokens'), 'd'):>6}  "
            f"{num(ttft * 1000 if isinstance(ttft, (int, float)) else None, '.0f'):>8}  "
            f"{'in flight' if in_flight else num(record.get('e2e_s'), '.2f'):>7}  "
            f"{cell(record.get('client') or '-'):21}  {cell(record.get('method'))} {cell(record.get('path'))}")
    if record.get("error") and not in_flight:
        line += f"  ({cell(record['error'])})"
    if record.get("note"):
        line += f"  [{cell(record['note'])}]"
    return line


def _event_line(event: dict[str, Any]) -> str:
    """An endpoint event (an autopilot decision) between the requests: its time, kind, action and reason."""
    return (f"{time.strftime('%H:%M:%S', time.localtime(float(event.get('t') or 0)))}  "
            f"{cell(event.get('kind') or 'event')}: {cell(event.get('action') or '-')} — {cell(event.get('reason') or '')}")


def _print_table(records: list[dict[str, Any]], inflight: list[dict[str, Any]],
                 events: list[dict[str, Any]] | None = None) -> None:
    print(_HEADER)
    first = records[0]["t"] if records else 0.0
    lines = [(float(e.get("t") or 0), 0, _event_line(e)) for e in events or [] if float(e.get("t") or 0) >= first]
    lines += [(float(r["t"]), 1, _line(r)) for r in records]
    for _t, _order, line in sorted(lines, key=lambda item: (item[0], item[1])):
        print(line)
    for record in inflight:
        print(_line(record))
