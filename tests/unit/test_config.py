"""The config tree: validation quotes the offending value, flags are generated from the fields."""

import argparse

import pytest
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulerServiceConfig,
    WorkerServiceConfig,
    add_arguments,
    from_args,
)
from pagedserve.services.common.errors import ConfigError, InvalidRequest
from pagedserve.services.gateway.config import (
    ConnectionLimitsConfig,
    GatewayConfig,
    scheduler_targets,
)


@pytest.mark.parametrize(("cls", "kwargs", "message"), [
    (CacheConfig, {"block_size": 7}, "block_size must be one of 8, 16, 32, 64, 128, got 7"),
    (CacheConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (CacheConfig, {"kv_cache_memory_gib": -1}, "kv_cache_memory_gib must be >= 0, got -1"),
    (CacheConfig, {"swap_space_gib": -1}, "swap_space_gib must be >= 0, got -1"),
    (CacheConfig, {"kv_offload_gib": -1}, "kv_offload_gib must be >= 0, got -1"),
    (CacheConfig, {"kv_offload_gib": 2.0}, "kv_offload_gib=2.0 needs enable_prefix_caching"),
    (CacheConfig, {"num_cpu_blocks_override": -2}, "num_cpu_blocks_override must be >= -1, got -2"),
    (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    (SchedulerConfig, {"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
    (SchedulerConfig, {"watermark": 1.0}, "watermark must be in [0, 1), got 1.0"),
    (SchedulerConfig, {"preemption_mode": "evict"},
     "preemption_mode must be one of ['auto', 'recompute', 'swap'], got 'evict'"),
    (ModelConfig, {"max_model_len": -1}, "max_model_len must be >= 0, got -1"),
    (ModelConfig, {"dtype": "int8"}, "dtype must be one of"),
    (ModelConfig, {"model": ""}, "model must name a model folder"),
    (DeviceConfig, {"device": "tpu"}, "device must be one of ['auto', 'cpu', 'cuda', 'sim'], got 'tpu'"),
    (DeviceConfig, {"num_threads": -1}, "num_threads must be >= 0, got -1"),
    (DeviceConfig, {"sim_gpu": "V100"}, "sim_gpu must be one of ['H100-SXM', 'H200', 'A100-80G', "
                                        "'L4'], got 'V100'"),
    (DeviceConfig, {"sim_eos_probability": 1.5}, "sim_eos_probability must be in [0, 1], got 1.5"),
    (DeviceConfig, {"sim_bandwidth_efficiency": 0.0},
     "sim_bandwidth_efficiency must be in (0, 1], got 0.0"),
    (DeviceConfig, {"sim_time_scale": -1.0}, "sim_time_scale must be >= 0, got -1.0"),
    (ParallelConfig, {"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
    (GatewayConfig, {"port": 70000}, "port must be in [0, 65535], got 70000"),
    (SchedulerServiceConfig, {"worker_addresses": []}, "worker_addresses must name at least one"),
    (WorkerServiceConfig, {"rank": -1}, "rank must be >= 0, got -1"),
    (ConnectionLimitsConfig, {"http_header_timeout_s": 0},
     "http_header_timeout_s must be > 0, got 0"),
    (ConnectionLimitsConfig, {"max_http_connections": 0}, "max_http_connections must be >= 1, got 0"),
    (ConnectionLimitsConfig, {"max_http_connections_per_client": -1},
     "max_http_connections_per_client must be >= 0, got -1"),
    (ConnectionLimitsConfig, {"http_stream_send_buffer_bytes": 1024},
     "http_stream_send_buffer_bytes must be >= 4096, got 1024"),
    (MetricsConfig, {"metrics_max_connections": 0}, "metrics_max_connections must be >= 1, got 0"),
    (MetricsConfig, {"metrics_timeout_s": 0}, "metrics_timeout_s must be > 0, got 0"),
])
def test_bad_values_are_rejected_with_the_value_quoted(cls, kwargs, message):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert message in str(err.value)
    assert isinstance(err.value, InvalidRequest)  # a bad config is bad input: INVALID_ARGUMENT


def test_flags_are_generated_from_the_fields_and_keep_defaults():
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    args = parser.parse_args(["--block-size", "32", "--no-enable-chunked-prefill",
                              "--enable-prefix-caching", "--preemption-mode", "swap",
                              "--model", "/models/x"])
    config = from_args(EngineConfig, args)
    assert config.cache.block_size == 32 and config.cache.enable_prefix_caching
    assert not config.scheduler.enable_chunked_prefill
    assert config.scheduler.preemption_mode == "swap"
    assert config.model.model == "/models/x"
    assert config.scheduler.max_num_seqs == SchedulerConfig().max_num_seqs  # untouched default


def test_flags_validate_choices_and_values():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, EngineConfig)
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--device", "tpu"])
    with pytest.raises(ConfigError, match="block_size must be one of"):
        from_args(EngineConfig, parser.parse_args(["--block-size", "12"]))


def test_list_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser, SchedulerServiceConfig)
    args = parser.parse_args(["--worker-addresses", "w0:1", "w1:2"])
    assert from_args(SchedulerServiceConfig, args).worker_addresses == ["w0:1", "w1:2"]


def test_scheduler_address_flag_repeated_accumulates():
    parser = argparse.ArgumentParser()
    add_arguments(parser, GatewayConfig)
    args = parser.parse_args(["--scheduler-address", "a:1,b:2", "--port", "0",
                              "--scheduler-address", "c:3", "--scheduler-address", "[::1]:4"])
    config = from_args(GatewayConfig, args)
    assert scheduler_targets(config.scheduler_address) == ["a:1", "b:2", "c:3", "[::1]:4"]
    once = from_args(GatewayConfig, parser.parse_args(["--scheduler-address", "d:5"]))
    assert once.scheduler_address == "d:5"
    assert from_args(GatewayConfig, parser.parse_args([])).scheduler_address == "127.0.0.1:50052"
