"""The gateway's own configuration: its flags, the HTTP API and its connection limits, routing
over the scheduler replicas, the limits one request may ask for and the admin credential. Part of
the one config tree (the shared helpers and the configs every service uses live in
services/common/config.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pagedserve.services.common.config import (
    MetricsConfig,
    PublicTlsConfig,
    ShutdownConfig,
    TlsConfig,
    TracingConfig,
    _check,
    _check_choices,
    opt,
)
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.sampling_params import MAX_LOGPROBS

API_KEY_ENV = "PAGEDSERVE_API_KEY"


TOOL_CALL_PARSERS = ("", "hermes", "llama3_json")  # openai/tool_parser.py's formats, "" = none


@dataclass(slots=True)
class HttpConfig:
    """The gateway's OpenAI-compatible HTTP API, and the API key that guards it and gRPC alike."""

    http_port: int = opt(8000, "OpenAI-compatible HTTP port, on the gateway's host; 0 = off, "
                               "-1 = any free port")
    chat_template: str = opt("", "a Jinja chat template, or the path of a file holding one, in "
                                 "place of the model's, for chat requests at both doors; empty "
                                 "= the model's")
    max_request_body_bytes: int = opt(
        4 << 20, "largest HTTP request body; larger -> 413 before any of it is parsed. JSON is "
                 "parsed on the event loop (about 0.25 s for 4 MiB of token ids), so this bounds "
                 "the stall one body can cause; the gRPC door's bound is --max-request-bytes")
    api_key: str = field(default="", repr=False, metadata={
        "help": "when set, every Generation/Models call and HTTP request but health and metrics "
                "needs 'Authorization: Bearer KEY'; empty = api_key_file, else $" + API_KEY_ENV})
    api_key_file: str = opt("", "file holding the API key (its first line)")
    tool_call_parser: str = opt("", "how `tool_choice: auto` reads the model's tool calls: "
                                    "hermes (Hermes, Qwen2.5 <tool_call>) or llama3_json; "
                                    "empty = the chat template's own format, else none")

    def __post_init__(self) -> None:
        _check(self.tool_call_parser in TOOL_CALL_PARSERS,
               f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got "
               f"{self.tool_call_parser!r}")
        _check(-1 <= self.http_port < 65536,
               f"http_port must be in [-1, 65535], got {self.http_port}")
        _check(self.max_request_body_bytes >= 1024,
               f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}")
        _check(not (self.api_key and self.api_key_file),
               f"set api_key or api_key_file, not both (api_key_file={self.api_key_file!r})")

    def resolve_api_key(self, environ: Mapping[str, str] = os.environ) -> str:
        """The key: api_key, else api_key_file's first line, else $PAGEDSERVE_API_KEY; empty =
        no key."""
        return _secret(self.api_key, "api_key_file", self.api_key_file, environ.get(API_KEY_ENV, ""))


def _secret(value: str, file_field: str, path: str, from_env: str) -> str:
    """A credential given as a value, else as a file (its first line), else from the
    environment; the file is read here so that a bad one fails at start-up."""
    if value:
        return value
    if path:
        try:
            lines = Path(path).read_text().strip().splitlines()
        except OSError as e:
            raise ConfigError(f"{file_field} {path!r} cannot be read: {e.strerror}") from e
        _check(bool(lines) and bool(lines[0].strip()), f"{file_field} {path!r} holds no key")
        return lines[0].strip()
    return from_env


@dataclass(slots=True)
class ConnectionLimitsConfig:
    """How long and how many connections the gateway's doors hold for their clients, so that
    idle, slow or numerous sockets cannot take every file descriptor."""

    http_header_timeout_s: float = opt(
        10.0, "an HTTP connection must send a request's line and headers within this many "
              "seconds of opening (or of the request's first byte on a kept-alive connection): "
              "one that sent nothing is closed, one that sent part of its headers gets 408")
    http_body_timeout_s: float = opt(
        60.0, "an HTTP request's body must arrive within this many seconds of its headers, "
              "else 408 and the connection closes")
    http_keep_alive_timeout_s: float = opt(
        5.0, "an HTTP connection idle this long between two requests is closed")
    max_http_connections: int = opt(
        4096, "most open HTTP connections per gateway process; a request on one more is "
              "answered 503 and its connection closed (the process's open-file limit is raised "
              "to fit, where the hard limit allows)")
    max_http_connections_per_client: int = opt(
        1024, "most open HTTP connections from one client address (behind a proxy: the "
              "proxy's); a request on one more is answered 429 and its connection closed; "
              "0 = no per-address cap")
    http_stream_send_buffer_bytes: int = opt(
        16 << 10, "kernel send buffer (SO_SNDBUF) of a streaming response's connection: what a "
                  "client that stops reading may leave unread below the gateway before "
                  "--max-unread-stream-tokens counts it; larger helps a fast stream on a "
                  "long-distance link")
    grpc_handshake_timeout_s: float = opt(
        10.0, "a gRPC connection must finish its TLS and HTTP/2 handshake within this many "
              "seconds, else it is closed")
    grpc_max_connection_idle_s: float = opt(
        300.0, "a gRPC connection with no call open for this long is closed (GOAWAY; the "
               "client's channel reconnects on its next call)")

    def __post_init__(self) -> None:
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_keep_alive_timeout_s",
                     "grpc_handshake_timeout_s", "grpc_max_connection_idle_s"):
            value = getattr(self, name)
            _check(value > 0, f"{name} must be > 0, got {value}")
        _check(self.max_http_connections >= 1,
               f"max_http_connections must be >= 1, got {self.max_http_connections}")
        _check(self.max_http_connections_per_client >= 0, "max_http_connections_per_client "
               f"must be >= 0, got {self.max_http_connections_per_client}")
        _check(self.http_stream_send_buffer_bytes >= 4096, "http_stream_send_buffer_bytes "
               f"must be >= 4096, got {self.http_stream_send_buffer_bytes}")


@dataclass(slots=True)
class RoutingConfig:
    """How a gateway spreads requests over its scheduler replicas and moves them off one that
    fails."""

    routing_policy: Literal["affinity", "least-loaded", "round-robin"] = opt(
        "affinity", "affinity: a hash of the prompt's first full KV blocks picks the replica (a "
        "consistent-hash ring), so shared prefixes meet their cached blocks, bounded by load; "
        "least-loaded: fewest running + waiting requests; round-robin: in turn")
    routing_max_imbalance: float = opt(
        1.5, "affinity yields to the least loaded replica when the preferred one would carry "
        "more than this factor times the mean load of the serving replicas")
    routing_prefix_blocks: int = opt(
        4, "full KV blocks at the start of the prompt that make its affinity key when it has no "
        "branch point known to the gateway (see --routing-index-blocks)")
    routing_index_blocks: int = opt(
        65536, "prompt prefixes (in KV blocks) a gateway remembers the replica of: a chat's next "
        "turn follows its history, and the chats of a shared system prompt spread over the "
        "replicas by their first blocks of their own")
    routing_kv_events: bool = opt(
        True, "affinity corrects its guess by the KV blocks each replica reports it holds (its "
        "KV events): a replica holding more of the prompt's leading blocks than the guessed one "
        "and than the prefix the prompt shares with other chats is preferred; off: the "
        "gateway's own memory of where it sent prompts decides alone")
    routing_offload_weight: float = opt(
        0.5, "what a prefix block a replica holds in host memory counts for against one on "
        "the GPU (a hit there costs a copy back)")
    replica_refresh_s: float = opt(
        10.0, "seconds between two resolutions of --scheduler-address (a DNS name may resolve "
        "to several replicas: replicas come and go without a restart)")
    failover_timeout_s: float = opt(
        30.0, "how long a request whose replica failed waits for a serving replica (another "
        "one, or the same once back) before it ends with UNAVAILABLE")
    max_local_prefill_tokens: int = opt(
        512, "prefill/decode disaggregation: a prompt of at most this many tokens is computed "
        "on the decode replica itself (its prefill costs less there than a trip through a "
        "prefill replica); 0 = every prompt of a full block or more goes to a prefill replica")

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.routing_max_imbalance >= 1.0,
               f"routing_max_imbalance must be >= 1, got {self.routing_max_imbalance}")
        _check(self.routing_prefix_blocks >= 1,
               f"routing_prefix_blocks must be >= 1, got {self.routing_prefix_blocks}")
        _check(self.routing_index_blocks >= 1,
               f"routing_index_blocks must be >= 1, got {self.routing_index_blocks}")
        _check(0.0 <= self.routing_offload_weight <= 1.0,
               f"routing_offload_weight must be in [0, 1], got {self.routing_offload_weight}")
        _check(self.replica_refresh_s > 0,
               f"replica_refresh_s must be > 0, got {self.replica_refresh_s}")
        _check(self.failover_timeout_s >= 0,
               f"failover_timeout_s must be >= 0, got {self.failover_timeout_s}")
        _check(self.max_local_prefill_tokens >= 0,
               f"max_local_prefill_tokens must be >= 0, got {self.max_local_prefill_tokens}")


@dataclass(slots=True)
class RequestLimitsConfig:
    """What one request may ask of a gateway, checked before any per-output work (admission by
    cost): over a limit the request is refused with INVALID_ARGUMENT naming the field."""

    max_num_seqs_per_request: int = opt(
        64, "most sequences (n, best_of, the beam width) one request may run; also capped by the "
            "scheduler's max_num_seqs")
    max_logprobs: int = opt(MAX_LOGPROBS, "most logprobs and prompt_logprobs candidates per "
                                          f"position (at most {MAX_LOGPROBS})")
    max_stop_strings: int = opt(64, "most stop strings per request")
    max_stop_string_chars: int = opt(256, "longest stop string, in characters")
    max_stop_token_ids: int = opt(1024, "most stop token ids per request")
    max_chat_messages: int = opt(1024, "most chat messages per request")
    max_request_bytes: int = opt(
        4 << 20, "largest request in bytes (prompt, messages, stop strings); also the gRPC "
                 "server's max_receive_message_length")
    stalled_stream_timeout_s: float = opt(
        30.0, "a stream whose client stops reading for this long (one response cannot be "
              "written) is aborted with RESOURCE_EXHAUSTED, its request's KV blocks freed")
    max_unread_stream_tokens: int = opt(
        16, "backpressure: a stream whose client has more generated tokens than this unread "
            "(held by the gateway, past what the connection itself buffers) is paused in its "
            "scheduler, costing the engine nothing, and resumed once half of them are read; "
            "0 = never pause")
    stream_interval: int = opt(
        1, "output tokens per streamed message: a stream's text is held until it carries this "
           "many tokens (an output's first token, its end and errors go at once); larger values "
           "cut the gateway's and the clients' CPU per token, 1 = every token as it comes")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs_per_request", "max_stop_string_chars", "max_chat_messages",
                     "max_request_bytes"):
            value = getattr(self, name)
            _check(value >= 1, f"{name} must be >= 1, got {value}")
        _check(0 <= self.max_logprobs <= MAX_LOGPROBS,
               f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        for name in ("max_stop_strings", "max_stop_token_ids"):
            value = getattr(self, name)
            _check(value >= 0, f"{name} must be >= 0, got {value}")
        _check(self.max_unread_stream_tokens >= 0,
               f"max_unread_stream_tokens must be >= 0, got {self.max_unread_stream_tokens}")
        _check(self.stalled_stream_timeout_s > 0,
               f"stalled_stream_timeout_s must be > 0, got {self.stalled_stream_timeout_s}")
        _check(self.stream_interval >= 1,
               f"stream_interval must be >= 1, got {self.stream_interval}")
        max_unread = self.max_unread_stream_tokens
        _check(not max_unread or self.stream_interval <= max_unread,
               f"stream_interval must be at most max_unread_stream_tokens ({max_unread}) while "
               f"backpressure is on, got {self.stream_interval}: a paused stream would hold its "
               f"last tokens back")


ADMIN_TOKEN_ENV = "PAGEDSERVE_ADMIN_TOKEN"


@dataclass(slots=True)
class AdminConfig:
    """The deployment's admin credential: its holder may abort any request (every other caller
    aborts only its own)."""

    admin_token: str = field(default="", repr=False, metadata={
        "help": "a credential (sent as 'authorization: Bearer <token>') that may abort any "
                "request; empty = admin_token_file, else $" + ADMIN_TOKEN_ENV + ", else none"})
    admin_token_file: str = opt("", "file holding the admin token (its first line)")

    def __post_init__(self) -> None:
        _check(not (self.admin_token and self.admin_token_file),
               f"set admin_token or admin_token_file, not both "
               f"(admin_token_file={self.admin_token_file!r})")

    def resolve_admin_token(self, environ: Mapping[str, str] = os.environ) -> str:
        return _secret(self.admin_token, "admin_token_file", self.admin_token_file,
                       environ.get(ADMIN_TOKEN_ENV, ""))


@dataclass(slots=True)
class GatewayConfig:
    host: str = opt("127.0.0.1", "address the gateway listens on")
    port: int = opt(50051, "gateway port; 0 = any free port")
    scheduler_address: str = opt(
        "127.0.0.1:50052", "host:port of the scheduler replicas, comma-separated or the flag "
        "repeated; a host name that resolves to several addresses (a headless Service) is one "
        "replica per address", repeatable=True)
    tokenizer: str = opt("", "folder with the tokenizer and chat template; empty = the model "
                             "folder the scheduler reports serving")
    reuse_port: bool = opt(
        False, "share the gRPC and HTTP ports with other gateway processes of this host "
               "(SO_REUSEPORT): the kernel spreads new connections over them; `serve "
               "--api-server-count` sets it")
    num_grpc_servers: int = opt(
        1, "grpc.aio servers in this process on the gRPC port, each starting new calls on its "
           "own (a busy event loop starts few per server); more than one shares the port "
           "(SO_REUSEPORT) as reuse_port does")
    rpc_timeout_s: float = opt(10.0, "deadline of unary calls to the scheduler")
    max_concurrent_requests: int = opt(1024, "requests in flight before RESOURCE_EXHAUSTED")
    num_tokenizer_threads: int = opt(
        2, "threads that tokenize prompts and render chat templates off the event loop")
    num_tokenize_api_threads: int = opt(
        1, "threads that serve Tokenize, /tokenize and /detokenize, apart from the tokenizer "
           "threads of generation requests, so that tokenize calls never delay a generation")
    limits: RequestLimitsConfig = field(default_factory=RequestLimitsConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    public_tls: PublicTlsConfig = field(default_factory=PublicTlsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    connections: ConnectionLimitsConfig = field(default_factory=ConnectionLimitsConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        _check(self.num_grpc_servers >= 1,
               f"num_grpc_servers must be >= 1, got {self.num_grpc_servers}")
        _check(self.rpc_timeout_s > 0, f"rpc_timeout_s must be > 0, got {self.rpc_timeout_s}")
        _check(self.max_concurrent_requests >= 1,
               f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        for name in ("num_tokenizer_threads", "num_tokenize_api_threads"):
            value = getattr(self, name)
            _check(value >= 1, f"{name} must be >= 1, got {value}")
        targets = scheduler_targets(self.scheduler_address)
        _check(bool(targets) and all(t.rpartition(":")[0] and t.rpartition(":")[2].isdigit()
                                     for t in targets),
               f"scheduler_address must be comma-separated host:port targets, got "
               f"{self.scheduler_address!r}")


def scheduler_targets(scheduler_address: str) -> list[str]:
    """The comma-separated host:port targets of a gateway's --scheduler-address, in order."""
    return list(dict.fromkeys(t.strip() for t in scheduler_address.split(",") if t.strip()))
