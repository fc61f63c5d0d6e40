"""`pagedserve serve` restarts a restartable child that died (a worker, the gateway) but not the
scheduler (it held the requests) and not a child that keeps dying; the API key and the admin
token reach the gateway alone."""

from __future__ import annotations

import asyncio

import pytest
from pagedserve.services.common.config import (
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    ShutdownConfig,
)
from pagedserve.services.gateway.config import (
    ADMIN_TOKEN_ENV,
    API_KEY_ENV,
    AdminConfig,
    GatewayConfig,
    HttpConfig,
)

from pagedserve import supervisor
from pagedserve.supervisor import (
    MAX_RESTARTS,
    RESTART_WINDOW_S,
    Child,
    restart_child,
    serve_stack,
    service_env,
)


@pytest.fixture
def spawned(monkeypatch):
    """Stands in for starting a process: records (role, address, argv) and returns a marker."""
    calls = []

    async def spawn(role, address, argv, secrets):
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


class _Exited:
    returncode = 0


def _gateway(**kw) -> GatewayConfig:
    """serve's gateway flags: any free ports, a short drain."""
    return GatewayConfig(port=0, shutdown=ShutdownConfig(drain_timeout_s=1.0), **kw)


def test_only_the_gateway_gets_the_api_key_and_the_admin_token(monkeypatch):
    """Workers and schedulers once inherited both (serve put them in its own environment)."""
    monkeypatch.setenv(API_KEY_ENV, "inherited-key")
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "inherited-token")
    envs = {}

    async def spawn(role, address, argv, secrets):
        envs.setdefault(role, service_env(secrets))
        return _Exited()

    async def not_serving(self, timeout_s):
        return False  # as if stopped during start-up: serve_stack stops the children at once

    monkeypatch.setattr(supervisor, "_spawn", spawn)
    monkeypatch.setattr(supervisor.Supervisor, "wait_serving", not_serving)
    config = EngineConfig(model=ModelConfig(model="m"), parallel=ParallelConfig(
        tensor_parallel_size=2))
    assert asyncio.run(serve_stack(
        config, _gateway(http=HttpConfig(api_key="flag-key"),
                         admin=AdminConfig(admin_token="flag-token")),
        0, 0, 10.0, internal_tls=False)) == 0
    assert set(envs) == {"worker", "scheduler", "gateway"}
    assert (envs["gateway"][API_KEY_ENV], envs["gateway"][ADMIN_TOKEN_ENV]) == (
        "flag-key", "flag-token")
    for role in ("worker", "scheduler"):
        assert API_KEY_ENV not in envs[role] and ADMIN_TOKEN_ENV not in envs[role]
        assert "flag-key" not in envs[role].values()
    assert envs["worker"]["PATH"] == supervisor.os.environ["PATH"]  # the rest is inherited
    assert supervisor.os.environ[API_KEY_ENV] == "inherited-key"  # our own stays as it was

    envs.clear()
    asyncio.run(serve_stack(config, _gateway(), 0, 0, 10.0, internal_tls=False))
    assert envs["gateway"][API_KEY_ENV] == "inherited-key"  # what the gateway read before
    assert API_KEY_ENV not in envs["scheduler"]


def test_serve_starts_prefill_and_decode_replicas_with_the_prefix_cache_on(monkeypatch):
    spawned = []

    async def spawn(role, address, argv, secrets):
        spawned.append((role, address, list(argv)))
        return _Exited()

    async def not_serving(self, timeout_s):
        return False

    monkeypatch.setattr(supervisor, "_spawn", spawn)
    monkeypatch.setattr(supervisor.Supervisor, "wait_serving", not_serving)
    config = EngineConfig(model=ModelConfig(model="m"))
    assert asyncio.run(serve_stack(config, _gateway(), 0, 0, 10.0, internal_tls=False,
                                   roles=["prefill", "decode", "decode"])) == 0
    schedulers = [argv for role, _, argv in spawned if role == "scheduler"]
    assert [argv[argv.index("--role") + 1] for argv in schedulers] == [
        "prefill", "decode", "decode"]
    assert all("--enable-prefix-caching" in argv for argv in schedulers)
    [gateway] = [argv for role, _, argv in spawned if role == "gateway"]
    assert len(gateway[gateway.index("--scheduler-address") + 1].split(",")) == 3
