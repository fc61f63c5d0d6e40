"""The API key and the admin token: where they come from (flag, file, environment), how a
header is checked, and that both doors take the admin token beside the key and the gRPC door
refuses a call without a key before it parses the request."""

import asyncio

import grpc
import httpx
import pytest
from pagedserve.services.common.api_key import is_authorized
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.gateway.config import ADMIN_TOKEN_ENV, API_KEY_ENV, AdminConfig, HttpConfig
from pagedserve.services.gateway.openai.middleware import ApiKeyGuard
from pagedserve.services.rpc.auth import ApiKeyInterceptor
from pagedserve.services.rpc.server import ServiceBinding, create_server
from pagedserve.services.rpc.v1 import gateway_pb2, gateway_pb2_grpc
from starlette.responses import PlainTextResponse


def test_bearer_header_must_carry_the_key():
    assert is_authorized("", None)
    assert is_authorized("k3y", "Bearer k3y")
    assert is_authorized("k3y", "bearer k3y")
    assert not is_authorized("k3y", None)
    assert not is_authorized("k3y", "k3y")
    assert not is_authorized("k3y", "Bearer k3")
    assert not is_authorized("k3y", "Basic k3y")
    assert not is_authorized("k3y", "Bearer ")


def test_the_admin_token_passes_beside_the_api_key():
    """It was refused with UNAUTHENTICATED whenever an API key was set."""
    assert is_authorized("k3y", "Bearer adm1n", admin_token="adm1n")
    assert is_authorized("k3y", "Bearer k3y", admin_token="adm1n")
    assert not is_authorized("k3y", "Bearer adm1", admin_token="adm1n")
    assert not is_authorized("k3y", "Bearer ", admin_token="")


def test_key_from_flag_then_file_then_environment(tmp_path):
    environ = {API_KEY_ENV: "from-env"}
    assert HttpConfig(api_key="from-flag").resolve_api_key(environ) == "from-flag"
    path = tmp_path / "key"
    path.write_text("from-file\n")
    assert HttpConfig(api_key_file=str(path)).resolve_api_key(environ) == "from-file"
    assert HttpConfig().resolve_api_key(environ) == "from-env"
    assert HttpConfig().resolve_api_key({}) == ""


def test_bad_key_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="api_key_file"):
        HttpConfig(api_key_file=str(tmp_path / "missing")).resolve_api_key({})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="holds no key"):
        HttpConfig(api_key_file=str(tmp_path / "empty")).resolve_api_key({})
    with pytest.raises(ConfigError, match="not both"):
        HttpConfig(api_key="a", api_key_file="b")
    with pytest.raises(ConfigError, match="http_port"):
        HttpConfig(http_port=70000)


def test_the_key_is_not_in_the_config_repr():
    assert "s3cret" not in repr(HttpConfig(api_key="s3cret"))


def test_admin_token_from_flag_then_file_then_environment(tmp_path):
    environ = {ADMIN_TOKEN_ENV: "from-env", API_KEY_ENV: "the-api-key"}
    assert AdminConfig(admin_token="from-flag").resolve_admin_token(environ) == "from-flag"
    path = tmp_path / "token"
    path.write_text("from-file\nignored\n")
    assert AdminConfig(admin_token_file=str(path)).resolve_admin_token(environ) == "from-file"
    assert AdminConfig().resolve_admin_token(environ) == "from-env"
    assert AdminConfig().resolve_admin_token({API_KEY_ENV: "the-api-key"}) == ""
    with pytest.raises(ConfigError, match="admin_token_file"):
        AdminConfig(admin_token_file=str(tmp_path / "missing")).resolve_admin_token({})
    with pytest.raises(ConfigError, match="not both"):
        AdminConfig(admin_token="a", admin_token_file="b")
    assert "s3cret" not in repr(AdminConfig(admin_token="s3cret"))


class _Tokenize(gateway_pb2_grpc.GenerationServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Tokenize(self, request, context):
        self.calls += 1
        return gateway_pb2.TokenizeResponse(token_ids=[1, 2, 3])


def _grpc_calls(calls):
    """`calls(channel)` against a Generation server guarded by key 'k3y' and admin 'adm1n';
    returns its results and how often the servicer ran."""
    servicer = _Tokenize()

    async def main():
        server, port = create_server(
            [ServiceBinding(servicer, gateway_pb2_grpc.add_GenerationServiceServicer_to_server,
                            "pagedserve.v1.GenerationService")],
            interceptors=[ApiKeyInterceptor("k3y", ["pagedserve.v1.GenerationService"],
                                            admin_token="adm1n")])
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await calls(channel)
        finally:
            await server.servers[0].stop(0)

    return asyncio.run(main()), servicer.calls


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_grpc_checks_the_key_before_it_parses_the_request():
    """Bytes that are no TokenizeRequest, without a key: refused for the key (the body was
    parsed first, and answered INVALID_ARGUMENT, before)."""
    async def calls(channel):
        raw = channel.unary_unary("/pagedserve.v1.GenerationService/Tokenize")
        return [await _code(raw(b"\xff\xff\xff", timeout=10)),
                await _code(raw(b"\xff\xff\xff", timeout=10,
                                metadata=[("authorization", "Bearer k3y")]))]

    (no_key, with_key), num_calls = _grpc_calls(calls)
    assert no_key == grpc.StatusCode.UNAUTHENTICATED
    assert with_key == grpc.StatusCode.INVALID_ARGUMENT  # let in, then parsed as before
    assert num_calls == 0


def test_grpc_takes_the_admin_token_beside_the_api_key():
    async def calls(channel):
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        return [await _code(stub.Tokenize(gateway_pb2.TokenizeRequest(text="x"), timeout=10,
                                          metadata=[("authorization", f"Bearer {token}")]))
                for token in ("adm1n", "k3y", "adm1")]

    codes, num_calls = _grpc_calls(calls)
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED]
    assert num_calls == 2


def test_http_takes_the_admin_token_beside_the_api_key():
    async def ok(scope, receive, send):
        await PlainTextResponse("ok")(scope, receive, send)

    guarded = ApiKeyGuard(ok, "k3y", ["/health"], admin_token="adm1n")

    async def statuses():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded),
                                     base_url="http://gateway") as client:
            return [(await client.get("/v1/models", headers=headers)).status_code
                    for headers in ({"Authorization": "Bearer adm1n"},
                                    {"Authorization": "Bearer k3y"},
                                    {"Authorization": "Bearer adm1"}, {})]

    assert asyncio.run(statuses()) == [200, 200, 401, 401]
