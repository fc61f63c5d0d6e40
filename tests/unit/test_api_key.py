"""The API key and the admin token: where they come from (flag, file, environment) and how a
header is checked."""

import pytest
from pagedserve.services.common.api_key import is_authorized
from pagedserve.services.common.config import (
    ADMIN_TOKEN_ENV,
    API_KEY_ENV,
    AdminConfig,
    HttpConfig,
)
from pagedserve.services.common.errors import ConfigError


def test_bearer_header_must_carry_the_key():
    assert is_authorized("", None)
    assert is_authorized("k3y", "Bearer k3y")
    assert is_authorized("k3y", "bearer k3y")
    assert not is_authorized("k3y", None)
    assert not is_authorized("k3y", "k3y")
    assert not is_authorized("k3y", "Bearer k3")
    assert not is_authorized("k3y", "Basic k3y")
    assert not is_authorized("k3y", "Bearer ")


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
