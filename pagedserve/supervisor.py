"""`pagedserve serve`: workers, schedulers and the gateway as supervised child processes of one
command: `data_parallel_size` engine replicas (a scheduler and its tensor-parallel workers each)
behind one gateway.

Each child runs in its own session, so a Ctrl-C reaches only the supervisor, which stops them
gateway first (it drains its streams). A child that exits on its own is started again on its
address, as Kubernetes restarts a container: the scheduler rebuilds a restarted worker, a
restarted scheduler takes its live workers over (worker_svc/worker.py: a new epoch, the model and
the KV cache kept), and the gateway reconnects to it. A child that keeps dying (more than
MAX_RESTARTS times in RESTART_WINDOW_S) stops the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.certificates import ThrowAwayCertificates
from pagedserve.services.common.config import MetricsConfig, TlsConfig
from pagedserve.services.gateway.config import (
    ADMIN_TOKEN_ENV,
    API_KEY_ENV,
    GatewayConfig,
    HttpConfig,
)
from pagedserve.services.rpc.roles import ROLES
from pagedserve.services.rpc.tls import internal_aio_channel, is_loopback

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0

GATEWAY_SECRETS = (API_KEY_ENV, ADMIN_TOKEN_ENV)  # environment variables only gateways get
_HEALTH_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                           ("grpc.max_reconnect_backoff_ms", 1000)]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def config_to_argv(config: Any) -> list[str]:
    """The flags from which from_args rebuilds `config`: a child gets the parent's configuration."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if dataclasses.is_dataclass(value):
            argv += config_to_argv(value)
        elif isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            if value:
                argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


@dataclass(slots=True)
class Child:
    role: str  # "worker", "scheduler", "gateway"
    address: str
    argv: Sequence[str]
    process: asyncio.subprocess.Process
    restartable: bool = False
    tls: TlsConfig | None = None  # the supervisor's certificates for its port, if it has TLS
    restart_times: list[float] = dataclasses.field(default_factory=list)  # monotonic
    secrets: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)  # env

    async def wait_serving(self, timeout_s: float) -> None:
        serving = asyncio.create_task(_watch_until_serving(self.address, self.tls))
        exited = asyncio.create_task(self.process.wait())
        try:
            done, _ = await asyncio.wait({serving, exited}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            serving.cancel()
            exited.cancel()
        if serving in done:
            serving.result()
        elif exited in done:
            raise RuntimeError(f"the {self.role} exited with code {self.process.returncode} "
                               f"before it was ready")
        else:
            raise TimeoutError(f"the {self.role} was not ready after {timeout_s:.0f} s")

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM (the child drains), then SIGKILL after timeout_s; its exit code."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout_s)
            except TimeoutError:
                logger.warning("the %s did not stop within %.0f s; killing it", self.role,
                               timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        return self.process.returncode


async def _watch_until_serving(address: str, tls: TlsConfig | None) -> None:
    async with internal_aio_channel(address, tls, _HEALTH_CHANNEL_OPTIONS) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), wait_for_ready=True)
        async for response in call:
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
    raise RuntimeError(f"{address} ended its health stream before serving")


def service_command(role: str, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "pagedserve.cli", role, *argv]


def service_env(secrets: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: ours without the gateway's secrets, plus the `secrets` it is
    given (only the gateway gets any)."""
    env = {name: value for name, value in os.environ.items() if name not in GATEWAY_SECRETS}
    return {**env, **(secrets or {}), "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "ERROR"}


def with_loopback_rendezvous(config: Any) -> Any:
    """`config` with the tensor-parallel ranks meeting on a free loopback port."""
    return dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, distributed_init_address=f"127.0.0.1:{free_port()}"))


async def _spawn(role: str, address: str, argv: Sequence[str], secrets: Mapping[str, str]
                 ) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        *service_command(role, argv), start_new_session=True, env=service_env(secrets))
    logger.info("started the %s (pid %d) on %s", role, process.pid, address)
    return process


async def start_child(role: str, address: str, argv: Sequence[str],
                      restartable: bool = False, tls: TlsConfig | None = None,
                      secrets: Mapping[str, str] | None = None) -> Child:
    secrets = dict(secrets or {})
    return Child(role, address, argv, await _spawn(role, address, argv, secrets), restartable,
                 tls, secrets=secrets)


async def restart_child(child: Child) -> bool:
    """False if it was not restarted (not restartable, or it keeps dying)."""
    now = time.monotonic()
    child.restart_times = [t for t in child.restart_times if now - t < RESTART_WINDOW_S]
    if not child.restartable or len(child.restart_times) >= MAX_RESTARTS:
        return False
    child.restart_times.append(now)
    child.process = await _spawn(child.role, child.address, child.argv, child.secrets)
    return True


class Supervisor:
    """Children stopped in reverse start order. Created inside the running loop, it turns
    SIGINT and SIGTERM into a stop request."""

    def __init__(self, stop_timeout_s: float) -> None:
        self.children: list[Child] = []
        self.stop_timeout_s = stop_timeout_s
        self._stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop_requested.set)

    async def start(self, role: str, address: str, argv: Sequence[str],
                    restartable: bool = False, tls: TlsConfig | None = None,
                    secrets: Mapping[str, str] | None = None) -> Child:
        child = await start_child(role, address, argv, restartable, tls, secrets)
        self.children.append(child)
        return child

    async def wait_serving(self, timeout_s: float) -> bool:
        """True once every child serves; False if a stop was requested first."""
        ready = asyncio.ensure_future(asyncio.gather(
            *(child.wait_serving(timeout_s) for child in self.children)))
        stop = asyncio.create_task(self._stop_requested.wait())
        done, _ = await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if ready not in done:
            ready.cancel()
            await asyncio.gather(ready, return_exceptions=True)  # retrieved: no stray warning
            return False
        ready.result()
        return True

    async def run_until_stopped(self) -> int:
        """Until SIGINT/SIGTERM (0) or a child exits on its own and is not restarted (1)."""
        stop = asyncio.create_task(self._stop_requested.wait())
        waits = {asyncio.create_task(child.process.wait()): child for child in self.children}
        try:
            while True:
                done, _ = await asyncio.wait({stop, *waits}, return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    logger.info("stopping: gateway first, then scheduler, then worker")
                    return 0
                for task in done:
                    child = waits.pop(task)
                    code = child.process.returncode
                    if not await restart_child(child):
                        logger.error("the %s exited on its own (code %s); stopping the others",
                                     child.role, code)
                        return 1
                    logger.error("the %s exited on its own (code %s); started it again "
                                 "(restart %d of %d within %.0f s)", child.role, code,
                                 len(child.restart_times), MAX_RESTARTS, RESTART_WINDOW_S)
                    waits[asyncio.create_task(child.process.wait())] = child
        finally:
            for task in (stop, *waits):
                task.cancel()

    async def stop(self) -> None:
        for child in reversed(self.children):
            code = await child.stop(self.stop_timeout_s)
            logger.info("the %s stopped (code %s)", child.role, code)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def example_commands(address: str, http_url: str | None = None, is_tls: bool = False
                     ) -> list[str]:
    """`is_tls`: the gateway's public port speaks TLS; CA.pem stands for the CA that signed
    its certificate."""
    prompt = "The capital of France is"
    request = json.dumps({"text": prompt, "sampling": {"max_tokens": 32, "temperature": 0}})
    client_tls = " --tls-ca CA.pem" if is_tls else ""
    commands = [
        f'pagedserve generate --address {address}{client_tls} "{prompt}" --max-tokens 32 '
        '--temperature 0',
        f'pagedserve chat --address {address}{client_tls} "What is the capital of France?" '
        '--temperature 0',
        f"grpcurl {'-cacert CA.pem' if is_tls else '-plaintext'} -d '{request}' {address} "
        "pagedserve.v1.GenerationService/GenerateStream",
    ]
    if http_url is not None:
        chat = json.dumps({"messages": [{"role": "user", "content": "What is the capital of "
                                         "France?"}], "temperature": 0})
        commands.append(f"curl {'--cacert CA.pem ' if is_tls else ''}{http_url}/v1/chat/"
                        f"completions -H 'Content-Type: application/json' -d '{chat}'")
    return commands


def replica_port(port: int, replica: int, host: str) -> int:
    """Replica r's port: port + r when one was given, else a free one."""
    return port + replica if port else free_port(host)


async def serve_stack(config: Any, gateway: GatewayConfig, scheduler_port: int,
                      worker_port: int, startup_timeout_s: float, internal_tls: bool = True,
                      log_format: str = "text", data_parallel_size: int = 1,
                      api_server_count: int = 1, roles: Sequence[str] = ()) -> int:
    """Run the stack until Ctrl-C or SIGTERM (0), or until a child keeps dying (1).
    `data_parallel_size` replicas, each a scheduler and tensor_parallel_size workers: replica r's
    scheduler listens on scheduler_port + r and its rank-0 worker on worker_port + r (free ports
    when 0); the gateways get every scheduler's address, comma-separated.

    `gateway` (`serve`'s gateway flags) configures every gateway process but for what the stack
    sets: scheduler addresses, tokenizer (`config`'s), internal TLS, shared ports, a free HTTP
    port for -1. Its host is every service's, its shutdown and tracing every child's. With
    `internal_tls` the services talk mutual TLS with certificates of one throw-away CA, removed
    when the stack stops. Its metrics_port P serves
    /metrics on P (gateway), then per replica r, with S = P + 1 + r * (1 + tensor_parallel_size):
    S (scheduler) and S + 1 + rank (workers); 0 on free ports each; -1 not at all; the other
    metrics settings hold for every child. An API key or admin token in it reaches the gateways
    through their environment, never their command line; neither, nor the same variables of our
    own environment, reach the schedulers and workers. `api_server_count`: _start_gateways;
    `roles`: _replica_roles."""
    config, replica_roles = _replica_roles(config, data_parallel_size, roles)
    host, connect = gateway.host, _connect_host(gateway.host)
    port = gateway.port or free_port(host)
    http, http_url, gateway_secrets = _http_config(gateway, connect)
    common = ["--drain-timeout-s", str(gateway.shutdown.drain_timeout_s),
              "--log-format", log_format, *config_to_argv(gateway.tracing)]
    certificates = ThrowAwayCertificates(ROLES, [connect]) if internal_tls else None

    def service_argv(role: str, offset: int) -> list[str]:  # offset: of its metrics port
        return [*common, *_tls_argv(certificates, role),
                *config_to_argv(_metrics(gateway.metrics, offset))]

    watch_tls = None if certificates is None else certificates.tls("supervisor")
    logger.info("internal services: %s", "mutual TLS (a throw-away CA)" if internal_tls
                else "plaintext on loopback only" if is_loopback(host) else f"plaintext on {host}")
    supervisor = Supervisor(stop_timeout_s=gateway.shutdown.drain_timeout_s + 10.0)
    try:
        scheduler_addresses = [
            await _start_replica(supervisor, replica, config, host, scheduler_port, worker_port,
                                 startup_timeout_s, service_argv, watch_tls, role)
            for replica, role in enumerate(replica_roles)]
        gateway = dataclasses.replace(
            gateway, port=port, scheduler_address=",".join(scheduler_addresses),
            tokenizer=config.model.tokenizer_path, http=http,
            admin=dataclasses.replace(gateway.admin, admin_token=""),
            tls=TlsConfig() if certificates is None else certificates.tls("gateway"))
        count = await _start_gateways(supervisor, resolve_api_server_count(
            api_server_count, len(replica_roles)), gateway, log_format, gateway_secrets)
        if not await supervisor.wait_serving(startup_timeout_s):
            return 0
        _print_serving(config.model.model, f"{connect}:{port}", http_url, len(replica_roles),
                       count, gateway.public_tls.is_enabled)
        return await supervisor.run_until_stopped()
    except (RuntimeError, TimeoutError) as e:
        logger.error("%s", e)
        return 1
    finally:
        await supervisor.stop()
        if certificates is not None:
            certificates.remove()


def _replica_roles(config: Any, data_parallel_size: int, roles: Sequence[str]
                   ) -> tuple[Any, list[str]]:
    """Each replica's --role: `roles` (prefill/decode disaggregation, the prefix cache then on)
    in place of `data_parallel_size` replicas of role both."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if not roles:
        return config, ["both"] * data_parallel_size
    return dataclasses.replace(config, cache=dataclasses.replace(
        config.cache, enable_prefix_caching=True)), list(roles)


async def _start_gateways(supervisor: Supervisor, count: int, gateway: GatewayConfig,
                          log_format: str, secrets: Mapping[str, str]) -> int:
    """`count` gateway processes of configuration `gateway`, sharing its gRPC and HTTP ports
    (SO_REUSEPORT) when more than one: the first with /metrics on its metrics_port, the others
    on free ports. The supervisor watches a gateway's health on its port, or, where that port
    speaks public TLS (whose CA the supervisor lacks), on a plaintext health-only port of its
    own."""
    connect = _connect_host(gateway.host)
    for index in range(count):
        tls = gateway.tls
        if gateway.public_tls.is_enabled:
            tls = dataclasses.replace(tls, health_port=free_port(gateway.host))
        metrics = gateway.metrics
        if index > 0:
            metrics = dataclasses.replace(metrics, metrics_port=min(metrics.metrics_port, 0))
        process = dataclasses.replace(gateway, reuse_port=count > 1, tls=tls, metrics=metrics)
        watched = tls.health_port or gateway.port
        await supervisor.start("gateway", f"{connect}:{watched}",
                               [*config_to_argv(process), "--log-format", log_format],
                               restartable=True, secrets=secrets)
    return count


def _metrics(metrics: MetricsConfig, offset: int) -> MetricsConfig:
    """A service's /metrics: `offset` ports after metrics_port, unless that is -1 (none) or 0
    (free ports)."""
    port = metrics.metrics_port
    return dataclasses.replace(metrics, metrics_port=port + offset if port > 0 else port)


def _tls_argv(certificates: ThrowAwayCertificates | None, role: str) -> list[str]:
    return [] if certificates is None else [
        "--internal-tls-dir", certificates.tls(role).internal_tls_dir]


def _http_config(gateway: GatewayConfig, connect: str
                 ) -> tuple[HttpConfig, str | None, dict[str, str]]:
    """The gateways' HTTP settings (a free port for -1, no API key: it goes to their
    environment), the HTTP API's URL (None: no HTTP API) and the secrets only the gateways'
    environment gets."""
    http, admin = gateway.http, gateway.admin
    gateway_secrets = {name: os.environ[name] for name in GATEWAY_SECRETS if os.environ.get(name)}
    if http.api_key:
        gateway_secrets[API_KEY_ENV] = http.api_key
    if admin.admin_token:
        gateway_secrets[ADMIN_TOKEN_ENV] = admin.admin_token
    http_port = free_port(gateway.host) if http.http_port == -1 else http.http_port
    scheme = "https" if gateway.public_tls.is_enabled else "http"
    http_url = f"{scheme}://{connect}:{http_port}" if http_port else None
    return dataclasses.replace(http, http_port=http_port, api_key=""), http_url, gateway_secrets


async def _start_replica(supervisor: Supervisor, replica: int, config: Any, host: str,
                         scheduler_port: int, worker_port: int, startup_timeout_s: float,
                         service_argv: Callable[[str, int], list[str]], watch_tls: TlsConfig | None,
                         role: str = "both") -> str:
    """Replica `replica`'s workers, then its scheduler (of `role`); the scheduler's address."""
    connect = _connect_host(host)
    num_ranks = config.parallel.tensor_parallel_size
    worker_ports = [replica_port(worker_port, replica, host)] + [
        free_port(host) for _ in range(num_ranks - 1)]
    worker_addresses = [f"{connect}:{p}" for p in worker_ports]
    scheduler_replica_port = replica_port(scheduler_port, replica, host)
    engine_argv = config_to_argv(with_loopback_rendezvous(config) if num_ranks > 1 else config)
    metrics_offset = 1 + replica * (1 + num_ranks)
    for rank, (address, p) in enumerate(zip(worker_addresses, worker_ports, strict=True)):
        await supervisor.start("worker", address, [
            *engine_argv, *service_argv("worker", metrics_offset + 1 + rank),
            "--host", host, "--port", str(p), "--rank", str(rank)],
            restartable=True, tls=watch_tls)
    scheduler_address = f"{connect}:{scheduler_replica_port}"
    await supervisor.start("scheduler", scheduler_address, [
        *engine_argv, *service_argv("scheduler", metrics_offset),
        "--host", host, "--port", str(scheduler_replica_port),
        "--worker-addresses", *worker_addresses, "--role", role,
        "--startup-timeout-s", str(startup_timeout_s)], restartable=True, tls=watch_tls)
    return scheduler_address


def resolve_api_server_count(api_server_count: int, data_parallel_size: int) -> int:
    """0 (auto): as many gateway processes as this process may use CPUs, less one per engine
    replica (its scheduler's loop needs a core of its own at GPU speed); at least one."""
    if api_server_count < 0:
        raise ValueError(f"api_server_count must be >= 0, got {api_server_count}")
    return api_server_count or max(1, len(os.sched_getaffinity(0)) - data_parallel_size)


def _print_serving(model: str, address: str, http_url: str | None,
                   data_parallel_size: int, api_server_count: int = 1,
                   is_tls: bool = False) -> None:
    replicas = f" ({data_parallel_size} replicas)" if data_parallel_size > 1 else ""
    if api_server_count > 1:
        replicas += f" through {api_server_count} gateway processes"
    print(f"\npagedserve is serving {model}{replicas} on {address}\n", flush=True)
    if http_url is not None:
        print(f"OpenAI-compatible HTTP API on {http_url}/v1\n", flush=True)
    print("Try:\n  " + "\n  ".join(example_commands(address, http_url, is_tls)), flush=True)
    if is_tls:
        print("(CA.pem: the CA certificate that signed --public-tls-cert)", flush=True)
    print("\nCtrl-C stops it.\n", flush=True)
