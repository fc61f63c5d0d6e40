"""`serve --api-server-count 2`: two gateway processes share the gRPC and the HTTP port, both
take connections, and the ports keep serving when one of them is killed."""

import signal
import subprocess

import grpc
import httpx
import psutil
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from pagedserve.supervisor import free_port
from tests.e2e.test_processes import SMALL_CACHE, pagedserve, read_lines, stop, wait_for_line

NUM_CONNECTIONS = 16  # all on one of two processes: a 2**-15 chance


def _gateways(serve: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(serve.pid).children()
            if "gateway" in p.cmdline()[:4]]


def _holders(gateways: list[psutil.Process], port: int) -> set[int]:
    """The gateways with an established connection on `port`."""
    return {g.pid for g in gateways for c in g.net_connections("tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port}


def _complete(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2,
                                                  "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def _generate(channel: grpc.Channel) -> None:
    response = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(
        gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
                                    sampling=common_pb2.SamplingParams(
                                        temperature=0.0, max_tokens=2, ignore_eos=True)),
        timeout=60)
    assert len(response.outputs[0].token_ids) == 2


def _channel(address: str) -> grpc.Channel:
    """A channel with a connection of its own (channels share subchannels otherwise)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def test_two_gateway_processes_serve_one_port_and_survive_one_killed(tiny_served_model_dir):
    port, http_port = free_port(), free_port()
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", str(port),
                       "--http-port", str(http_port), "--api-server-count", "2",
                       "--no-internal-tls", *SMALL_CACHE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    try:
        out = read_lines(serve.stdout)
        read_lines(serve.stderr)  # drained, so that the children never block on a full pipe
        assert "through 2 gateway processes" in wait_for_line(out, "pagedserve is serving", 180)
        gateways = _gateways(serve)
        assert len(gateways) == 2
        address, url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
        https = [httpx.Client(base_url=url, timeout=60) for _ in range(NUM_CONNECTIONS)]
        channels = [_channel(address) for _ in range(NUM_CONNECTIONS)]
        try:
            for http, channel in zip(https, channels, strict=True):
                _complete(http)
                _generate(channel)
            pids = {g.pid for g in gateways}
            assert _holders(gateways, http_port) == pids
            assert _holders(gateways, port) == pids
        finally:
            for http, channel in zip(https, channels, strict=True):
                http.close()
                channel.close()

        gateways[0].send_signal(signal.SIGKILL)
        gateways[0].wait(30)
        for _ in range(NUM_CONNECTIONS):
            with httpx.Client(base_url=url, timeout=60) as http:
                _complete(http)
            with _channel(address) as channel:
                _generate(channel)
        assert stop(serve, signal.SIGINT) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
