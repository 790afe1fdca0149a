"""How the endpoint moves from one engine to another, as small functions over the manager's state (its EngineSlots):
which kind of switch a checked plan needs (`kind_of`: a warm standby takes over, a sleeping vLLM is woken,
stop-first when the two do not fit together, else warm), and each kind (`warm`, `stop_first`) with the steps they
share (`promote`, `drain_or_cut`, `put_away`, `wake`, `restore`, `keep_or_stop`). `switch_preview` and the switch
itself decide with the same `kind_of`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import httpx
import psutil

from desktop.core.common import unixhttp
from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.fit import estimate
from desktop.core.planning.launch import SECRET_ENV, PlanRefused, planned_command
from desktop.core.planning.planner import ask_key
from desktop.core.planning.sleep import plan_after_sleep
from desktop.core.planning.swap import engine_need, plan_facts
from desktop.core.runtime.proctree import tree_rss
from desktop.core.runtime.supervisor import EngineState
from desktop.core.runtime.telemetry import Telemetry
from desktop.core.serving import capabilities
from desktop.core.serving.budget import MemoryBudget, memory_allows_standby
from desktop.core.serving.managed import EngineSlots, ManagedEngine, SwitchResult
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.router import Upstream

log = logging.getLogger("switchyard.endpoint")


class SwitchHost(Protocol):
    """What the switch steps need of the engine manager (serving.endpoint.EndpointManager, the one implementation):
    its roles and their lock, its proxy and settings, and its own ways to check, launch and retire an engine and to
    say what happened. Described here so that this module does not import the manager that calls it."""

    active: ManagedEngine | None
    standby: ManagedEngine | None
    sleeping: ManagedEngine | None
    plan: LaunchPlan | None
    last_error: str | None
    capability_note: str | None

    @property
    def slots(self) -> EngineSlots: ...
    @property
    def lock(self) -> threading.RLock: ...
    @property
    def down(self) -> threading.Event: ...
    @property
    def proxy(self) -> ProxyServer: ...
    @property
    def route(self) -> str | None: ...
    @property
    def budget(self) -> MemoryBudget | None: ...
    @property
    def cold_starts(self) -> dict[str, float]: ...
    @property
    def drain_timeout(self) -> float: ...
    @property
    def keep_standby(self) -> bool: ...
    @property
    def failover(self) -> bool: ...
    @property
    def telemetry(self) -> Telemetry | None: ...
    @property
    def redetect(self) -> Callable[[], HardwareSnapshot] | None: ...

    def emit(self, state: str, message: str) -> None: ...
    def set_upstream(self, upstream: Upstream | None, down_reason: str | None = None, idle: bool = False) -> None: ...
    def machine(self) -> HardwareSnapshot: ...
    def check(self, plan: LaunchPlan, *, engine: str | None = None, model: str | None = None,
              changes: Mapping[str, Any] | None = None, hardware: HardwareSnapshot | None = None) -> LaunchPlan: ...
    def launch(self, plan: LaunchPlan) -> ManagedEngine: ...
    def retire(self, managed: ManagedEngine, drain: bool = False) -> None: ...
    def beside_sleeper(self, sleeper: ManagedEngine, modelled: HardwareSnapshot) -> HardwareSnapshot: ...


class CapabilityRefused(SwitchyardError):
    """The engine a switch would move to refused a capability the traffic uses: nothing moved."""


def shown(plan: LaunchPlan) -> str:
    """The model as a person typed it (`demo`, a path), for messages."""
    return plan.model or str(plan.model_path)


def same(managed: ManagedEngine | None, plan: LaunchPlan) -> bool:
    """`managed` serves what `plan` asks for, and is ready."""
    return managed is not None and ask_key(managed.plan) == ask_key(plan) and \
        managed.process.state == EngineState.READY


def kind_of(m: SwitchHost, plan: LaunchPlan) -> str:
    """standby (a warm one takes over) | wake (a sleeping vLLM) | stop-first (both do not fit) | warm."""
    with m.lock:
        old, standby, sleeping = m.active, m.standby, m.sleeping
    if same(standby, plan):
        return "standby"
    if old is not None and same(sleeping, plan):
        return "wake"
    if old is not None and m.budget is not None and not m.budget.fits([old.plan, plan]):
        return "stop-first"
    return "warm"


def preview(m: SwitchHost, plan: LaunchPlan) -> dict[str, Any]:
    """The kind of switch to `plan`, about how long it takes, and the exact argv and env it starts."""
    kind = kind_of(m, plan)
    old = m.active
    cold = m.cold_starts.get(plan.engine)
    took = f"about {cold:.0f} s" if cold else "a cold start"
    result: dict[str, Any]
    if kind == "standby":
        result = {"kind": kind, "expected_s": 0.0, "gap_s": 0.0, "message": f"instant: {plan.engine} is already warm"}
    elif kind == "wake":
        result = {"kind": kind, "expected_s": 2.0, "gap_s": 2.0,
                  "message": f"stop-first, waking the sleeping {plan.engine} (about a second; requests wait)"}
    elif kind == "stop-first" and old is not None and m.budget is not None:
        result = {"kind": kind, "expected_s": cold, "gap_s": cold,
                  "message": f"stop-first: both engines do not fit ({m.budget.describe([old.plan, plan])}); "
                             f"requests wait for {took}"}
    else:
        result = {"kind": "warm", "expected_s": cold, "gap_s": 0.0,
                  "message": f"warm: {plan.engine} starts beside the current engine ({took}); no request waits"}
    command = planned_command(plan)
    used = m.proxy.capabilities.ago(traffic_key(m))
    result["capabilities"] = capabilities.table(used, active=old.plan if old else None, target=plan)
    result.update(plan=plan.to_json(), argv=command.argv,
                  env={k: ("***" if k in SECRET_ENV else v) for k, v in command.env.items()})
    return result


def promote(m: SwitchHost, new: ManagedEngine) -> None:
    """`new` serves from now on: the active role, the proxy's upstream, an endpoint that is no longer down."""
    with m.lock:
        m.active = new
        m.plan = new.plan
    m.set_upstream(new.upstream)
    m.down.clear()  # a switch also revives an endpoint whose engine had died
    m.capability_note = None  # what a crash failover's check said is about the engine that served then


def warm(m: SwitchHost, old: ManagedEngine | None, plan: LaunchPlan, kind: str, started: float
         ) -> SwitchResult:
    """The new engine starts (or the warm standby takes over) while the old one serves; then the old one drains
    and stops, or stays warm when memory allows."""
    m.emit("switching", f"switching to {plan.engine} on {shown(plan)}")
    reused = kind == "standby"
    if reused:
        new = m.standby
        assert new is not None
        m.standby = None
    else:
        try:
            new = m.launch(plan)
        except SwitchyardError as exc:
            m.last_error = str(exc)
            m.emit("serving" if old else "down", f"switch to {plan.engine} failed, "
                   f"{old.upstream.name if old else 'nothing'} keeps serving: {exc.message}")
            raise
    probed, why = capability_check(m, new)  # also when nothing serves: no request waits on it then either
    if why is not None:  # the old engine keeps serving (or nothing does, as before); a warm standby stays one
        if reused:
            park(m, new, "standby")
        else:
            m.retire(new)
        raise refused(m, old, plan, why, served=old is not None)
    promote(m, new)  # from here on, new requests go to the new engine
    drained, kept, cut = True, False, 0
    if old is not None:
        m.slots.release(old)
        drained, cut = drain_or_cut(m, old)
        kept = keep_or_stop(m, old)
    m.emit("serving", f"{new.upstream.name} serves {m.proxy.url}/v1")
    return SwitchResult(old.upstream.engine if old else None, new.upstream.engine,
                        round(time.monotonic() - started, 3), reused, drained, kept,
                        None if reused else new.process.cold_start, kind="standby" if reused else "warm",
                        cut_requests=cut, retried_smaller=new.retried, probed=probed)


def stop_first(m: SwitchHost, old: ManagedEngine, plan: LaunchPlan, started: float,
               sleeping: ManagedEngine | None) -> SwitchResult:
    """New requests wait at the endpoint, the old engine drains and stops (or sleeps), the new one starts (or the
    sleeping one wakes), requests flow. When the new one fails, the old one comes back. A new engine beside a
    sleeping vLLM is planned again against the memory read after the sleep."""
    why = f"a sleeping {plan.engine} is woken" if sleeping is not None else \
        f"both do not fit: {m.budget.describe([old.plan, plan]) if m.budget else ''}"
    m.emit("switching", f"stop-first switch to {plan.engine} on {shown(plan)} ({why}); new requests wait "
                        "at the endpoint meanwhile")
    gap_started = time.monotonic()
    m.set_upstream(None)  # new requests wait (none fail) until the new engine serves
    m.proxy.mark_loading(m.route)
    if sleeping is not None:
        with m.lock:  # out of the sleeping slot first: putting `old` to sleep must not stop the one to wake
            m.slots.release(sleeping, "waking")
    m.slots.release(old)
    drained, cut = drain_or_cut(m, old)
    slept = put_away(m, old, None if sleeping is not None else plan)
    level = sleeping.sleep_level if sleeping is not None else None  # how it slept: how it goes back if refused
    try:
        new = wake(m, sleeping) if sleeping is not None else None
        if new is None:
            new, slept = launch_beside(m, plan, old if slept else None)
    except SwitchyardError as exc:
        m.last_error = str(exc)
        restored = restore(m, old, slept)
        m.emit("serving" if restored else "down", f"switch to {plan.engine} failed ({exc.message}); "
               + (f"{old.upstream.name} serves again" if restored else "the old engine did not come back"))
        raise
    probed, refusal = capability_check(m, new)
    if refusal is not None:  # requests still wait: the old engine comes back before any moves
        if not (level and back_to_sleep(m, new, level)):  # a woken sleeper sleeps again, as it was
            m.retire(new)
        raise refused(m, old if restore(m, old, slept) else None, plan, refusal)
    promote(m, new)
    gap = round(time.monotonic() - gap_started, 3)
    m.emit("serving", f"{new.upstream.name} serves {m.proxy.url}/v1 (stop-first; no engine served for "
                      f"{gap:.1f} s, requests waited)")
    return SwitchResult(old.upstream.engine, new.upstream.engine, round(time.monotonic() - started, 3),
                        False, drained, False, None if sleeping is not None else new.process.cold_start,
                        kind="stop-first", gap_s=gap, cut_requests=cut, woke=sleeping is not None,
                        old_sleeping=slept, retried_smaller=new.retried, probed=probed)


def launch_beside(m: SwitchHost, plan: LaunchPlan, sleeper: ManagedEngine | None) -> tuple[ManagedEngine, bool]:
    """Start `plan`, checked against the memory free now (beside `sleeper`, when one sleeps). When the memory read
    after the sleep leaves no room after all (the sleeper holds more than the fit modelled), the sleeper is stopped
    and the plan checked again. Returns the engine and whether `sleeper` still sleeps."""
    try:
        return m.launch(plan), sleeper is not None
    except PlanRefused as exc:
        if sleeper is None or m.sleeping is not sleeper:
            raise
        log.warning("%s does not fit beside the sleeping %s (%s); stopping that one instead",
                    shown(plan), sleeper.upstream.name, exc.message)
        m.retire(sleeper)
        return m.launch(plan), False


def drain_or_cut(m: SwitchHost, old: ManagedEngine) -> tuple[bool, int]:
    """Let in-flight requests on `old` finish until the drain deadline; end the rest with a retryable error."""
    if m.proxy.drain(old.upstream, m.drain_timeout):
        return True, 0
    cut = m.proxy.cut(old.upstream, f"the endpoint switched engines and this request was still running "
                                    f"after the {m.drain_timeout:g} s drain deadline; retry it")
    log.warning("%d request(s) on %s cut at the drain deadline", cut, old.upstream.name)
    return False, cut


def engine_request(managed: ManagedEngine, path: str, body: dict[str, Any] | None, timeout: float
                   ) -> tuple[int | None, str]:
    """POST `body` to the engine itself, on its private socket (desktop.core.common.unixhttp): (HTTP status, the
    answer's text), or (None, why) when it did not answer."""
    key = managed.process.plan.api_key
    try:
        url = managed.process.base_url
        with unixhttp.client(url, timeout=timeout) as client:
            response = client.post(unixhttp.http_url(url) + path, json=body,
                                   headers={"Authorization": f"Bearer {key}"} if key else None)
    except httpx.HTTPError as exc:
        return None, str(exc) or type(exc).__name__
    return response.status_code, response.text[:4096]


def engine_post(managed: ManagedEngine, path: str, timeout: float = 120.0, body: dict[str, Any] | None = None
                ) -> bool:
    status, text = engine_request(managed, path, body, timeout)
    if status is None:
        log.warning("%s %s failed: %s", managed.upstream.name, path, text)
    elif status >= 300:
        log.warning("%s %s answered HTTP %d", managed.upstream.name, path, status)
    return status is not None and status < 300


def traffic_key(m: SwitchHost) -> str:
    """The name the endpoint notes this manager's traffic under (its route, or the served name)."""
    return m.route or m.proxy.model_name


def capability_check(m: SwitchHost, new: ManagedEngine) -> tuple[tuple[str, ...], str | None]:
    """The capabilities this model's traffic used in the last hour, and why `new` cannot take that traffic over
    (serving.capabilities: one short request per capability), or None."""
    used = m.proxy.capabilities.recent(traffic_key(m))
    if not used:
        return (), None
    refusal = capabilities.probe(
        lambda body: engine_request(new, "/v1/chat/completions", body, capabilities.PROBE_TIMEOUT_S),
        new.upstream.served_model_name, used)
    if refusal is None:
        log.info("%s answers what the traffic used (%s)", new.upstream.name, ", ".join(used))
        return tuple(used), None
    return tuple(used), refusal.message(new.plan.engine)


def refused(m: SwitchHost, old: ManagedEngine | None, plan: LaunchPlan, why: str, served: bool = True
            ) -> CapabilityRefused:
    """Say that the switch to `plan` was refused and why (`old`: the engine that serves on; None when it did not
    come back, or, with `served` False, when nothing served before the switch either); the error to raise."""
    m.last_error = why
    after = f"{old.upstream.name} keeps serving" if old else \
        "and the old engine did not come back" if served else "nothing serves, as before"
    m.emit("serving" if old else "down", f"switch to {plan.engine} refused, {after}: {why}")
    return CapabilityRefused(why, "the traffic of the last hour used it: a switch must not break those clients")


def sleep_choice(m: SwitchHost, old: ManagedEngine, plan: LaunchPlan | None
                 ) -> tuple[int | None, HardwareSnapshot | None]:
    """How to put `old` away before `plan` starts: the vLLM sleep level and the machine the next engine would find
    beside the sleeper (the fit's model of it), or (None, None) to stop it. Level 1 pins the weights in host RAM:
    only when RAM has room for them beside the next engine's RAM part (read now); else level 2 (weights dropped,
    reloaded at the wake). Either level leaves the CUDA context and graph pool on the GPU: when the next plan does
    not fit beside them, the vLLM is stopped instead."""
    if not old.can_sleep or old.process.state != EngineState.READY:
        return None, None
    base = m.machine()  # the old engine's memory counted as free: what it frees by sleeping is modelled below
    try:
        ram_now = int(m.redetect().ram_available_bytes) if m.redetect is not None else base.ram_available_bytes
        next_ram = int(engine_need(plan, base).ram) if plan is not None else 0
        level, beside = plan_after_sleep(estimate(plan_facts(old.plan), base, old.plan),
                                         replace(base, ram_available_bytes=ram_now), next_host_bytes=next_ram)
        if level is not None and plan is not None:
            m.check(plan, hardware=beside)  # PlanRefused: it would not fit beside what the sleeper keeps
    except SwitchyardError as exc:  # a refusal above, or a model whose facts cannot be read: stop it
        log.info("%s is stopped, not put to sleep: %s", old.upstream.name, exc.message)
        return None, None
    return level, beside


def put_away(m: SwitchHost, old: ManagedEngine, plan: LaunchPlan | None = None) -> bool:
    """Free the old engine's memory before `plan` starts: sleep a vLLM that has sleep mode (at the level
    `sleep_choice` finds, then read the memory again for the next plan), stop anything else. True when it
    sleeps."""
    level, beside = sleep_choice(m, old, plan)
    if level is not None and beside is not None and engine_post(old, f"/sleep?level={level}"):
        old.sleep_level = level
        park(m, old, "sleeping")
        m.beside_sleeper(old, beside)
        return True
    m.retire(old)
    return False


def park(m: SwitchHost, engine: ManagedEngine, slot: str) -> None:
    """Put `engine` in the manager's `slot` ("sleeping" or "standby"); the one it replaces there is stopped."""
    with m.lock:
        previous = getattr(m, slot)
        setattr(m, slot, engine)
    if previous is not None and previous is not engine:
        m.retire(previous)


def wake(m: SwitchHost, sleeping: ManagedEngine) -> ManagedEngine | None:
    """Wake a sleeping vLLM (POST /wake_up; after a level-2 sleep: its weights' memory, vLLM's reload_weights,
    then its KV cache, as vLLM's sleep-mode docs say); None (and it is stopped) when it does not wake."""
    with m.lock:
        m.slots.release(sleeping, "waking")
    steps = [("/wake_up", None)] if sleeping.sleep_level != 2 else [
        ("/wake_up?tags=weights", None), ("/collective_rpc", {"method": "reload_weights"}),
        ("/wake_up?tags=kv_cache", None)]
    if sleeping.process.state == EngineState.READY and all(engine_post(sleeping, path, body=body)
                                                          for path, body in steps):
        sleeping.sleep_level = 0
        return sleeping
    m.retire(sleeping)
    return None


def back_to_sleep(m: SwitchHost, engine: ManagedEngine, level: int) -> bool:
    """Put a woken vLLM the capability check refused back to sleep at the level it slept (its wake stays about a
    second for a later switch); False when it does not go to sleep (then it is stopped)."""
    if engine.process.state != EngineState.READY or not engine_post(engine, f"/sleep?level={level}"):
        return False
    engine.sleep_level = level
    park(m, engine, "sleeping")
    return True


def restore(m: SwitchHost, old: ManagedEngine, slept: bool) -> bool:
    """After a failed stop-first switch: bring the old engine back (wake it, or start it again)."""
    try:
        back = wake(m, old) if slept else None
        if back is None:
            back = m.launch(old.plan)
    except SwitchyardError as exc:
        log.error("the old engine did not come back: %s", exc)
        m.set_upstream(None, down_reason=f"a switch failed and the old engine did not come back: {exc.message}",
                       idle=m.route is not None)
        m.down.set()
        return False
    with m.lock:
        m.active = back
    m.set_upstream(back.upstream)
    return True


def keep_or_stop(m: SwitchHost, old: ManagedEngine) -> bool:
    """After a warm switch: keep the old engine as the warm standby when asked and memory allows, else stop it."""
    available = float(psutil.virtual_memory().available)
    if m.keep_standby and old.process.state == EngineState.READY and \
            memory_allows_standby(float(tree_rss(old.process.pid) or 0), available):
        park(m, old, "standby")
        return True
    m.retire(old)
    return False


def on_crash(m: SwitchHost, managed: ManagedEngine) -> None:
    """An engine died (called on its log thread: it must not be stopped here). A standby or sleeping one is just
    dropped; the active one is replaced by the warm standby with failover, else the endpoint is down (one model of
    several: it loads again on its next request)."""
    reason = managed.process.failure()
    with m.lock:
        if managed is m.standby or managed is m.sleeping:
            log.warning("%s %s died: %s", managed.role, managed.upstream.name, reason.message)
            m.slots.release(managed, "crashed")
            m.slots.retired.append(managed)
            return
        if managed is not m.active:
            return
        m.last_error = str(reason)
        standby = m.standby
        if m.failover and standby is not None and standby.process.state == EngineState.READY:
            m.slots.release(managed, "crashed")
            m.active = standby  # leaves the standby role
            m.slots.retired.append(managed)
        else:
            standby = None
            m.capability_note = None  # about an engine that no longer serves
            if m.route is not None:  # a model of several: the next request for it loads it again
                m.active = None
                m.slots.retired.append(managed)
    if m.telemetry is not None:
        threading.Thread(target=m.telemetry.unwatch, args=(managed.upstream.name,), daemon=True).start()
    if standby is not None:
        m.set_upstream(standby.upstream)
        used = m.proxy.capabilities.recent(traffic_key(m))
        m.capability_note = f"capability check: not checked before the crash failover; checking " \
                            f"{', '.join(used)} now" if used else None
        m.emit("failover", f"{managed.upstream.name} died ({reason.message}); {standby.upstream.name} took over"
               + (f" ({m.capability_note})" if used else ""))
        if used:  # probed off this (the dead engine's log) thread: its requests already go to the standby
            threading.Thread(target=check_after_failover, args=(m, standby), name="switchyard-failover-check",
                             daemon=True).start()
        return
    m.set_upstream(None, down_reason=reason.message, idle=m.route is not None)
    m.emit("down", f"{reason.message} ({reason.hint})")
    m.down.set()


def check_after_failover(m: SwitchHost, new: ManagedEngine) -> None:
    """The capability check of a crash failover, after the standby took over: the engine that answered the traffic
    is gone, so requests go on to the standby at once rather than wait for a probe (and then for nothing better).
    What the probe finds is said in status, the endpoint's log and the Serve page; nothing when a switch or a close
    came first (the engine then no longer serves)."""
    probed, why = capability_check(m, new)
    found = f"{new.upstream.name} answers {', '.join(probed)}" if why is None else \
        f"{why}; {new.upstream.name} serves on, and requests that use it fail until a switch to an engine that " \
        "answers them"
    note = f"capability check after the crash failover: {found}"
    with m.lock:
        if m.active is not new:  # switched away, died or closed meanwhile (close() empties every role)
            return
        m.capability_note = note
    m.emit("serving" if why is None else "failover", note)  # a refusal: a warning, as the failover was
