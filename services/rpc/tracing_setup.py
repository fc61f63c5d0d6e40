"""Installing OpenTelemetry tracing in a service: the flags (TracingConfig) where given, else the
standard OTEL_* variables, read when the service starts, never at import."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from pagedserve.services.common.config import TracingConfig
from pagedserve.services.common.errors import ConfigError

logger = logging.getLogger(__name__)

EXPORTERS = ("none", "console", "otlp")


@dataclass(frozen=True, slots=True)
class TracingSettings:
    exporters: tuple[str, ...]  # empty: tracing off
    endpoint: str  # empty: the OTLP exporter's own default (OTEL_EXPORTER_OTLP_ENDPOINT...)
    service_name: str


def tracing_settings(config: TracingConfig, service: str,
                     env: Mapping[str, str] | None = None) -> TracingSettings:
    env = os.environ if env is None else env
    if config.otel_exporter:
        names, source = config.otel_exporter, "otel_exporter"
    elif env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        names, source = "none", "OTEL_SDK_DISABLED"
    else:
        names, source = env.get("OTEL_TRACES_EXPORTER", "none"), "OTEL_TRACES_EXPORTER"
    exporters = tuple(dict.fromkeys(n.strip().lower() for n in names.split(",") if n.strip()))
    bad = [n for n in exporters if n not in EXPORTERS]
    if bad:
        raise ConfigError(f"{source} must list exporters among {list(EXPORTERS)}, got {names!r}")
    exporters = tuple(n for n in exporters if n != "none")
    service_name = (config.service_name or env.get("OTEL_SERVICE_NAME", "").strip()
                    or f"pagedserve-{service}")
    return TracingSettings(exporters, config.otel_endpoint, service_name)


def build_tracer_provider(settings: TracingSettings) -> TracerProvider | None:
    if not settings.exporters:
        return None
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: settings.service_name}))
    for name in settings.exporters:
        provider.add_span_processor(BatchSpanProcessor(_span_exporter(name, settings.endpoint)))
    return provider


def _span_exporter(name: str, endpoint: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint or None)


def setup_tracing(settings: TracingSettings) -> TracerProvider | None:
    """Idempotent: an SDK TracerProvider already installed (an earlier call, a test) wins.
    Call it before the servers and channels serve traffic."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    provider = build_tracer_provider(settings)
    if provider is not None:
        trace.set_tracer_provider(provider)
        logger.info("tracing on: service.name=%s, exporters=%s%s", settings.service_name,
                    ",".join(settings.exporters),
                    f" ({settings.endpoint})" if settings.endpoint else "")
    return provider
