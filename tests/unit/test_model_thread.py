"""A model thread that dies fails the calls queued to it and every call after, instead of
leaving their callers waiting forever."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from pagedserve.worker_svc.model_thread import ModelThread

REPO = Path(__file__).resolve().parents[2]


def test_a_thread_whose_initializer_raises_fails_every_call_queued_and_after():
    started = threading.Event()
    release = threading.Event()

    def initializer():
        started.set()
        release.wait(5)
        raise OSError("no such device")

    thread = ModelThread("dying", initializer)
    started.wait(5)
    queued = thread.submit(lambda: 1)  # queued while the initializer runs
    release.set()
    with pytest.raises(RuntimeError, match="model thread dying died: OSError"):
        queued.result(timeout=5)
    with pytest.raises(RuntimeError, match="died"):
        thread.submit(lambda: 2).result(timeout=5)


def test_a_live_thread_runs_calls_in_order():
    thread = ModelThread("live")
    ran = []
    futures = [thread.submit(ran.append, i) for i in range(3)]
    for future in futures:
        future.result(timeout=5)
    thread.shutdown(wait=True)
    assert ran == [0, 1, 2]


def test_the_interpreter_exits_after_the_work_a_model_thread_was_given(tmp_path):
    """A worker collected on its own model thread stops that thread without joining it; exit
    must still wait for the teardown, or a daemon thread inside torch aborts the process."""
    done = tmp_path / "done"
    script = f"""
import pathlib, time
from pagedserve.worker_svc.model_thread import ModelThread

thread = ModelThread("exiting")

def teardown():
    thread.shutdown()  # as the worker's finalizer does on this thread
    time.sleep(0.5)
    pathlib.Path({str(done)!r}).write_text("ok")

thread.submit(teardown)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert done.read_text() == "ok"
