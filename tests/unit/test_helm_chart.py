"""The Helm chart (helm/pagedserve): every value a template reads exists, every flag it passes is
a real flag of that `pagedserve` subcommand, the values' flag maps make a valid configuration;
rendered by the real Helm engine (helm-python-sdk), the services parse their arguments and probe
the ports they listen on. test_helm_render.py: schemas, policies, the values matrix."""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_python.errors import HelmError
from pagedserve.scheduler_svc.metrics import SchedulerMetrics
from pagedserve.services.common.config import (
    EngineConfig,
    SchedulerServiceConfig,
    WorkerServiceConfig,
    from_args,
)
from pagedserve.services.common.engine_api import EngineLoad
from pagedserve.services.gateway.config import (
    ADMIN_TOKEN_ENV,
    API_KEY_ENV,
    GatewayConfig,
    HttpConfig,
)
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.worker_svc.metrics import WorkerMetrics
from prometheus_client import CollectorRegistry

from pagedserve.cli import build_parser
from tests.unit.helm_render import FULLNAME, by_name, render

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pagedserve"
TEMPLATES = CHART / "templates"
SERVICES = ("gateway", "scheduler", "worker")
SERVICE_CONFIGS = {"gateway": GatewayConfig, "scheduler": SchedulerServiceConfig,
                   "worker": WorkerServiceConfig}
WORKLOADS = {"gateway": "gateway-deployment.yaml", "scheduler": "engine-statefulset.yaml",
             "worker": "engine-statefulset.yaml"}
# engine.* keys that are chart settings, not flags ("pagedserve.engineFlags" omits them)
ENGINE_CHART_KEYS = ("replicas", "prefillReplicas", "gpuResource", "shmSizeLimit", "pod",
                     "podDisruptionBudget", "autoscaling")

_VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_]\w*)+)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_CAMEL_KEY = re.compile(r"[a-z]+(?:[A-Z][a-z0-9]*)*")
_TEMPLATE_COMMENT = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", re.S)


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def _template_files() -> list[Path]:
    return sorted(p for p in TEMPLATES.rglob("*") if p.is_file())


def _engine_flags(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values["engine"].items() if k not in ENGINE_CHART_KEYS}


def _option_strings(command: str) -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for action in commands.choices[command]._actions for s in action.option_strings}


def _kebab(key: str) -> str:
    """Sprig's kebabcase, for the plain camelCase keys the chart uses."""
    assert _CAMEL_KEY.fullmatch(key), f"flag-map key {key!r} is not plain camelCase"
    return re.sub(r"(?=[A-Z])", "-", key).lower()


def _flags(mapping: dict[str, Any]) -> list[str]:
    """What the chart's "pagedserve.flags" helper renders for a flag map."""
    argv: list[str] = []
    for key, value in sorted(mapping.items()):
        flag = _kebab(key)
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None and value != "":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            argv += [f"--{flag}", str(value)]
    return argv


def _service_argv(values: dict[str, Any], service: str) -> list[str]:
    """The flags each workload template gives its `pagedserve <service>` (rank 0 for a worker)."""
    argv = ["--host", values["listenHost"], "--port", str(values[service]["port"]),
            "--log-level", values["logLevel"], "--drain-timeout-s", str(values["drainTimeoutS"]),
            *(["--metrics-port", str(values["metrics"]["port"])]
              if values["metrics"]["enabled"] else []),
            *_flags(values["tracing"])]
    if service == "gateway":
        return [*argv, "--scheduler-address", f"scheduler:{values['scheduler']['port']}",
                "--http-port", str(values["gateway"]["httpPort"]),
                *_flags(values["gateway"]["args"])]
    argv += ["--model", values["model"]["path"], *_flags(_engine_flags(values))]
    if service == "worker":
        return ["--rank", "0", *argv]
    tp = values["engine"]["tensorParallelSize"]
    return [*argv, "--worker-addresses",
            *(f"127.0.0.1:{values['worker']['port'] + rank}" for rank in range(tp)),
            *_flags(values["scheduler"]["args"])]


def _parse(service: str, argv: list[str]) -> argparse.Namespace:
    unknown = {a.split("=")[0] for a in argv if a.startswith("--")} - _option_strings(service)
    assert not unknown, f"pagedserve {service} has no flags {sorted(unknown)}"
    return build_parser().parse_args([service, *argv])


# --- chart and values ---------------------------------------------------------------------------


def test_chart_metadata_and_default_image_tag_follow_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "pagedserve"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert chart["appVersion"] == project["version"]  # the image tag when image.tag is empty


def test_every_value_a_template_reads_exists_in_values_yaml():
    values = _values()
    missing = []
    for path in _template_files():
        for ref in _VALUES_REF.findall(path.read_text()):
            node: Any = values
            for key in ref.strip(".").split("."):
                if not isinstance(node, dict) or key not in node:
                    missing.append(f"{path.name}: .Values{ref}")
                    break
                node = node[key]
    assert not missing, missing


def test_every_literal_flag_is_a_flag_of_its_subcommand():
    """Helpers serve all three services; the engine pod runs a scheduler and workers (a flag of
    either; the rendered tests parse each container's argv); NOTES.txt shows `pagedserve chat`,
    the test hook `pagedserve generate`."""
    commands = {path.name: [s for s in SERVICES if path.name.startswith(s)]
                for path in _template_files()}
    commands["_helpers.tpl"] = list(SERVICES)
    commands["engine-statefulset.yaml"] = ["scheduler|worker"]
    commands["NOTES.txt"] = ["chat"]
    commands["test-generate.yaml"] = ["generate"]
    checked = 0
    for path in _template_files():
        text = _TEMPLATE_COMMENT.sub("", path.read_text())
        for flag in set(_FLAG.findall(text)):
            for service in commands[path.name]:
                options = set().union(*(_option_strings(s) for s in service.split("|")))
                assert flag in options, f"{path.name}: pagedserve {service} {flag}"
                checked += 1
    assert checked >= 10


@pytest.mark.parametrize("service", SERVICES)
def test_values_flag_maps_make_a_valid_configuration(service):
    """Engine flags go to the scheduler and the workers alike, tracing to all three; parsed by
    the real CLI and validated by the config tree."""
    values = _values()
    args = _parse(service, _service_argv(values, service))
    config = from_args(SERVICE_CONFIGS[service], args)
    assert config.port == values[service]["port"]
    assert config.tracing.otel_exporter == values["tracing"]["otelExporter"]
    assert config.metrics.metrics_port == values["metrics"]["port"]
    assert config.shutdown.drain_timeout_s == values["drainTimeoutS"]
    if service != "gateway":
        engine = from_args(EngineConfig, args)
        assert engine.model.model == values["model"]["path"]
        assert engine.parallel.tensor_parallel_size == values["engine"]["tensorParallelSize"]
        assert engine.cache.block_size == values["engine"]["blockSize"]


def test_flag_maps_render_booleans_and_big_numbers_as_the_cli_reads_them():
    argv = _flags({"enableCudaGraph": False, "maxNumBatchedTokens": 1048576.0,
                   "maxModelLen": None, "tokenizer": "", "swapSpaceGib": 0.5})
    assert argv == ["--no-enable-cuda-graph", "--max-num-batched-tokens", "1048576",
                    "--swap-space-gib", "0.5"]
    args = _parse("worker", argv)
    assert from_args(EngineConfig, args).scheduler.max_num_batched_tokens == 1048576


def test_model_path_lies_on_the_model_volume():
    model = _values()["model"]
    assert model["path"].startswith(model["mountPath"].rstrip("/") + "/")
    assert model["existingClaim"] or model["hostPath"]


# --- templates ----------------------------------------------------------------------------------


def test_gateway_service_exposes_the_http_api_and_the_key_comes_from_a_secret():
    values = _values()["gateway"]
    assert values["httpPort"] == HttpConfig().http_port
    config = from_args(GatewayConfig, _parse("gateway", _service_argv(_values(), "gateway")))
    assert config.http.http_port == values["httpPort"]
    deployment = _template("gateway-deployment.yaml")
    assert "- --http-port\n            - {{ .Values.gateway.httpPort | quote }}" in deployment
    assert "containerPort: {{ .Values.gateway.httpPort }}" in deployment
    assert f"- name: {API_KEY_ENV}\n" in deployment and "secretKeyRef" in deployment
    assert "--api-key" not in deployment  # a key never on a command line
    service = _template("gateway-service.yaml")
    assert re.search(r"- name: http\n\s+port: \{\{ \.Values\.gateway\.httpPort \}\}\n"
                     r"\s+targetPort: http\n", service)


def test_the_api_key_and_admin_token_reach_the_gateway_pods_only():
    objects = render({"gateway": {"apiKeySecret": {"name": "keys"},
                                  "adminTokenSecret": {"name": "admin", "key": "token"}}})
    containers = {}
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in (*spec.get("initContainers", ()), *spec.get("containers", ())):
            containers[(obj["metadata"]["name"], container["name"])] = container
    secrets = {name: {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c.get("env", ())
                      if "secretKeyRef" in e.get("valueFrom", {})}
               for name, c in containers.items()}
    assert secrets.pop((f"{FULLNAME}-gateway", "gateway")) == {
        API_KEY_ENV: {"name": "keys", "key": "api-key"},
        ADMIN_TOKEN_ENV: {"name": "admin", "key": "token"}}
    assert any(name[0] == f"{FULLNAME}-engine" for name in secrets)
    assert all(not refs for refs in secrets.values()), secrets


def _tls_argv(values: dict[str, Any], own_port_has_tls: bool) -> list[str]:
    """What the chart's "pagedserve.tlsFlags" helper renders."""
    internal = values["tls"]["internal"]
    argv = ["--internal-tls-dir", internal["mountPath"]] if internal["enabled"] else []
    if internal["enabled"] and internal["serverName"]:
        argv += ["--tls-server-name", internal["serverName"]]
    if own_port_has_tls:
        argv += ["--health-port", str(values["tls"]["healthPort"])]
    return argv


@pytest.mark.parametrize("service", SERVICES)
def test_internal_tls_gives_every_service_the_mounted_secret_and_probes_the_health_port(service):
    values = _values()
    assert values["tls"]["internal"]["enabled"] is False  # plaintext, as the CLI defaults
    values["tls"]["internal"].update(enabled=True, serverName="pagedserve-internal")
    own_port_has_tls = service != "gateway"  # the gateway's own port is the public one
    argv = [*_service_argv(values, service), *_tls_argv(values, own_port_has_tls)]
    tls = from_args(SERVICE_CONFIGS[service], _parse(service, argv)).tls
    assert tls.internal_tls_dir == values["tls"]["internal"]["mountPath"]
    assert tls.tls_server_name == "pagedserve-internal"
    assert tls.health_port == (values["tls"]["healthPort"] if own_port_has_tls else 0)
    objects = by_name(render({"tls": {"internal": {"enabled": True}}}))
    workload = objects[("Deployment", f"{FULLNAME}-gateway")] if service == "gateway" else \
        objects[("StatefulSet", f"{FULLNAME}-engine")]
    spec = workload["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"]
               if v["name"].startswith("internal-tls")}
    roles = ["gateway"] if service == "gateway" else ["scheduler", "worker"]
    assert secrets == {f"internal-tls-{role}": f"{FULLNAME}-internal-tls-{role}"
                       for role in roles}  # one certificate per role, never another's
    for container in spec["containers"]:
        role = "worker" if container["name"].startswith("worker") else container["name"]
        mounts = [m for m in container["volumeMounts"] if m["name"].startswith("internal-tls")]
        assert mounts == [{"name": f"internal-tls-{role}", "readOnly": True,
                           "mountPath": values["tls"]["internal"]["mountPath"]}]


def test_public_tls_passes_the_secrets_files_to_the_gateway():
    values = _values()
    public = values["tls"]["public"]
    text = _template("gateway-deployment.yaml")
    for flag, name in (("--public-tls-cert", "tls.crt"), ("--public-tls-key", "tls.key"),
                       ("--public-tls-client-ca", "ca.crt")):
        mounted = f'{{{{ printf "%s/{name}" $public.mountPath | quote }}}}'
        assert f"- {flag}\n            - {mounted}" in text
    argv = [*_service_argv(values, "gateway"), "--health-port", "8081",
            "--public-tls-cert", f"{public['mountPath']}/tls.crt",
            "--public-tls-key", f"{public['mountPath']}/tls.key",
            "--public-tls-client-ca", f"{public['mountPath']}/ca.crt"]
    config = from_args(GatewayConfig, _parse("gateway", argv))
    assert config.public_tls.is_enabled and config.public_tls.public_tls_client_ca
    assert "tls.public.secretName must name a Secret" in text


def test_metrics_ports_scrape_annotations_service_monitors_and_otel_env():
    values = _values()
    assert values["metrics"]["enabled"] and not values["metrics"]["serviceMonitor"]["enabled"]
    objects = by_name(render({"engine": {"tensorParallelSize": 2}, "otelEnv": {"A": 1},
                              "metrics": {"serviceMonitor": {"enabled": True}}}))
    for component in ("gateway", "engine"):
        kind = "Deployment" if component == "gateway" else "StatefulSet"
        pod = objects[(kind, f"{FULLNAME}-{component}")]["spec"]["template"]
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        service_ports = {p["name"]: p["port"] for p in
                         objects[("Service", f"{FULLNAME}-{component}")]["spec"]["ports"]}
        monitor = objects[("ServiceMonitor", f"{FULLNAME}-{component}")]["spec"]
        scraped = [e["port"] for e in monitor["endpoints"]]
        for container in pod["spec"]["containers"]:
            assert {"name": "A", "value": "1"} in container["env"]
            (port,) = [p for p in container["ports"] if p["name"].startswith("metrics")]
            assert service_ports[port["name"]] == port["containerPort"]
            assert port["name"] in scraped
            flag = container["args"].index("--metrics-port")
            assert container["args"][flag + 1] == str(port["containerPort"])
    dashboard_map = _template("grafana-dashboard.yaml")
    assert '.Files.Get "dashboards/pagedserve.json"' in dashboard_map
    assert values["metrics"]["grafanaDashboard"]["labels"] == {"grafana_dashboard": "1"}


def _exported_metric_names() -> set[str]:
    """Every sample name the three services' collectors expose."""
    registry = CollectorRegistry()
    load = EngineLoad(0, 0, 0, 0, 1, 0, 1, 0.0, 0, 0)
    SchedulerMetrics(registry, "m", lambda: load)
    GatewayMetrics(registry, "m", 4096)
    WorkerMetrics(registry, "m", 0)
    names = {sample.name for family in registry.collect() for sample in family.samples}
    # a labelled family without a sample yet exposes nothing: add its names by hand
    return names | {"vllm:request_success_total", "pagedserve:gateway_requests_total",
                    "pagedserve:swapped_blocks_total"}


def test_the_grafana_dashboard_reads_only_metrics_pagedserve_exports():
    dashboard = json.loads((CHART / "dashboards" / "pagedserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"(?:vllm|pagedserve):[a-z0-9_]+", expr)}
    assert not used - _exported_metric_names()
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket", "vllm:generation_tokens_total"} <= used
    assert all('model_name=~"$model_name"' in expr for expr in exprs)


# --- rendered by Helm ---------------------------------------------------------------------------


def _workloads(values: dict[str, Any]) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Each service's container and argv, from the rendered manifests (rank 1 for a worker)."""
    objects = by_name(render(values))
    gateway = objects[("Deployment", f"{FULLNAME}-gateway")]["spec"]["template"]["spec"]
    engine = objects[("StatefulSet", f"{FULLNAME}-engine")]["spec"]["template"]["spec"]
    containers = {"gateway": gateway["containers"][0], "scheduler": engine["containers"][0],
                  "worker": engine["containers"][-1]}
    return {s: (c, c["args"]) for s, c in containers.items()}


@pytest.mark.parametrize("values", [{}, {"engine": {"tensorParallelSize": 2},
                                         "drainTimeoutS": 45, "tracing": {
                                             "otelExporter": "otlp",
                                             "otelEndpoint": "http://collector:4317"}}])
def test_rendered_workloads_run_real_commands_and_probe_their_ports(values):
    tp = 2 if values else 1
    drain_s = 45 if values else 30
    objects = by_name(render(values))
    for kind, name in (("Deployment", "gateway"), ("StatefulSet", "engine")):
        pod = objects[(kind, f"{FULLNAME}-{name}")]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 2 * drain_s
    for service, (container, argv) in _workloads(values).items():
        assert container["command"] == ["pagedserve", service]
        config = from_args(SERVICE_CONFIGS[service], _parse(service, argv))
        assert config.shutdown.drain_timeout_s == drain_s
        ports = {p["name"].rsplit("-", 1)[0]: p["containerPort"] for p in container["ports"]}
        assert ports.pop("grpc") == config.port
        if service == "gateway":
            assert ports.pop("http") == config.http.http_port
            service_ports = objects[("Service", f"{FULLNAME}-gateway")]["spec"]["ports"]
            assert {p["name"]: p["targetPort"] for p in service_ports
                    if p["name"] != "metrics"} == {"grpc": "grpc", "http": "http"}
        assert ports.pop("metrics") == config.metrics.metrics_port
        assert not ports
        for probe in ("startupProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {"port": config.port}
        assert container["livenessProbe"]["tcpSocket"] == {"port": config.port}
        if service == "worker":
            assert config.rank == tp - 1
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        if service == "scheduler":
            assert config.worker_addresses == [f"127.0.0.1:{50053 + rank}" for rank in range(tp)]
            assert from_args(EngineConfig, _parse(service, argv)) \
                .parallel.tensor_parallel_size == tp


@pytest.mark.parametrize("values, message", [
    ({"engine": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ({"tracing": {"otelExporter": "console", "otelEndpoint": "http://collector:4317"}},
     "otelExporter=otlp"),
    ({"model": {"path": "/elsewhere/m"}}, "model.path must lie under model.mountPath"),
    ({"gateway": {"replicaCount": 9}}, "gateway.autoscaling.maxReplicas must be >= "),
    ({"engine": {"tensorParallelSize": 2}, "scheduler": {"port": 50054}},
     "their ports collide: [50054 29500 9400 50053 9401 50054 9402]"),
])
def test_rendering_refuses_bad_values_with_the_value_named(values, message):
    with pytest.raises(HelmError, match=re.escape(message)):
        render(values)


def _dns_match(pattern: str, host: str) -> bool:
    """RFC 6125: a wildcard stands for exactly one leftmost label."""
    if pattern.startswith("*."):
        return host.split(".", 1)[1:] == [pattern[2:]]
    return pattern == host


def test_rendered_internal_tls_mounts_the_certificate_and_names_the_dialled_hosts():
    values = {"tls": {"internal": {"enabled": True, "certManager": {"issuerRef": {"name": "ca"}}}},
              "engine": {"tensorParallelSize": 2}}
    objects = by_name(render(values))
    certificates = {role: objects[("Certificate", f"{FULLNAME}-internal-tls-{role}")]["spec"]
                    for role in ("gateway", "scheduler", "worker")}
    for role, spec in certificates.items():
        assert spec["uris"] == [f"spiffe://pagedserve/{role}"]  # what roles.py checks
        assert spec["secretName"] == f"{FULLNAME}-internal-tls-{role}"
    assert [k for k in objects if k[0] == "Certificate"] == [
        ("Certificate", f"{FULLNAME}-internal-tls-{role}") for role in certificates]
    certificate = certificates["scheduler"]
    workloads = _workloads(values)
    config = from_args(SchedulerServiceConfig, _parse("scheduler", workloads["scheduler"][1]))
    gateway_config = from_args(GatewayConfig, _parse("gateway", workloads["gateway"][1]))
    for address in (*config.worker_addresses, gateway_config.scheduler_address):
        host = address.rsplit(":", 1)[0]
        assert any(_dns_match(name, host) for name in certificate["dnsNames"]) \
            or host in certificate["ipAddresses"], host
    assert config.tls.internal_tls_dir and config.tls.health_port == 8081
    worker = from_args(WorkerServiceConfig, _parse("worker", workloads["worker"][1]))
    assert worker.tls.health_port == 8083  # rank 1: its own, in the shared network namespace
    assert workloads["scheduler"][0]["readinessProbe"]["grpc"] == {"port": 8081}
    assert workloads["worker"][0]["readinessProbe"]["grpc"] == {"port": 8083}
    assert gateway_config.tls.health_port == 0  # its own, public, port stays plaintext
    assert workloads["gateway"][0]["readinessProbe"]["grpc"] == {"port": gateway_config.port}


def test_prefill_replicas_start_a_prefill_statefulset_whose_ranks_decode_pods_can_reach():
    values = {"engine": {"replicas": 3, "prefillReplicas": 2, "tensorParallelSize": 2},
              "networkPolicy": {"enabled": True}}
    objects = by_name(render(values))
    decode = objects[("StatefulSet", f"{FULLNAME}-engine")]["spec"]
    prefill = objects[("StatefulSet", f"{FULLNAME}-engine-prefill")]["spec"]
    assert (decode["replicas"], prefill["replicas"]) == (3, 2)
    assert decode["serviceName"] == prefill["serviceName"] == f"{FULLNAME}-engine"
    for spec, role in ((decode, "decode"), (prefill, "prefill")):
        assert spec["selector"]["matchLabels"]["pagedserve.io/role"] == role
        assert spec["template"]["metadata"]["labels"]["pagedserve.io/role"] == role
        scheduler = spec["template"]["spec"]["containers"][0]
        config = from_args(SchedulerServiceConfig, _parse("scheduler", scheduler["args"]))
        engine = from_args(EngineConfig, _parse("scheduler", scheduler["args"]))
        assert config.role == role and engine.cache.enable_prefix_caching
        assert "POD_NAME" in {e["name"] for e in scheduler["env"]}
    addresses = from_args(SchedulerServiceConfig, _parse(
        "scheduler", prefill["template"]["spec"]["containers"][0]["args"])).kv_transfer_addresses
    assert addresses == [f"$(POD_NAME).{FULLNAME}-engine.llm.svc.cluster.local:{50053 + rank}"
                         for rank in range(2)]
    service = objects[("Service", f"{FULLNAME}-engine")]["spec"]["selector"]
    assert "pagedserve.io/role" not in service  # gateways resolve both roles
    ingress = objects[("NetworkPolicy", f"{FULLNAME}-engine")]["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "engine"}}}],
        "ports": [{"port": 50053, "protocol": "TCP"},
                  {"port": 50054, "protocol": "TCP"}]} in ingress
    assert ("StatefulSet", f"{FULLNAME}-engine-prefill") not in by_name(render({}))
