"""`pagedserve serve` restarts a restartable child that died (a worker, the gateway) but not the
scheduler (it held the requests) and not a child that keeps dying."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve import supervisor
from pagedserve.supervisor import MAX_RESTARTS, RESTART_WINDOW_S, Child, restart_child


@pytest.fixture
def spawned(monkeypatch):
    """Stands in for starting a process: records (role, address, argv) and returns a marker."""
    calls = []

    async def spawn(role, address, argv):
        calls.append((role, address, list(argv)))
        return f"process {len(calls)}"

    monkeypatch.setattr(supervisor, "_spawn", spawn)
    return calls


def _child(role: str, restartable: bool = True) -> Child:
    return Child(role, "127.0.0.1:50053", ["--port", "50053"], process="process 0",
                 restartable=restartable)


@pytest.mark.parametrize("role", ["worker", "gateway"])
def test_a_stateless_child_restarts_on_its_address_until_it_keeps_dying(spawned, role):
    child = _child(role)
    for i in range(MAX_RESTARTS):
        assert asyncio.run(restart_child(child))
        assert child.process == f"process {i + 1}"
    assert spawned == [(role, "127.0.0.1:50053", ["--port", "50053"])] * MAX_RESTARTS
    assert not asyncio.run(restart_child(child))  # MAX_RESTARTS within the window: give up
    child.restart_times = [t - RESTART_WINDOW_S for t in child.restart_times]
    assert asyncio.run(restart_child(child))  # restarts long ago no longer count
    assert len(child.restart_times) == 1


def test_a_child_that_is_not_restartable_is_not_restarted(spawned):
    assert not asyncio.run(restart_child(_child("scheduler", restartable=False)))
    assert spawned == []
