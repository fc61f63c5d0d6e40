"""The configuration tree: one dataclass per concern, defaults and help on the fields.

CLI flags are generated from the fields (`add_arguments` / `from_args`), so a new option is a new
field and nothing else. Validation lives in `__post_init__` and quotes the offending value.
Values discovered at run time (the number of KV blocks, the model's max length) are reported back
by the services, never written into these objects.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pagedserve.services.common.engine_api import REPLICA_ROLES
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.speculative_config import (
    SpeculativeConfig,
    parse_speculative_config,
)

GiB = 1 << 30


def default_model_dir() -> str:
    """Where `make model` puts the converted SmolLM2-135M-Instruct."""
    cache = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return str(Path(cache) / "models" / "SmolLM2-135M-Instruct")


def served_model_name(model: str) -> str:
    """How a model folder is named to clients, in metrics and in traces: the folder's name."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its CLI help text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choices(config: Any) -> None:
    """Literal-typed fields take one of their listed values (argparse checks flags; this checks
    configs built in code)."""
    for name, tp in typing.get_type_hints(type(config)).items():
        if typing.get_origin(tp) is Literal:
            value = getattr(config, name)
            _check(value in typing.get_args(tp),
                   f"{name} must be one of {list(typing.get_args(tp))}, got {value!r}")


@dataclass(slots=True)
class ModelConfig:
    model: str = field(default_factory=default_model_dir, metadata={
        "help": "HF model folder (config.json, safetensors, tokenizer); default: SmolLM2 from "
                "make model"})
    tokenizer: str = opt("", "tokenizer folder; empty = the model folder")
    served_model_name: str = opt(
        "", "the model's name: what clients send as `model` and see, and the model_name label "
        "of every service's metrics and traces (gateways take it from the scheduler); empty = "
        "the model folder's name")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = opt(
        "auto", "weights and activations dtype; auto = float32 on CPU, bfloat16 on CUDA")
    max_model_len: int = opt(0, "longest prompt + output in tokens; 0 = the model's own limit")
    load_format: Literal["auto", "safetensors", "pt", "dummy"] = opt(
        "auto", "weights format; dummy = random weights of the real shapes (benchmarks)")
    seed: int = opt(0, "seed for dummy weights and unseeded sampling: a fresh engine repeats the "
                       "draws of requests without a seed of their own")
    pooling_type: Literal["last", "mean"] = opt(
        "last", "how an embedding request's prompt becomes one vector (vLLM's pooler "
        "pooling_type, L2-normalized): last = the final hidden state of its last token, mean = "
        "the mean over every prompt token's (such prompts skip the prefix cache)")

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.max_model_len >= 0, f"max_model_len must be >= 0, got {self.max_model_len}")
        _check(bool(self.model), "model must name a model folder, got ''")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def name(self) -> str:
        return self.served_model_name or served_model_name(self.model)


@dataclass(slots=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV-cache block")
    gpu_memory_utilization: float = opt(
        0.9, "this instance's share of the GPU's memory, for its weights, activations, CUDA "
        "graphs and KV cache (CUDA; others' use aside: two instances at 0.45 share a GPU)")
    kv_cache_memory_gib: float = opt(
        0.0, "KV-cache size in GiB on any device; 0 = on CUDA what gpu_memory_utilization "
        "leaves, on CPU 1 GiB")
    swap_space_gib: float = opt(4.0, "CPU swap space for preempted KV blocks, in GiB")
    kv_offload_gib: float = opt(
        0.0, "host-memory KV tier for prefix-cache blocks evicted from the device, in GiB, "
        "beside the swap space; 0 = off; needs enable_prefix_caching")
    num_gpu_blocks_override: int = opt(0, "force this many device blocks (tests); 0 = profile")
    num_cpu_blocks_override: int = opt(-1, "force this many swap blocks (tests); "
                                           "-1 = from swap_space")
    enable_prefix_caching: bool = opt(False, "reuse KV blocks of identical prompt prefixes")

    def __post_init__(self) -> None:
        _check(self.block_size in (8, 16, 32, 64, 128),
               f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.kv_cache_memory_gib >= 0,
               f"kv_cache_memory_gib must be >= 0, got {self.kv_cache_memory_gib}")
        _check(self.swap_space_gib >= 0, f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        _check(self.kv_offload_gib >= 0, f"kv_offload_gib must be >= 0, got {self.kv_offload_gib}")
        _check(self.kv_offload_gib == 0 or self.enable_prefix_caching,
               f"kv_offload_gib={self.kv_offload_gib} needs enable_prefix_caching: the host tier "
               "holds prefix-cache blocks")
        _check(self.num_gpu_blocks_override >= 0,
               f"num_gpu_blocks_override must be >= 0, got {self.num_gpu_blocks_override}")
        _check(self.num_cpu_blocks_override >= -1,
               f"num_cpu_blocks_override must be >= -1, got {self.num_cpu_blocks_override}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = opt(2048, "token budget of one engine step")
    max_num_seqs: int = opt(256, "most sequences running at once")
    enable_chunked_prefill: bool = opt(True, "split long prompts across steps, decodes first")
    preemption_mode: Literal["auto", "recompute", "swap"] = opt(
        "auto", "auto = recompute single-sequence groups, swap multi-sequence groups")
    policy: Literal["fcfs", "priority"] = opt("fcfs", "queue order (priority: lower runs first)")
    watermark: float = opt(0.01, "fraction of device blocks kept free when admitting prompts")
    async_scheduling: bool = opt(True, "schedule and send step n+1 while step n runs, so the "
                                 "workers never wait for the scheduler")
    long_prefill_token_threshold: int = opt(
        0, "a prompt with more tokens left to prefill is long: its chunk is capped at this many "
        "tokens until every other request of the step is scheduled, then it takes what budget "
        "is left, unless the step prefills another prompt (that step stays short); 0 = 4 "
        "percent of max_model_len, at least 64; never above half of max_num_batched_tokens")
    max_long_partial_prefills: int = opt(
        1, "long prompts prefilled in the same step; the others wait while shorter prompts "
        "pass them")
    max_best_of: int = opt(64, "most sequences one request may run (n, best_of, beam width): "
                           "more is INVALID_ARGUMENT, so no request takes every sequence slot")
    max_waiting_requests: int = opt(
        4096, "requests queued and not yet running; past it a new request is RESOURCE_EXHAUSTED")
    speculative_config: str = opt(
        "", "speculative decoding as vLLM's JSON object, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'"
        "; empty = off (docs/speculative-decoding.md)")

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(0.0 <= self.watermark < 1.0, f"watermark must be in [0, 1), got {self.watermark}")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be "
               f">= 0, got {self.long_prefill_token_threshold}")
        _check(self.max_long_partial_prefills >= 1,
               f"max_long_partial_prefills must be >= 1, got {self.max_long_partial_prefills}")
        _check(self.max_best_of >= 1, f"max_best_of must be >= 1, got {self.max_best_of}")
        _check(self.max_waiting_requests >= 1,
               f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if isinstance(self.speculative_config, dict):  # LLM(speculative_config={...})
            self.speculative_config = json.dumps(self.speculative_config)
        parse_speculative_config(self.speculative_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)


@dataclass(slots=True)
class DeviceConfig:
    device: Literal["auto", "cpu", "cuda", "sim"] = opt(
        "auto", "where the worker runs the model; sim = no model: each step waits the time the "
        "sim_gpu would take (see sim_step_model) and samples deterministic tokens")
    attention_backend: Literal["auto", "torch", "triton", "flash_attn", "ref"] = opt(
        "auto", "kernels: auto = flash_attn if installed on CUDA, else triton on CUDA, else torch; "
        "ref = the slow readable reference")
    enable_cuda_graph: bool = opt(
        True, "CUDA: replay steps as CUDA graphs (decode-only steps by batch size, mixed "
        "prefill + decode steps by token count up to max_cuda_graph_tokens); off = every step "
        "eager (vLLM's --enforce-eager)")
    max_cuda_graph_tokens: int = opt(
        512, "CUDA graphs: the largest mixed prefill + decode step (in tokens, also capped by "
        "max_num_batched_tokens) that replays a graph; larger steps run eagerly; 0 = only "
        "decode-only steps replay graphs")
    num_threads: int = opt(0, "torch CPU threads; 0 = torch's default")
    sim_gpu: Literal["H100-SXM", "H200", "A100-80G", "L4"] = opt(
        "H100-SXM", "device=sim: the GPU whose peak FLOP/s, bandwidth and memory are modelled")
    sim_model: str = opt("", "device=sim: the shapes timed and sized: a preset (Llama-3-8B, "
                             "Qwen2.5-7B, Llama-3.2-1B, Qwen2.5-0.5B, SmolLM2-1.7B) or a folder "
                             "with config.json; empty = the model folder (whose tokenizer and "
                             "vocabulary are served)")
    sim_step_model: Literal["kernels", "roofline"] = opt(
        "kernels", "device=sim: how a step is timed: kernels = the kernels the model code "
        "launches, priced with the H100 calibration (eager launches, CUDA-graph replays); "
        "roofline = the lower bound, scaled by the sim_*_efficiency and sim_launch_overhead_us")
    sim_eos_probability: float = opt(
        0.005, "device=sim: chance that a sampled token is EOS (mean output ~1/p tokens)")
    sim_flops_efficiency: float = opt(
        1.0, "device=sim, sim_step_model=roofline: fraction of peak FLOP/s reached (1 = the "
             "roofline)")
    sim_bandwidth_efficiency: float = opt(
        1.0, "device=sim: fraction of peak memory bandwidth reached by the roofline and by "
             "swaps and block copies")
    sim_launch_overhead_us: float = opt(
        100.0, "device=sim, sim_step_model=roofline: fixed time added to every step")
    sim_time_scale: float = opt(
        1.0, "device=sim: multiplies every modelled time; 0 = a GPU with no cost, to load the "
             "control plane alone")
    sim_draft_acceptance: float = opt(
        0.7, "device=sim with speculative_config method draft_model (its model: a preset or a "
             "folder, as sim_model): the chance that each draft is the target's next token, an "
             "input of the model (the workload's and the draft's; the simulated tokens carry no "
             "meaning)")

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.num_threads >= 0, f"num_threads must be >= 0, got {self.num_threads}")
        _check(self.max_cuda_graph_tokens >= 0,
               f"max_cuda_graph_tokens must be >= 0, got {self.max_cuda_graph_tokens}")
        _check(0.0 <= self.sim_eos_probability <= 1.0,
               f"sim_eos_probability must be in [0, 1], got {self.sim_eos_probability}")
        for name in ("sim_flops_efficiency", "sim_bandwidth_efficiency"):
            value = getattr(self, name)
            _check(0.0 < value <= 1.0, f"{name} must be in (0, 1], got {value}")
        _check(self.sim_launch_overhead_us >= 0,
               f"sim_launch_overhead_us must be >= 0, got {self.sim_launch_overhead_us}")
        _check(self.sim_time_scale >= 0,
               f"sim_time_scale must be >= 0, got {self.sim_time_scale}")
        _check(0.0 <= self.sim_draft_acceptance <= 1.0,
               f"sim_draft_acceptance must be in [0, 1], got {self.sim_draft_acceptance}")


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = opt(1, "workers (GPUs) per model replica, one process each")
    distributed_init_address: str = opt(
        "127.0.0.1:29500", "host:port where tensor-parallel rank 0 meets the other ranks")
    distributed_timeout_s: float = opt(
        300.0, "how long tensor-parallel ranks wait for each other (joining, each collective)")

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1,
               f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _check(self.distributed_timeout_s > 0,
               f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")


@dataclass(slots=True)
class EngineConfig:
    """Everything the in-process engine needs: the scheduler core plus its worker cores."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(slots=True)
class TracingConfig:
    """OpenTelemetry tracing of one service (services/rpc/tracing.py); off by default. Empty
    fields fall back on the standard OTEL_* variables, read when the service starts."""

    otel_exporter: Literal["", "none", "console", "otlp"] = opt(
        "", "where spans go: none = tracing off, console = stdout, otlp = an OTLP/gRPC "
            "collector; empty = OTEL_TRACES_EXPORTER, else none")
    otel_endpoint: str = opt("", "OTLP collector, e.g. http://otel-collector:4317; empty = "
                                 "OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4317")
    service_name: str = opt("", "service.name of the spans; empty = OTEL_SERVICE_NAME, else "
                                "pagedserve-<service>")

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(not self.otel_endpoint or self.otel_exporter in ("", "otlp"),
               f"otel_endpoint is only used with otel_exporter='otlp', got "
               f"otel_endpoint={self.otel_endpoint!r} with otel_exporter={self.otel_exporter!r}")


@dataclass(slots=True)
class MetricsConfig:
    """Prometheus metrics of one service, served over HTTP at /metrics on the service's host."""

    metrics_port: int = opt(-1, "port of the Prometheus /metrics endpoint; 0 = any free port, "
                                "-1 = no endpoint")
    metrics_max_connections: int = opt(
        8, "connections the /metrics endpoint serves at once; more are closed unanswered")
    metrics_timeout_s: float = opt(
        10.0, "a /metrics connection that sends nothing (or stops reading) for this long is "
              "closed")

    def __post_init__(self) -> None:
        _check(-1 <= self.metrics_port < 65536,
               f"metrics_port must be -1 (off) or in [0, 65535], got {self.metrics_port}")
        _check(self.metrics_max_connections >= 1,
               f"metrics_max_connections must be >= 1, got {self.metrics_max_connections}")
        _check(self.metrics_timeout_s > 0,
               f"metrics_timeout_s must be > 0, got {self.metrics_timeout_s}")


@dataclass(slots=True)
class ShutdownConfig:
    """How a service stops on SIGTERM (each of the three, and `pagedserve serve` for all)."""

    drain_timeout_s: float = opt(30.0, "on SIGTERM, how long live requests may take to finish")

    def __post_init__(self) -> None:
        _check(self.drain_timeout_s >= 0,
               f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


@dataclass(slots=True)
class TlsConfig:
    """Mutual TLS between the services (services/rpc/tls.py): each presents its certificate as
    server and as client, and accepts only peers whose certificate the CA signed."""

    internal_tls_dir: str = opt(
        "", "folder holding ca.crt, tls.crt and tls.key (a cert-manager or kubernetes.io/tls "
            "Secret mounted as is): mutual TLS between the services; empty = the --tls-* files "
            "below, or none (plaintext)")
    tls_cert: str = opt("", "this service's certificate chain (PEM), shown to its peers")
    tls_key: str = opt("", "the private key of --tls-cert (PEM)")
    tls_ca: str = opt("", "CA certificate (PEM): peers must present a certificate it signed")
    tls_server_name: str = opt(
        "", "name the peers' server certificates must carry; empty = the host of the address "
            "dialled")
    health_port: int = opt(
        0, "a second, plaintext port serving only grpc.health.v1, for probes that cannot speak "
           "TLS (Kubernetes); 0 = none")

    def __post_init__(self) -> None:
        files = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}
        given = [name for name, path in files.items() if path]
        _check(not (self.internal_tls_dir and given),
               f"internal_tls_dir and {', '.join(given)} are alternatives, got both "
               f"(internal_tls_dir={self.internal_tls_dir!r})")
        _check(len(given) in (0, 3), f"tls_cert, tls_key and tls_ca go together, got only "
                                     f"{', '.join(f'{n}={files[n]!r}' for n in given)}")
        _check(0 <= self.health_port < 65536,
               f"health_port must be in [0, 65535], got {self.health_port}")

    @property
    def is_enabled(self) -> bool:
        return bool(self.internal_tls_dir or self.tls_cert)


@dataclass(slots=True)
class PublicTlsConfig:
    """TLS on the gateway's public port: the server proves who it is; client certificates are
    asked for only with public_tls_client_ca."""

    public_tls_cert: str = opt("", "the gateway's public certificate chain (PEM); empty = "
                                   "plaintext on the public port")
    public_tls_key: str = opt("", "the private key of --public-tls-cert (PEM)")
    public_tls_client_ca: str = opt(
        "", "CA certificate (PEM): when set, clients must present a certificate it signed")

    def __post_init__(self) -> None:
        _check(bool(self.public_tls_cert) == bool(self.public_tls_key),
               f"public_tls_cert and public_tls_key go together, got public_tls_cert="
               f"{self.public_tls_cert!r}, public_tls_key={self.public_tls_key!r}")
        _check(not self.public_tls_client_ca or bool(self.public_tls_cert),
               f"public_tls_client_ca needs public_tls_cert, got public_tls_client_ca="
               f"{self.public_tls_client_ca!r} without it")

    @property
    def is_enabled(self) -> bool:
        return bool(self.public_tls_cert)


@dataclass(slots=True)
class SchedulerServiceConfig:
    host: str = opt("127.0.0.1", "address the scheduler listens on")
    port: int = opt(50052, "scheduler port; 0 = any free port")
    worker_addresses: list[str] = opt(["127.0.0.1:50053"], "host:port of each worker, by rank")
    step_timeout_s: float = opt(60.0, "deadline of one ExecuteStep call")
    startup_timeout_s: float = opt(
        600.0, "deadline of the worker handshake (model load); also how long a lost worker is "
        "waited for before its requests fail")
    stats_interval_s: float = opt(10.0, "seconds between two stats log lines (throughput, "
                                        "queues, KV-cache usage); 0 = none")
    role: Literal["both", "prefill", "decode"] = opt(
        "both", "prefill/decode disaggregation: what gateways send this replica; prefill (only "
        "the prompts of new requests, whose KV blocks decode replicas pull), decode (requests "
        "whose prompt a prefill replica computed, and every request while none serves) or "
        "both; prefill and decode need --enable-prefix-caching")
    kv_transfer_addresses: list[str] = opt(
        [], "host:port of each worker, by rank, as decode replicas reach them to pull KV blocks "
        "(a prefill replica's workers seen from other hosts); empty = worker_addresses")
    kv_transfer_timeout_s: float = opt(30.0, "deadline of one KV block transfer from a prefill "
                                              "replica; past it the prompt is computed here")
    tls: TlsConfig = field(default_factory=TlsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        _check(len(self.worker_addresses) >= 1, "worker_addresses must name at least one worker")
        _check(self.step_timeout_s > 0, f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        _check(self.stats_interval_s >= 0,
               f"stats_interval_s must be >= 0, got {self.stats_interval_s}")
        _check(self.role in REPLICA_ROLES,
               f"role must be one of {', '.join(REPLICA_ROLES)}, got {self.role!r}")
        _check(not self.kv_transfer_addresses
               or len(self.kv_transfer_addresses) == len(self.worker_addresses),
               f"kv_transfer_addresses names {len(self.kv_transfer_addresses)} workers, "
               f"worker_addresses {len(self.worker_addresses)}; one per rank")
        _check(self.kv_transfer_timeout_s > 0,
               f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")


@dataclass(slots=True)
class WorkerServiceConfig:
    host: str = opt("127.0.0.1", "address the worker listens on")
    port: int = opt(50053, "worker port; 0 = any free port")
    rank: int = opt(0, "tensor-parallel rank of this worker")
    tls: TlsConfig = field(default_factory=TlsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        _check(self.rank >= 0, f"rank must be >= 0, got {self.rank}")


# --- CLI flags generated from the fields -------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    """`int | None` → int; Literal[...] → str with choices handled by the caller."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_arguments(parser: argparse.ArgumentParser, cls: type,
                  names: Collection[str] | None = None) -> None:
    """One flag per field of `cls` (nested config dataclasses are flattened); `names`: only
    these fields of `cls` itself."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        tp = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_arguments(parser, tp)
            continue
        help_text = f.metadata.get("help", "")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if tp is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                help=f"{help_text} (default: {default})", **kw)
        elif typing.get_origin(tp) is Literal:
            parser.add_argument(_flag(f.name), choices=typing.get_args(tp),
                                help=f"{help_text} (default: {default})", **kw)
        elif typing.get_origin(tp) is list:
            parser.add_argument(_flag(f.name), nargs="+", type=typing.get_args(tp)[0],
                                help=f"{help_text} (default: {' '.join(map(str, default))})", **kw)
        elif f.metadata.get("repeatable"):
            parser.add_argument(_flag(f.name), type=tp, action=_JoinRepeated,
                                help=f"{help_text} (default: {default!r})", **kw)
        else:
            parser.add_argument(_flag(f.name), type=tp,
                                help=f"{help_text} (default: {default!r})", **kw)


class _JoinRepeated(argparse.Action):
    """A comma-list flag given several times: its values joined with commas, not the last."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if previous is None else f"{previous},{values}")


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build `cls` from parsed flags; fields not given keep their defaults. Validation runs."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            values[f.name] = from_args(tp, args)
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**values)


