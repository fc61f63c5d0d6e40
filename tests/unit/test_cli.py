"""The `pagedserve` command line: `serve` hands its children exactly its configuration, sampling
flags become SamplingParams, bad flags are refused with the field's name."""

import pytest
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    MetricsConfig,
    ModelConfig,
    PublicTlsConfig,
    SchedulerConfig,
    SchedulerServiceConfig,
    TracingConfig,
    from_args,
)
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.config import GatewayConfig

import pagedserve.supervisor
from pagedserve.cli import _disaggregated_roles, _sampling, build_parser, main
from pagedserve.supervisor import config_to_argv


def test_config_to_argv_round_trips_through_the_generated_flags():
    config = EngineConfig(
        model=ModelConfig(model="/models/x", tokenizer="/tok", dtype="bfloat16",
                          max_model_len=1024, seed=3),
        cache=CacheConfig(block_size=32, kv_cache_memory_gib=0.25, swap_space_gib=0.0,
                          num_cpu_blocks_override=7, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=9, enable_chunked_prefill=False,
                                  preemption_mode="swap", policy="priority", watermark=0.1),
        device=DeviceConfig(device="cpu", attention_backend="torch", enable_cuda_graph=False))
    for command in ("worker", "scheduler"):
        args = build_parser().parse_args([command, *config_to_argv(config)])
        assert from_args(EngineConfig, args) == config


def test_serve_hands_its_tracing_flags_to_every_child():
    args = build_parser().parse_args(["serve", "--otel-exporter", "otlp",
                                      "--otel-endpoint", "http://collector:4317"])
    tracing = from_args(TracingConfig, args)
    assert tracing == TracingConfig(otel_exporter="otlp", otel_endpoint="http://collector:4317")
    for command in ("worker", "scheduler", "gateway"):
        child = build_parser().parse_args([command, *config_to_argv(tracing)])
        assert from_args(TracingConfig, child) == tracing


class RecordingSupervisor:
    """Records the children `serve` would start; none serves, so serve returns at once."""

    started: dict[str, list[list[str]]] = {}
    addresses: dict[str, list[str]] = {}  # what the supervisor watches the health of

    def __init__(self, stop_timeout_s: float) -> None:
        RecordingSupervisor.started, RecordingSupervisor.addresses = {}, {}

    async def start(self, role, address, argv, restartable=False, tls=None, secrets=None) -> None:
        self.started.setdefault(role, []).append(list(argv))
        self.addresses.setdefault(role, []).append(address)

    async def wait_serving(self, timeout_s: float) -> bool:
        return False

    async def stop(self) -> None:
        pass


def test_serve_hands_its_routing_flags_to_the_gateway(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(pagedserve.supervisor, "Supervisor", RecordingSupervisor)
    assert main(["serve", "--model", str(tmp_path), "--no-internal-tls", "--device", "cpu",
                 "--data-parallel-size", "2", "--failover-timeout-s", "4.5",
                 "--routing-policy", "round-robin"]) == 0
    [gateway_argv] = RecordingSupervisor.started["gateway"]
    routing = from_args(GatewayConfig, build_parser().parse_args(["gateway", *gateway_argv])).routing
    assert (routing.failover_timeout_s, routing.routing_policy) == (4.5, "round-robin")
    assert len(RecordingSupervisor.started["scheduler"]) == 2


def test_serve_hands_each_gateway_its_grpc_servers(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(pagedserve.supervisor, "Supervisor", RecordingSupervisor)
    assert main(["serve", "--model", str(tmp_path), "--no-internal-tls", "--device", "cpu",
                 "--api-server-count", "2", "--num-grpc-servers", "4"]) == 0
    gateways = RecordingSupervisor.started["gateway"]
    assert len(gateways) == 2
    for argv in gateways:
        assert from_args(GatewayConfig, build_parser().parse_args(
            ["gateway", *argv])).num_grpc_servers == 4


def test_serve_hands_every_gateway_process_the_gateway_flags(tmp_path, monkeypatch):
    """Once `serve` refused them: its gateways kept 1024 requests in flight each."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(pagedserve.supervisor, "Supervisor", RecordingSupervisor)
    assert main(["serve", "--model", str(tmp_path), "--no-internal-tls", "--device", "cpu",
                 "--api-server-count", "2", "--max-concurrent-requests", "4096",
                 "--num-tokenizer-threads", "3", "--num-tokenize-api-threads", "2",
                 "--rpc-timeout-s", "2.5", "--public-tls-cert", "tls.crt",
                 "--public-tls-key", "tls.key", "--public-tls-client-ca", "ca.crt",
                 "--metrics-max-connections", "3", "--metrics-timeout-s", "4.5"]) == 0
    gateways = [from_args(GatewayConfig, build_parser().parse_args(["gateway", *argv]))
                for argv in RecordingSupervisor.started["gateway"]]
    assert len(gateways) == 2
    for gateway, address in zip(gateways, RecordingSupervisor.addresses["gateway"], strict=True):
        assert (gateway.max_concurrent_requests, gateway.num_tokenizer_threads,
                gateway.num_tokenize_api_threads, gateway.rpc_timeout_s) == (4096, 3, 2, 2.5)
        assert gateway.public_tls == PublicTlsConfig("tls.crt", "tls.key", "ca.crt")
        assert gateway.metrics.metrics_max_connections == 3
        assert gateway.metrics.metrics_timeout_s == 4.5
        assert gateway.reuse_port
        # its port speaks TLS with a CA serve does not hold: health is watched on a port of its own
        assert gateway.tls.health_port and address.endswith(f":{gateway.tls.health_port}")
    for role in ("scheduler", "worker"):
        [argv] = RecordingSupervisor.started[role]
        metrics = from_args(MetricsConfig, build_parser().parse_args([role, *argv]))
        assert (metrics.metrics_max_connections, metrics.metrics_timeout_s) == (3, 4.5)


def test_serve_gateways_keep_the_gateway_defaults(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(pagedserve.supervisor, "Supervisor", RecordingSupervisor)
    assert main(["serve", "--model", str(tmp_path), "--no-internal-tls", "--device", "cpu"]) == 0
    [argv] = RecordingSupervisor.started["gateway"]
    [address] = RecordingSupervisor.addresses["gateway"]
    gateway = from_args(GatewayConfig, build_parser().parse_args(["gateway", *argv]))
    defaults = GatewayConfig()
    for name in ("max_concurrent_requests", "num_tokenizer_threads", "num_tokenize_api_threads",
                 "rpc_timeout_s", "public_tls", "limits", "routing", "connections"):
        assert getattr(gateway, name) == getattr(defaults, name), name
    assert (gateway.metrics.metrics_max_connections, gateway.metrics.metrics_timeout_s) == (
        defaults.metrics.metrics_max_connections, defaults.metrics.metrics_timeout_s)
    assert not gateway.reuse_port and gateway.tls.health_port == 0
    assert address == f"127.0.0.1:{gateway.port}"


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-concurrent-requests", "0"], "max_concurrent_requests must be >= 1, got 0"),
    (["--num-tokenizer-threads", "0"], "num_tokenizer_threads must be >= 1, got 0"),
    (["--rpc-timeout-s", "0"], "rpc_timeout_s must be > 0, got 0.0"),
    (["--public-tls-cert", "tls.crt"], "public_tls_cert and public_tls_key go together"),
    (["--metrics-timeout-s", "0"], "metrics_timeout_s must be > 0, got 0.0"),
])
def test_serve_checks_the_gateway_flags_as_gateway_does(tmp_path, capsys, flags, message):
    (tmp_path / "config.json").write_text("{}")
    for command in (["gateway"], ["serve", "--model", str(tmp_path)]):
        with pytest.raises(SystemExit) as info:
            main([*command, *flags])
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_sampling_flags_keep_vllm_defaults_for_the_rest():
    args = build_parser().parse_args([
        "generate", "hi", "--temperature", "0.5", "--n", "2", "--seed", "7", "--stop", "a", "bc",
        "--stop-token-ids", "5", "9", "--ignore-eos", "--logprobs", "3"])
    assert _sampling(args) == SamplingParams(temperature=0.5, n=2, seed=7, stop=("a", "bc"),
                                             stop_token_ids=(5, 9), ignore_eos=True, logprobs=3)
    assert _sampling(build_parser().parse_args(["chat"])) == SamplingParams()


def test_token_constraint_flags():
    args = build_parser().parse_args([
        "generate", "hi", "--logit-bias", "5=1.5", "7=-100", "--allowed-token-ids", "3", "4",
        "--bad-words", "fox", "a b", "--truncate-prompt-tokens", "3"])
    sampling = _sampling(args)
    assert sampling.logit_bias == ((5, 1.5), (7, -100.0))
    assert (sampling.allowed_token_ids, sampling.bad_words) == ((3, 4), ("fox", "a b"))
    assert sampling.truncate_prompt_tokens == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--logit-bias", "5"])


def test_bad_flags_exit_with_the_field_named(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--top-p", "0"])
    assert info.value.code == 2
    assert "top_p must be in (0, 1], got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["worker", "--block-size", "12"])
    assert info.value.code == 2
    assert "block_size must be one of" in capsys.readouterr().err


def test_metrics_and_log_flags():
    args = build_parser().parse_args(["scheduler", "--metrics-port", "9400",
                                      "--stats-interval-s", "2.5", "--log-format", "json"])
    service = from_args(SchedulerServiceConfig, args)
    assert (service.metrics, service.stats_interval_s, args.log_format) == (
        MetricsConfig(9400), 2.5, "json")
    for command in ("worker", "gateway"):
        args = build_parser().parse_args([command, "--metrics-port", "0"])
        assert args.metrics_port == 0
    with pytest.raises(Exception, match=r"metrics_port must be -1 \(off\) .* got -2"):
        MetricsConfig(-2)


def test_serve_disaggregation_flags_name_each_replicas_role_and_refuse_half_a_pair():
    args = build_parser().parse_args(["serve", "--prefill-replicas", "1", "--decode-replicas", "2"])
    assert _disaggregated_roles(args) == ["prefill", "decode", "decode"]
    assert _disaggregated_roles(build_parser().parse_args(["serve"])) == []
    with pytest.raises(InvalidRequest, match="--decode-replicas 0"):
        _disaggregated_roles(build_parser().parse_args(["serve", "--prefill-replicas", "1"]))
    with pytest.raises(InvalidRequest, match="--data-parallel-size 2"):
        _disaggregated_roles(build_parser().parse_args([
            "serve", "--prefill-replicas", "1", "--decode-replicas", "1",
            "--data-parallel-size", "2"]))
    scheduler = build_parser().parse_args(["scheduler", "--role", "decode"])
    assert from_args(SchedulerServiceConfig, scheduler).role == "decode"
