"""`switchyard profile [--since 7d] [--model NAME] [--json]`: the workload the endpoint actually served, from its
request log in history (see desktop.core.measure.profile)."""

from __future__ import annotations

import argparse
import sys
import time

from desktop.commands._common import emit_json


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("profile", help="the served workload from the endpoint's request log: "
                                                   "concurrency, token lengths, burstiness, lifetimes")
    parser.add_argument("--since", default="7d", help="how far back: 7d (default), 12h, 30m, 90s")
    parser.add_argument("--model", help="only requests that asked for this model name")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from desktop.core.measure.profile import duration, load_profile, parse_since
    from desktop.core.storage.history import Store

    since = parse_since(args.since)
    with Store() as store:
        profile = load_profile(store, since=since, model=args.model)
    if args.json:
        emit_json(profile.to_json())
        return 0
    print(profile.summary_line())
    if profile.requests:
        print(f"  window: {time.strftime('%Y-%m-%d %H:%M', time.localtime(profile.first_t or 0))} .. "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(profile.last_t or 0))}; "
              f"{profile.failed} failed")
        print(f"  requests/min: mean {profile.mean_rpm:.2f}, peak {profile.peak_rpm:.2f} "
              f"(burstiness {profile.burstiness if profile.burstiness is not None else '-'})")
    c = profile.concurrency
    if c is not None:
        print(f"  in flight: p50 {c.p50:g}, p95 {c.p95:g}, max {c.max} (busy {c.busy_share:.0%} of the time)")
    for name, stats in (("prompt tokens", profile.prompt_tokens), ("output tokens", profile.output_tokens)):
        if stats is not None:
            print(f"  {name}: p50 {stats.p50:g}, p95 {stats.p95:g}, max {stats.max} "
                  f"(log-normal mu {stats.lognormal_mu:.2f}, sigma {stats.lognormal_sigma:.2f})")
    if profile.lifetimes:
        life = profile.lifetime_p50_s
        print(f"  launches: {len(profile.lifetimes)}, restarts {profile.restarts}"
              f"{f' ({profile.restarts_per_day:g}/day)' if profile.restarts_per_day is not None else ''}, "
              f"median lifetime {duration(life) if life is not None else '-'} (estimated)")
    if profile.shared_prefix_share is not None:
        print(f"  shared prefix: {profile.shared_prefix_share:.0%} of {profile.captured_bodies} captured prompts")
    for note in profile.notes:
        print(f"  note: {note}", file=sys.stderr)
    return 0
