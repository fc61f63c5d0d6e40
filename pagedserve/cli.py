"""The `pagedserve` command.

    pagedserve serve                   worker + scheduler + gateway on this machine, one command
    pagedserve worker | scheduler | gateway     one service each (a Kubernetes pod)
    pagedserve generate "The capital of France is" --max-tokens 32 --temperature 0
    pagedserve chat "What is the capital of France?"      (or no message: an interactive chat)

Service flags are generated from the config dataclasses (services/common/config.py, and the
gateway's own in services/gateway/config.py); sampling flags from SamplingParams, with vLLM's
defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.log_format import configure_logging
from pagedserve.services.common.config import (
    EngineConfig,
    MetricsConfig,
    PublicTlsConfig,
    SchedulerServiceConfig,
    ShutdownConfig,
    TracingConfig,
    WorkerServiceConfig,
    add_arguments,
    default_model_dir,
    from_args,
)
from pagedserve.services.common.errors import InvalidRequest, PagedServeError
from pagedserve.services.common.outputs import FinishReason
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.config import (
    API_KEY_ENV,
    AdminConfig,
    ConnectionLimitsConfig,
    GatewayConfig,
    HttpConfig,
    RequestLimitsConfig,
    RoutingConfig,
)

if TYPE_CHECKING:
    from pagedserve.client import Client, Stream

logger = logging.getLogger(__name__)

# `gateway` flags that `serve` takes as they are and hands to each of its gateway processes (its
# --host, --port, --num-grpc-servers and --metrics-port have meanings of their own there; it sets
# the scheduler addresses, the internal TLS and --reuse-port itself)
SERVE_GATEWAY_FIELDS = ("rpc_timeout_s", "max_concurrent_requests", "num_tokenizer_threads",
                        "num_tokenize_api_threads")
SERVE_METRICS_FIELDS = ("metrics_max_connections", "metrics_timeout_s")  # every child's


def _serve(args: argparse.Namespace) -> int:
    from pagedserve.supervisor import serve_stack

    config = from_args(EngineConfig, args)
    gateway = from_args(GatewayConfig, args)  # its gateways' flags, checked as `gateway` does
    if config.model.model == default_model_dir():
        from pagedserve.model_prep import prepare_default_model

        prepare_default_model(Path(config.model.model))
    if not (Path(config.model.model) / "config.json").is_file():
        raise InvalidRequest(f"model must be a Hugging Face model folder, got "
                             f"{config.model.model!r} (no config.json)")
    return asyncio.run(serve_stack(config, gateway, args.scheduler_port, args.worker_port,
                                   args.startup_timeout_s, args.internal_tls, args.log_format,
                                   data_parallel_size=args.data_parallel_size,
                                   api_server_count=args.api_server_count,
                                   roles=_disaggregated_roles(args)))


def _disaggregated_roles(args: argparse.Namespace) -> list[str]:
    """--prefill-replicas P --decode-replicas D: P replicas of role prefill, then D of role
    decode; none when neither is given."""
    if not (args.prefill_replicas or args.decode_replicas):
        return []
    if not (args.prefill_replicas > 0 and args.decode_replicas > 0):
        raise InvalidRequest(f"--prefill-replicas {args.prefill_replicas} and --decode-replicas "
                             f"{args.decode_replicas}: disaggregation needs at least one of each")
    if args.data_parallel_size != 1:
        raise InvalidRequest(f"--data-parallel-size {args.data_parallel_size} with "
                             "--prefill-replicas/--decode-replicas: those set the replicas")
    return ["prefill"] * args.prefill_replicas + ["decode"] * args.decode_replicas


def _setup_tracing(tracing: TracingConfig, service: str) -> None:
    from pagedserve.services.rpc.tracing_setup import setup_tracing, tracing_settings

    setup_tracing(tracing_settings(tracing, service))


def _worker(args: argparse.Namespace) -> int:
    from pagedserve.worker_svc.servicer import serve

    service = from_args(WorkerServiceConfig, args)
    _setup_tracing(service.tracing, "worker")
    asyncio.run(serve(from_args(EngineConfig, args), service))
    return 0


def _scheduler(args: argparse.Namespace) -> int:
    from pagedserve.scheduler_svc.servicer import serve

    service = from_args(SchedulerServiceConfig, args)
    _setup_tracing(service.tracing, "scheduler")
    asyncio.run(serve(from_args(EngineConfig, args), service))
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from pagedserve.services.gateway.app import serve

    service = from_args(GatewayConfig, args)
    _setup_tracing(service.tracing, "gateway")
    asyncio.run(serve(service))
    return 0



def _generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
    sampling = _sampling(args)
    with _client(args) as client:
        return _print_stream(client.stream(prompt, sampling=sampling), sampling.n)[0]


def _chat(args: argparse.Namespace) -> int:
    """One message and its answer, or (no message) a conversation until EOF or 'exit'."""
    sampling = _sampling(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    is_interactive = args.message is None
    with _client(args) as client:
        while True:
            if is_interactive:
                try:
                    content = input("> ")
                except EOFError:
                    print()
                    return 0
                if content.strip() in ("exit", "quit"):
                    return 0
            else:
                content = args.message
            messages.append({"role": "user", "content": content})
            code, reply = _print_stream(client.chat(messages, stream=True, sampling=sampling),
                                        sampling.n)
            if code or not is_interactive:
                return code
            messages.append({"role": "assistant", "content": reply})


def _client(args: argparse.Namespace) -> Client:
    """TLS with --tls-ca; the API key from --api-key, else $PAGEDSERVE_API_KEY."""
    from pagedserve.client import Client

    if (args.tls_cert or args.tls_key) and not args.tls_ca:
        raise InvalidRequest("--tls-cert and --tls-key need --tls-ca (TLS to the gateway)")
    return Client(args.address, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                  tls_ca=args.tls_ca or None, tls_cert=args.tls_cert or None,
                  tls_key=args.tls_key or None, timeout_s=args.timeout_s)


def _print_stream(stream: Stream, n: int) -> tuple[int, str]:
    """Prints a request's text as it arrives (n > 1: each output whole at the end); (exit code,
    text of output 0)."""
    from pagedserve.client import ClientError

    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    finish: dict[int, FinishReason] = {}
    try:
        for delta in stream:
            texts[delta.index].append(delta.text)
            if n == 1:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            if delta.finish_reason is not None:
                finish[delta.index] = delta.finish_reason
            if delta.usage is not None:
                usage = delta.usage
                print(f"[finish: {', '.join(finish[i] for i in sorted(finish))}; prompt "
                      f"{usage.prompt_tokens} tokens, completion {usage.completion_tokens}, "
                      f"cached {usage.cached_tokens}]", file=sys.stderr)
    except ClientError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        for violation in e.field_violations:
            print(f"  {violation.field}: {violation.description}", file=sys.stderr)
        return 1, ""
    if n == 1:
        print()
    else:
        for i, parts in texts.items():
            print(f"--- output {i} ---\n{''.join(parts)}")
    return 0, "".join(texts[0])


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags given (the rest keep vLLM's defaults); validated here already."""
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    return SamplingParams(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (unset flags keep vLLM's defaults)")
    hints = typing.get_type_hints(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        if f.name == "bad_words_token_ids":  # the gateway makes them from --bad-words
            continue
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (types.UnionType, typing.Union) and len(args) == 1:  # X | None
            tp, args = args[0], list(typing.get_args(args[0]))
        kw: dict[str, typing.Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                                     "help": f"default: {f.default}"}
        flag = "--" + f.name.replace("_", "-")
        if f.name == "logit_bias":
            group.add_argument(flag, nargs="+", type=_logit_bias_pair, metavar="ID=BIAS", **kw)
        elif tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(tp) is tuple:
            group.add_argument(flag, nargs="+", type=args[0], **kw)
        else:
            group.add_argument(flag, type=tp, **kw)


def _logit_bias_pair(text: str) -> tuple[int, float]:
    token_id, _, bias = text.partition("=")
    try:
        return int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be TOKEN_ID=BIAS, got {text!r}") from None



def _api_server_count(text: str) -> int:
    """A count >= 1, or 0 / auto: as many as the CPUs allow (the supervisor decides)."""
    if text == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a count or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'auto', got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    common.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one JSON object per line, with trace_id and span_id "
                             "inside a traced request (default: text)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = functools.partial(commands.add_parser, parents=[common])
    _add_serve(add_parser)
    for name, config_cls, run, help_text in (
            ("worker", WorkerServiceConfig, _worker, "the Worker service: one model replica"),
            ("scheduler", SchedulerServiceConfig, _scheduler,
             "the Scheduler service: the engine loop over its workers"),
            ("gateway", GatewayConfig, _gateway, "the public Generation and Models services")):
        command = add_parser(name, help=help_text)
        if name != "gateway":
            add_arguments(command, EngineConfig)
        add_arguments(command, config_cls)
        command.set_defaults(run=run)
    _add_client_commands(add_parser)
    return parser


def _add_serve(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    serve = add_parser(
        "serve", help="worker, scheduler and gateway on this machine (Ctrl-C stops all three)")
    add_arguments(serve, EngineConfig)
    add_arguments(serve, TracingConfig)
    add_arguments(serve, ShutdownConfig)
    add_arguments(serve, RequestLimitsConfig)
    add_arguments(serve, HttpConfig)
    add_arguments(serve, ConnectionLimitsConfig)
    add_arguments(serve, AdminConfig)
    add_arguments(serve, RoutingConfig)
    add_arguments(serve, PublicTlsConfig)
    add_arguments(serve, MetricsConfig, SERVE_METRICS_FIELDS)
    add_arguments(serve, GatewayConfig, SERVE_GATEWAY_FIELDS)
    gateway = GatewayConfig()
    serve.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    serve.add_argument("--port", type=int, default=gateway.port,
                       help="gateway port; 0 = any free port")
    serve.add_argument("--data-parallel-size", type=_positive_int, default=1,
                       help="engine replicas (a scheduler and its tensor-parallel workers each) "
                            "behind the gateway (default: 1)")
    serve.add_argument("--prefill-replicas", type=int, default=0,
                       help="prefill/decode disaggregation: this many replicas of role prefill "
                            "(new requests' prompts), with --decode-replicas, in place of "
                            "--data-parallel-size; turns on --enable-prefix-caching (default: 0)")
    serve.add_argument("--decode-replicas", type=int, default=0,
                       help="prefill/decode disaggregation: this many replicas of role decode "
                            "(the requests, their prompt blocks pulled from a prefill replica) "
                            "(default: 0)")
    serve.add_argument("--api-server-count", type=_api_server_count, default=1,
                       help="gateway processes, each with both doors, sharing --port and "
                            "--http-port (SO_REUSEPORT: the kernel spreads connections over "
                            "them); 0 or auto = one per CPU this command may use, less one per "
                            "engine replica (default: 1)")
    serve.add_argument("--num-grpc-servers", type=_positive_int, default=gateway.num_grpc_servers,
                       help="grpc.aio servers in each gateway process on --port, each starting "
                            "new calls on its own (SO_REUSEPORT among them); 4 halved the TTFT "
                            "of 256 streams through one gateway (default: 1)")
    serve.add_argument("--scheduler-port", type=int, default=0,
                       help="replica r's scheduler listens on this port + r; 0 = any free port")
    serve.add_argument("--worker-port", type=int, default=0,
                       help="replica r's rank-0 worker listens on this port + r; 0 = any free "
                            "port")
    serve.add_argument("--metrics-port", type=int, default=-1,
                       help="Prometheus /metrics: the gateway's on this port, the scheduler's on "
                            "the next, worker rank r's on port + 2 + r; replica d's scheduler "
                            "d * (1 + tensor_parallel_size) ports further; 0 = free ports "
                            "(logged); -1 = none (default: -1)")
    serve.add_argument("--startup-timeout-s", type=float, default=600.0,
                       help="how long the three may take to become ready")
    serve.add_argument("--internal-tls", action=argparse.BooleanOptionalAction, default=True,
                       help="mutual TLS between the three, with certificates of a throw-away CA "
                            "made for this run (default: on)")
    serve.set_defaults(run=_serve)


def _add_client_commands(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    gateway = GatewayConfig()
    generate = add_parser("generate", help="stream a completion of a prompt to stdout")
    generate.add_argument("prompt", nargs="?", help="the prompt text; '-' or none = stdin")
    generate.set_defaults(run=_generate)
    chat = add_parser("chat", help="chat with the model (its chat template)")
    chat.add_argument("message", nargs="?", help="one message and its answer; none = interactive")
    chat.add_argument("--system", default="", help="a system message first")
    chat.set_defaults(run=_chat)
    for command in (generate, chat):
        command.add_argument("--address", default=f"{gateway.host}:{gateway.port}",
                             help="the gateway's host:port")
        command.add_argument("--timeout-s", type=float, default=600.0,
                             help="deadline of one request")
        command.add_argument("--tls-ca", default="", help="TLS to the gateway: the CA "
                             "certificate (PEM) its certificate must chain to; empty = plaintext")
        command.add_argument("--tls-cert", default="", help="with --tls-ca: a client "
                             "certificate (PEM), for a gateway that asks for one")
        command.add_argument("--tls-key", default="", help="the private key of --tls-cert")
        command.add_argument("--api-key", default="", help="for a gateway started with an API "
                             f"key; empty = ${API_KEY_ENV}, else none")
        _add_sampling_arguments(command)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format, args.command)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        return args.run(args)
    except InvalidRequest as e:  # bad flags (ConfigError included) or sampling parameters
        parser.exit(2, f"pagedserve {args.command}: error: {e}\n")
    except PagedServeError as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
