"""A model thread that dies fails the calls queued to it and every call after, instead of
leaving their callers waiting forever."""

from __future__ import annotations

import threading

import pytest
from pagedserve.worker_svc.model_thread import ModelThread


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
