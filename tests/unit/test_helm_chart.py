"""The Helm chart (helm/pagedserve), checked without helm: every value a template reads exists,
every flag it passes is a real flag of that `pagedserve` subcommand, the values' flag maps make
a valid configuration, workers take one GPU each, probes call gRPC health on the port the
service listens on. With a `helm` binary on PATH the rendered manifests are checked as well."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pagedserve.scheduler_svc.metrics import SchedulerMetrics
from pagedserve.services.common.config import (
    API_KEY_ENV,
    EngineConfig,
    GatewayConfig,
    HttpConfig,
    SchedulerServiceConfig,
    WorkerServiceConfig,
    from_args,
)
from pagedserve.services.common.engine_api import EngineLoad
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.worker_svc.metrics import WorkerMetrics
from prometheus_client import CollectorRegistry

from pagedserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pagedserve"
TEMPLATES = CHART / "templates"
SERVICES = ("gateway", "scheduler", "worker")
SERVICE_CONFIGS = {"gateway": GatewayConfig, "scheduler": SchedulerServiceConfig,
                   "worker": WorkerServiceConfig}
WORKLOADS = {"gateway": "gateway-deployment.yaml", "scheduler": "scheduler-deployment.yaml",
             "worker": "worker-statefulset.yaml"}

_VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_]\w*)+)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_CAMEL_KEY = re.compile(r"[a-z]+(?:[A-Z][a-z0-9]*)*")
_TEMPLATE_COMMENT = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", re.S)


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


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
    argv += ["--model", values["model"]["path"], *_flags(values["engine"])]
    if service == "worker":
        return ["--rank", "0", *argv]
    tp = values["engine"]["tensorParallelSize"]
    return [*argv, "--worker-addresses",
            *(f"worker-{rank}:{values['worker']['port']}" for rank in range(tp)),
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
    for path in sorted(TEMPLATES.iterdir()):
        for ref in _VALUES_REF.findall(path.read_text()):
            node: Any = values
            for key in ref.strip(".").split("."):
                if not isinstance(node, dict) or key not in node:
                    missing.append(f"{path.name}: .Values{ref}")
                    break
                node = node[key]
    assert not missing, missing


def test_every_literal_flag_is_a_flag_of_its_subcommand():
    """Helpers serve all three services; NOTES.txt shows a `pagedserve chat` command."""
    commands = {path.name: [s for s in SERVICES if path.name.startswith(s)]
                for path in TEMPLATES.iterdir()}
    commands["_helpers.tpl"] = list(SERVICES)
    commands["NOTES.txt"] = ["chat"]
    checked = 0
    for name, services in commands.items():
        for flag in set(_FLAG.findall(_TEMPLATE_COMMENT.sub("", _template(name)))):
            for service in services:
                assert flag in _option_strings(service), f"{name}: pagedserve {service} {flag}"
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


def test_workers_are_a_statefulset_of_one_gpu_ranks_behind_a_headless_service():
    statefulset = _template("worker-statefulset.yaml")
    assert "kind: StatefulSet" in statefulset
    assert "replicas: {{ .Values.engine.tensorParallelSize }}" in statefulset
    assert re.search(r"limits:\n\s+nvidia\.com/gpu: 1\n", statefulset)
    assert "podManagementPolicy: Parallel" in statefulset  # ranks are ready only together
    assert '--rank "${POD_NAME##*-}"' in statefulset and "exec pagedserve worker" in statefulset
    # the ranks meet at rank 0's stable DNS name (resolvable before readiness, see below)
    assert "--distributed-init-address" in statefulset
    assert '"%s-worker-0.%s-worker:%d"' in statefulset
    service = _template("worker-service.yaml")
    assert "clusterIP: None" in service
    assert "publishNotReadyAddresses: true" in service  # the scheduler dials before readiness
    tolerations = _values()["worker"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)


def test_scheduler_is_one_replica_never_two_at_once():
    scheduler = _template("scheduler-deployment.yaml")
    assert re.search(r"\n  replicas: 1\n", scheduler)
    assert "type: Recreate" in scheduler
    assert "--worker-addresses" in scheduler and "pagedserve.workerAddresses" in scheduler


@pytest.mark.parametrize("service", SERVICES)
def test_probes_call_grpc_health_on_the_port_the_service_listens_on(service):
    text = _template(WORKLOADS[service])
    port = f".Values.{service}.port"
    assert f"containerPort: {{{{ {port} }}}}" in text
    assert f'include "pagedserve.serviceFlags" (dict "root" . "port" {port})' in text
    assert f'include "pagedserve.probes" (dict "root" . "port" {port} "tls" ' in text
    allowed = {service, "scheduler"} if service == "gateway" else {service}  # its address
    assert set(re.findall(r"\.Values\.(\w+)\.port", text)) <= allowed
    helpers = _template("_helpers.tpl")
    probes = helpers[helpers.index('define "pagedserve.probes"'):]
    probes = probes[:probes.index("{{- end }}")]
    assert probes.count("grpc:\n    port: {{ $port }}") == 3
    # the service's own port, unless it has TLS: then the plaintext health-only port
    assert "ternary .root.Values.tls.healthPort .port (.tls | default false)" in probes
    assert "httpGet" not in probes and "tcpSocket" not in probes
    assert "- --port\n- {{ .port | quote }}" in helpers


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
    text = _template(WORKLOADS[service])
    assert "pagedserve.internalTlsVolumeMount" in text and "pagedserve.internalTlsVolume" in text
    tls_value = "$public.enabled" if service == "gateway" else ".Values.tls.internal.enabled"
    for helper in ("tlsFlags", "healthContainerPort", "probes"):
        assert re.search(rf'include "pagedserve.{helper}" \(dict "root" \. (?:"port" \S+ )?'
                         rf'"tls" {re.escape(tls_value)}\)', text), (service, helper)
    helpers = _template("_helpers.tpl")
    assert "secretName: {{ include \"pagedserve.internalTlsSecret\" . | quote }}" in helpers


def test_public_tls_passes_the_secrets_files_to_the_gateway():
    values = _values()
    public = values["tls"]["public"]
    text = _template("gateway-deployment.yaml")
    for flag, name in (("--public-tls-cert", "tls.crt"), ("--public-tls-key", "tls.key"),
                       ("--public-tls-client-ca", "ca.crt")):
        assert f'- {flag}\n            - {{{{ printf "%s/{name}" $public.mountPath | quote }}}}' in text
    argv = [*_service_argv(values, "gateway"), "--health-port", "8081",
            "--public-tls-cert", f"{public['mountPath']}/tls.crt",
            "--public-tls-key", f"{public['mountPath']}/tls.key",
            "--public-tls-client-ca", f"{public['mountPath']}/ca.crt"]
    config = from_args(GatewayConfig, _parse("gateway", argv))
    assert config.public_tls.is_enabled and config.public_tls.public_tls_client_ca
    assert "tls.public.secretName must name a Secret" in text


def test_the_cert_manager_certificate_names_every_address_the_services_dial():
    text = _template("internal-certificate.yaml")
    assert "kind: Certificate" in text and "apiVersion: cert-manager.io/v1" in text
    assert "if and $internal.enabled $internal.certManager.issuerRef" in text
    assert "- server auth\n    - client auth" in text  # one certificate for both ends
    assert 'secretName: {{ include "pagedserve.internalTlsSecret" . | quote }}' in text
    # the scheduler's address and each worker's (<fullname>-worker-<rank>.<fullname>-worker...)
    assert 'printf "%s-scheduler%s" $fullname .' in text
    assert 'printf "*.%s-worker%s" $fullname .' in text
    helpers = _template("_helpers.tpl")
    assert '{{ include "pagedserve.fullname" . }}-scheduler.{{ .Release.Namespace }}.svc.' in helpers
    assert 'printf "%s-%d.%s.%s.svc.%s:%v" $worker $rank $worker' in helpers
    assert '(printf ".%s.svc.%s" .Release.Namespace .Values.clusterDomain)' in text


def test_network_policies_open_internal_ports_to_their_peers_only():
    text = _template("networkpolicy.yaml")
    assert _values()["networkPolicy"]["enabled"] is False
    assert "{{- if .Values.networkPolicy.enabled }}" in text
    assert ('dict "scheduler" (list (list "gateway" $.Values.scheduler.port)) "worker" '
            '(list (list "scheduler" $.Values.worker.port) (list "worker" '
            '$.Values.worker.distributedPort))') in text
    assert "policyTypes:\n    - Ingress" in text
    assert "- port: {{ $root.Values.tls.healthPort }}" in text  # probes reach the health port
    assert "- port: {{ $root.Values.metrics.port }}" in text  # and Prometheus the metrics


def test_metrics_ports_scrape_annotations_service_monitors_and_otel_env():
    values = _values()
    assert values["metrics"]["enabled"] and not values["metrics"]["serviceMonitor"]["enabled"]
    for service in SERVICES:
        workload = _template(WORKLOADS[service])
        assert 'include "pagedserve.metricsContainerPort" .' in workload
        assert f'include "pagedserve.podAnnotations" (dict "root" . "values" .Values.{service})' \
            in workload
        assert 'include "pagedserve.metricsServicePort" .' in _template(f"{service}-service.yaml")
    helpers = _template("_helpers.tpl")
    assert '"prometheus.io/scrape" "true"' in helpers and '"prometheus.io/path" "/metrics"' in helpers
    assert "- name: metrics\n  containerPort: {{ .Values.metrics.port }}" in helpers
    assert "range $name, $value := .Values.otelEnv" in helpers
    monitors = _template("servicemonitor.yaml")
    assert "kind: ServiceMonitor" in monitors
    assert 'range $component := list "gateway" "scheduler" "worker"' in monitors
    assert "if and .Values.metrics.enabled .Values.metrics.serviceMonitor.enabled" in monitors
    assert "- port: metrics" in monitors
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


# --- rendered by helm, where it is installed ---------------------------------------------------

HELM = shutil.which("helm")
needs_helm = pytest.mark.skipif(HELM is None, reason="no helm binary on PATH")


def _render(*sets: str) -> subprocess.CompletedProcess:
    argv = [HELM, "template", "demo", str(CHART), "--namespace", "llm"]
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def _manifests(*sets: str) -> dict[tuple[str, str], dict[str, Any]]:
    result = _render(*sets)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@needs_helm
@pytest.mark.parametrize("sets", [(), ("engine.tensorParallelSize=2", "drainTimeoutS=45",
                                       "tracing.otelExporter=otlp",
                                       "tracing.otelEndpoint=http://collector:4317")])
def test_rendered_workloads_run_real_commands_and_probe_their_ports(sets):
    manifests = _manifests(*sets)
    tp = 2 if sets else 1
    drain_s = 45 if sets else 30
    kinds = {"gateway": "Deployment", "scheduler": "Deployment", "worker": "StatefulSet"}
    for service, kind in kinds.items():
        workload = manifests[(kind, f"demo-pagedserve-{service}")]
        pod = workload["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 2 * drain_s
        (container,) = pod["containers"]
        argv = container["args"]
        if service == "worker":
            assert container["command"][:2] == ["/bin/sh", "-c"]
            argv = ["--rank", "1", *argv]  # what the shell wrapper adds for pod ...-worker-1
        else:
            assert container["command"] == ["pagedserve", service]
        config = from_args(SERVICE_CONFIGS[service], _parse(service, argv))
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.pop("grpc") == config.port
        if service == "gateway":
            assert ports.pop("http") == config.http.http_port
            service_ports = manifests[("Service", "demo-pagedserve-gateway")]["spec"]["ports"]
            assert {p["name"]: p["targetPort"] for p in service_ports
                    if p["name"] != "metrics"} == {"grpc": "grpc", "http": "http"}
        ports.pop("health", None)  # the plaintext probe port, with TLS
        ports.pop("metrics", None)
        assert not ports
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": config.port}
        if service == "worker":
            assert workload["spec"]["replicas"] == tp
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            headless = manifests[("Service", workload["spec"]["serviceName"])]["spec"]
            assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
        if service == "scheduler":
            assert config.worker_addresses == [
                f"demo-pagedserve-worker-{rank}.demo-pagedserve-worker.llm.svc.cluster.local:"
                f"50053" for rank in range(tp)]
            assert from_args(EngineConfig, _parse(service, argv)) \
                .parallel.tensor_parallel_size == tp


@needs_helm
@pytest.mark.parametrize("sets, message", [
    (("engine.tensorParallelSize=0",), "tensorParallelSize must be >= 1"),
    (("tracing.otelExporter=console", "tracing.otelEndpoint=http://collector:4317"),
     "otelExporter=otlp"),
    (("model.path=/elsewhere/m",), "model.path must lie under model.mountPath"),
])
def test_rendering_refuses_bad_values_with_the_value_named(sets, message):
    result = _render(*sets)
    assert result.returncode != 0
    assert message in result.stderr


def _dns_match(pattern: str, host: str) -> bool:
    """RFC 6125: a wildcard stands for exactly one leftmost label."""
    if pattern.startswith("*."):
        return host.split(".", 1)[1:] == [pattern[2:]]
    return pattern == host


@needs_helm
def test_rendered_internal_tls_mounts_the_certificate_and_names_the_dialled_hosts():
    manifests = _manifests("tls.internal.enabled=true", "tls.internal.certManager.issuerRef.name=ca",
                           "engine.tensorParallelSize=2")
    certificate = manifests[("Certificate", "demo-pagedserve-internal-tls")]["spec"]
    scheduler = manifests[("Deployment", "demo-pagedserve-scheduler")]["spec"]["template"]["spec"]
    gateway = manifests[("Deployment", "demo-pagedserve-gateway")]["spec"]["template"]["spec"]
    config = from_args(SchedulerServiceConfig, _parse("scheduler", scheduler["containers"][0]["args"]))
    gateway_config = from_args(GatewayConfig, _parse("gateway", gateway["containers"][0]["args"]))
    hosts = [a.rsplit(":", 1)[0] for a in (*config.worker_addresses,
                                           gateway_config.scheduler_address)]
    for host in hosts:
        assert any(_dns_match(name, host) for name in certificate["dnsNames"]), host
    assert config.tls.internal_tls_dir and config.tls.health_port == 8081
    (container,) = scheduler["containers"]
    assert container["readinessProbe"]["grpc"] == {"port": 8081}
    (volume,) = [v for v in scheduler["volumes"] if v["name"] == "internal-tls"]
    assert volume["secret"]["secretName"] == certificate["secretName"]
    assert gateway_config.tls.health_port == 0  # its own, public, port stays plaintext
    assert gateway["containers"][0]["readinessProbe"]["grpc"] == {"port": gateway_config.port}


@needs_helm
def test_rendered_network_policies_admit_only_the_peer_components():
    manifests = _manifests("networkPolicy.enabled=true")
    peers = {}
    for component in ("scheduler", "worker"):
        spec = manifests[("NetworkPolicy", f"demo-pagedserve-{component}")]["spec"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        peers[component] = sorted(
            (rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
             rule["ports"][0]["port"]) for rule in spec["ingress"])
    assert peers == {"scheduler": [("gateway", 50052)],
                     "worker": [("scheduler", 50053), ("worker", 29500)]}
    assert ("NetworkPolicy", "demo-pagedserve-gateway") not in manifests
