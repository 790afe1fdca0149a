"""A test that hangs in native code (as the Qt destructor deadlock did) ends the run within pytest's
`faulthandler_timeout`, prints every thread's stack, and leaves no process behind once `scripts/contain.sh` (what
.ci/run wraps the test command in) returns.

pytest-timeout cannot end such a hang: its signal handler needs the main thread to run bytecode and its thread
method needs the GIL, which the hung main thread holds. faulthandler's watchdog is a C thread that needs neither.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ON_PURPOSE = "SWITCHYARD_DEADLOCK_ON_PURPOSE"  # the path of a file to write the stray child's pid to
ROOT = Path(__file__).resolve().parent.parent


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie has exited; init reaps it
    except psutil.NoSuchProcess:
        return False


def _bystander(never: threading.Event) -> None:
    never.wait()  # a second thread for the dump to show (waits with the GIL released)


@pytest.mark.skipif(not os.environ.get(ON_PURPOSE), reason=f"deadlocks on purpose: set {ON_PURPOSE}=PIDFILE")
def test_deadlocks_in_native_code_on_purpose() -> None:
    # A child in a session of its own, as an engine is: contain.sh must stop it after the hung run is ended.
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],  # noqa: S603
                             start_new_session=True)
    Path(os.environ[ON_PURPOSE]).write_text(str(stray.pid))
    threading.Thread(target=_bystander, args=(threading.Event(),), name="bystander", daemon=True).start()
    libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call, as the hung destructor did
    mutex = ctypes.create_string_buffer(64)  # a zeroed pthread_mutex_t is PTHREAD_MUTEX_INITIALIZER (glibc)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # a normal mutex locked again by its owner: blocks for good


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="contain.sh reads /proc; the mutex is glibc's")
def test_a_native_deadlock_fails_within_the_limit_with_every_threads_stack(tmp_path: Path) -> None:
    pidfile = tmp_path / "stray.pid"
    limit = 5
    started = time.monotonic()
    run = subprocess.run(  # noqa: S603 - our own script and interpreter
        [str(ROOT / "scripts" / "contain.sh"), sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         "-o", f"faulthandler_timeout={limit}", "-o", "faulthandler_exit_on_timeout=true",
         f"{__file__}::test_deadlocks_in_native_code_on_purpose"],
        cwd=ROOT, env={**os.environ, ON_PURPOSE: str(pidfile)}, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert took < 60, f"the hung run took {took:.0f} s to end"
    assert f"Timeout (0:00:0{limit})!" in output, output
    stacks = re.findall(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):", output, re.M)
    assert len(stacks) >= 2, output  # the hung main thread and the bystander at least
    assert "in test_deadlocks_in_native_code_on_purpose" in output
    assert "in _bystander" in output
    assert not _running(int(pidfile.read_text())), "contain.sh left the hung run's child process running"
    assert "contain: stopping" in output


COLLECT_ON_PURPOSE = "SWITCHYARD_COLLECT_OFF_MAIN_ON_PURPOSE"


@pytest.mark.skipif(not os.environ.get(COLLECT_ON_PURPOSE), reason=f"trips the guard on purpose: {COLLECT_ON_PURPOSE}=1")
def test_collects_on_a_worker_thread_on_purpose() -> None:
    import gc

    worker = threading.Thread(target=gc.collect, name="collects-on-purpose")
    worker.start()
    worker.join()


def test_the_guard_fails_a_test_during_which_a_collection_starts_off_the_main_thread() -> None:
    run = subprocess.run(  # noqa: S603 - our own interpreter
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         f"{__file__}::test_collects_on_a_worker_thread_on_purpose"],
        cwd=ROOT, env={**os.environ, COLLECT_ON_PURPOSE: "1"}, capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "1 garbage collection(s) started off the main thread" in output
    assert "collection on thread 'collects-on-purpose'" in output
    assert "1 passed, 1 error" in output  # the test itself ran; its teardown failed it


def test_a_contained_command_hears_sigint() -> None:
    """contain.sh starts the command in the background of a shell without job control, where SIGINT starts
    ignored; the tests send SIGINT to `switchyard serve` and expect it to stop."""
    run = subprocess.run(  # noqa: S603 - our own script and interpreter
        [str(ROOT / "scripts" / "contain.sh"), sys.executable, "-c",
         "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"],
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"
