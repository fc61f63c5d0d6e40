"""The chart as Helm renders it (helm-python-sdk, Helm's own Go engine), over a matrix of values:
`helm lint --strict` passes, every object validates against the Kubernetes 1.31 OpenAPI schemas
(kubernetes-validate ships them), the values schema refuses bad values with the value named, and
policy checks hold on every rendered pod: resources, probes, a locked-down security context,
a replica's ranks in one pod with one GPU each."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from helm_python import errors as helm_errors
from helm_python.chart import lint
from pagedserve.services.common.config import (
    EngineConfig,
    SchedulerServiceConfig,
    WorkerServiceConfig,
    from_args,
)
from pagedserve.services.gateway.config import GatewayConfig

from pagedserve.cli import build_parser
from tests.unit.helm_render import CHART_DIR, FULLNAME, NAMESPACE, by_name, merge, pod_specs, render

KUBERNETES_VERSION = "1.31.0"
CRD_KINDS = {"ServiceMonitor", "Certificate", "ScaledObject"}  # not in Kubernetes' own schemas

AXES = {
    "tp": [{"engine": {"tensorParallelSize": n}} for n in (1, 2, 4)],
    "replicas": [{"engine": {"replicas": n}, "gateway": {"replicaCount": n}} for n in (1, 3)],
    "metrics": [{"metrics": {"enabled": True, "serviceMonitor": {"enabled": True},
                             "grafanaDashboard": {"enabled": True}}},
                {"metrics": {"enabled": False}}],
    "keda": [{}, {"engine": {"autoscaling": {"keda": {"enabled": True}}}}],
    "volume": [{}, {"model": {"hostPath": "/var/lib/models"}}],
    "tls": [{}, {"tls": {"internal": {"enabled": True, "certManager": {"issuerRef": {"name": "ca"}}},
                         "public": {"enabled": True, "secretName": "gw-tls"}}}],
}


def _matrix() -> list[tuple[str, dict[str, Any]]]:
    """Every TP size against every other axis' settings, the rest paired (a covering set, not
    the full product: rendering is ~50 ms, the product would be ~100 renders)."""
    cases = []
    others = [k for k in AXES if k != "tp"]
    for (i, tp), flip in itertools.product(enumerate(AXES["tp"]), range(2)):
        layers = [tp] + [AXES[k][(i + flip + j) % len(AXES[k])] for j, k in enumerate(others)]
        label = f"tp{tp['engine']['tensorParallelSize']}-" + "-".join(
            f"{k}{(i + flip + j) % len(AXES[k])}" for j, k in enumerate(others))
        cases.append((label, merge(*layers)))
    return cases


MATRIX = _matrix()


def _validate(obj: dict[str, Any]) -> None:
    if obj["kind"] in CRD_KINDS:
        assert obj["apiVersion"].split("/")[0] in {
            "monitoring.coreos.com", "cert-manager.io", "keda.sh"}
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_matrix_covers_every_setting_of_every_axis():
    for axis, settings in AXES.items():
        seen = {json.dumps(s, sort_keys=True) for _, v in MATRIX for s in settings
                if merge(v, s) == v}
        assert len(seen) == len(settings), axis


def test_helm_lint_strict_passes():
    report = lint(CHART_DIR, strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == [], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize("label, values", MATRIX, ids=[label for label, _ in MATRIX])
def test_every_rendered_object_validates_against_the_kubernetes_schemas(label, values):
    objects = render(values)
    for obj in objects:
        _validate(obj)
    assert lint(CHART_DIR, values, strict=True)["errors"] == []
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Deployment", "Service", "ServiceAccount", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "NetworkPolicy", "Pod"} <= kinds
    assert ("ScaledObject" in kinds) == values["engine"].get("autoscaling", {}) \
        .get("keda", {}).get("enabled", False)
    _check_policies(objects, values)


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _check_policies(objects: list[dict[str, Any]], values: dict[str, Any]) -> None:
    tp = values["engine"]["tensorParallelSize"]
    specs = pod_specs(objects)
    assert set(specs) == {"gateway", "engine", "test"}
    for component, spec in specs.items():
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in _containers(spec):
            name = f"{component}/{container['name']}"
            assert container["resources"]["requests"]["cpu"], name
            assert container["resources"]["limits"]["memory"], name
            security = container["securityContext"]
            assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"], name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"] == {"drop": ["ALL"]}, name
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/tmp", "/cache"} <= mounts, name  # writable, on a read-only root
            if component != "test":
                for probe in ("startupProbe", "readinessProbe"):
                    assert set(container[probe]) >= {"grpc"}, (name, probe)
                # alive is not ready: a worker rebuilding its cache is not restarted
                assert "tcpSocket" in container["livenessProbe"], name
                assert container["livenessProbe"]["tcpSocket"]["port"] == \
                    container["readinessProbe"]["grpc"]["port"], name
    engine = specs["engine"]
    ranks = [c for c in engine["containers"] if c["name"].startswith("worker-")]
    assert [c["name"] for c in engine["containers"]] == \
        ["scheduler", *(f"worker-{r}" for r in range(tp))]  # one pod holds the replica
    gpus = sum(int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
               for c in _containers(engine))
    assert gpus == tp and all(c["resources"]["limits"]["nvidia.com/gpu"] == 1 for c in ranks)
    (shm,) = [v for v in engine["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert all({"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"] for c in ranks)
    drain = 30
    assert engine["terminationGracePeriodSeconds"] >= \
        ranks[0]["lifecycle"]["preStop"]["sleep"]["seconds"] + 2 * drain
    assert ranks[0]["lifecycle"]["preStop"]["sleep"]["seconds"] > drain  # outlive the drain
    for service in by_name(objects).values():
        if service["kind"] == "Service":
            for port in service["spec"]["ports"]:
                if port["name"] == "grpc":
                    assert port["appProtocol"] == "grpc"


def _parse(command: str, argv: list[str]):
    return build_parser().parse_args([command, *argv])


@pytest.mark.parametrize("tp, tls", [(1, False), (4, True)])
def test_the_engine_pod_wires_its_scheduler_to_its_ranks_on_loopback(tp, tls):
    values = merge(AXES["tp"][[1, 2, 4].index(tp)], AXES["tls"][int(tls)],
                   {"engine": {"replicas": 3}})
    objects = by_name(render(values))
    engine = objects[("StatefulSet", f"{FULLNAME}-engine")]
    assert engine["spec"]["replicas"] == 3
    assert engine["spec"]["serviceName"] == f"{FULLNAME}-engine"
    headless = objects[("Service", f"{FULLNAME}-engine")]["spec"]
    assert headless["clusterIP"] == "None"
    scheduler, *ranks = engine["spec"]["template"]["spec"]["containers"]
    args = _parse("scheduler", scheduler["args"])
    config = from_args(SchedulerServiceConfig, args)
    assert from_args(EngineConfig, args).parallel.tensor_parallel_size == tp
    assert config.host == "0.0.0.0"
    ports = {}
    for rank, container in enumerate(ranks):
        worker_args = _parse("worker", container["args"])
        worker = from_args(WorkerServiceConfig, worker_args)
        assert worker.rank == rank and worker.host == "0.0.0.0"
        assert container["ports"][0]["containerPort"] == worker.port
        probe_port = worker.tls.health_port if tls else worker.port
        assert container["readinessProbe"]["grpc"]["port"] == probe_port
        ports[rank] = (worker.port, worker.metrics.metrics_port, worker.tls.health_port)
        if tp > 1:
            assert from_args(EngineConfig, worker_args).parallel.distributed_init_address == \
                f"127.0.0.1:{values.get('worker', {}).get('distributedPort', 29500)}"
    assert config.worker_addresses == [f"127.0.0.1:{ports[r][0]}" for r in range(tp)]
    every_port = [p for r in ports.values() for p in r if p] + [
        config.port, config.metrics.metrics_port, *([config.tls.health_port] if tls else [])]
    assert len(every_port) == len(set(every_port))  # one network namespace
    gateway = objects[("Deployment", f"{FULLNAME}-gateway")]["spec"]["template"]["spec"]
    gateway_config = from_args(GatewayConfig, _parse("gateway", gateway["containers"][0]["args"]))
    assert gateway_config.scheduler_address == \
        f"{FULLNAME}-engine.{NAMESPACE}.svc.cluster.local:{config.port}"
    assert {c["topologyKey"] for c in gateway["topologySpreadConstraints"]} == \
        {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    if tls:
        dns = objects[("Certificate", f"{FULLNAME}-internal-tls-scheduler")]["spec"]
        assert f"{FULLNAME}-engine.{NAMESPACE}.svc.cluster.local" in dns["dnsNames"]
        assert "127.0.0.1" in dns["ipAddresses"]


def test_gpu_scheduling_settings_reach_the_engine_pod():
    values = {"engine": {"gpuResource": "amd.com/gpu", "tensorParallelSize": 2, "pod": {
        "runtimeClassName": "nvidia", "priorityClassName": "llm-serving",
        "nodeSelector": {"pool": "gpu"}, "tolerations": [],
        "extraVolumes": [{"name": "extra", "secret": {"secretName": "s"}}],
        "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}]}},
        "extraEnvFrom": [{"secretRef": {"name": "engine-env"}}],
        "gateway": {"priorityClassName": "llm-front", "autoscaling": {"enabled": False}}}
    objects = render(values)
    for obj in objects:
        _validate(obj)
    specs = pod_specs(objects)
    engine = specs["engine"]
    assert engine["runtimeClassName"] == "nvidia" and engine["priorityClassName"] == "llm-serving"
    assert engine["nodeSelector"] == {"pool": "gpu"} and "tolerations" not in engine
    for container in engine["containers"]:
        assert {"name": "extra", "mountPath": "/extra"} in container["volumeMounts"]
        assert container["envFrom"] == [{"secretRef": {"name": "engine-env"}}]
        assert ("amd.com/gpu" in container["resources"]["limits"]) == \
            container["name"].startswith("worker-")
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert specs["gateway"]["priorityClassName"] == "llm-front"
    deployment = by_name(objects)[("Deployment", f"{FULLNAME}-gateway")]
    assert deployment["spec"]["replicas"] == 2  # no HPA: the chart sets the count


def test_autoscalers_own_the_replica_counts_they_scale():
    objects = by_name(render(AXES["keda"][1]))
    hpa = objects[("HorizontalPodAutoscaler", f"{FULLNAME}-gateway")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == f"{FULLNAME}-gateway"
    assert hpa["metrics"][0]["resource"]["name"] == "cpu"
    assert "replicas" not in objects[("Deployment", f"{FULLNAME}-gateway")]["spec"]
    scaled = objects[("ScaledObject", f"{FULLNAME}-engine")]["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                        "name": f"{FULLNAME}-engine"}
    assert "vllm:num_requests_waiting" in scaled["triggers"][0]["metadata"]["query"]
    assert "replicas" not in objects[("StatefulSet", f"{FULLNAME}-engine")]["spec"]
    for component in ("gateway", "engine"):
        pdb = objects[("PodDisruptionBudget", f"{FULLNAME}-{component}")]["spec"]
        assert pdb["maxUnavailable"] == 1


def test_network_policies_admit_clients_to_gateways_and_gateways_to_schedulers_only():
    objects = by_name(render({"engine": {"tensorParallelSize": 2}}))
    gateway = objects[("NetworkPolicy", f"{FULLNAME}-gateway")]["spec"]
    engine = objects[("NetworkPolicy", f"{FULLNAME}-engine")]["spec"]
    assert gateway["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert {p["port"] for p in gateway["ingress"][0]["ports"]} == {50051, 8000}
    from_gateways, *open_rules = engine["ingress"]
    assert from_gateways["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "gateway"
    assert [p["port"] for p in from_gateways["ports"]] == [50052]
    # the ranks' gRPC and rendezvous ports: no rule admits them from outside the pod
    opened = {p["port"] for rule in open_rules for p in rule["ports"]}
    assert opened == {9400, 9401, 9402}  # metrics only
    assert not {50053, 50054, 29500} & opened


def test_the_model_download_init_container_fills_a_writable_volume():
    values = {"model": {"download": {"enabled": True, "repository": "org/model",
                                     "tokenSecret": {"name": "hf"}}}}
    objects = render(values)
    for obj in objects:
        _validate(obj)
    engine = pod_specs(objects)["engine"]
    (init,) = engine["initContainers"]
    assert init["command"][-3:] == ["/models/SmolLM2-135M-Instruct", "org/model", "main"]
    assert {"name": "HF_HUB_OFFLINE", "value": "0"} == [
        e for e in init["env"] if e["name"] == "HF_HUB_OFFLINE"][-1]
    assert not [m for m in init["volumeMounts"] if m["name"] == "model"][0].get("readOnly")
    with pytest.raises(helm_errors.HelmError, match="model.download.repository"):
        render({"model": {"download": {"enabled": True}}})


def test_the_helm_test_hook_checks_health_and_generates():
    (pod,) = [o for o in render() if o["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert "HealthStub" in container["command"][2] and "/v1/completions" in container["command"][2]
    assert container["command"][3:] == [f"{FULLNAME}-gateway:50051",
                                        f"http://{FULLNAME}-gateway:8000", "", "Hello", "4"]


# --- values schema -------------------------------------------------------------------------------

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())


@pytest.mark.parametrize("values, message", [
    ({"engine": {"tensorParallelSize": "2"}}, "/engine/tensorParallelSize"),
    ({"engine": {"replicas": -1}}, "/engine/replicas"),
    ({"gateway": {"replicaCount": -2}}, "/gateway/replicaCount"),
    ({"gateway": {"port": 70000}}, "/gateway/port"),
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "/engine/gpuMemoryUtilization"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"gatway": {"replicaCount": 1}}, "gatway"),
])
def test_the_values_schema_refuses_bad_values_with_the_value_named(values, message):
    import yaml
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    jsonschema.validate(defaults, SCHEMA)
    with pytest.raises(jsonschema.ValidationError) as refused:
        jsonschema.validate(merge(defaults, values), SCHEMA)
    assert message.strip("/").split("/")[-1] in str(refused.value)
    with pytest.raises(helm_errors.HelmError, match=message):  # helm itself refuses them too
        render(values)


def test_every_value_has_a_schema():
    import yaml

    def walk(value, schema, path):
        assert schema, path
        if isinstance(value, dict) and schema.get("type") == "object" and "properties" in schema:
            for key, child in value.items():
                walk(child, schema["properties"].get(key, {}), f"{path}.{key}")

    walk(yaml.safe_load((CHART_DIR / "values.yaml").read_text()), SCHEMA, "")


def test_cpu_nodes_run_the_cpu_image_without_gpu_requests():
    values = {"image": {"tag": "0.1.0-cpu"}, "engine": {
        "device": "cpu", "gpuResource": "", "tensorParallelSize": 2, "pod": {"tolerations": []}}}
    objects = render(values)
    for obj in objects:
        _validate(obj)
    engine = pod_specs(objects)["engine"]
    for container in engine["containers"]:
        assert container["image"] == "pagedserve:0.1.0-cpu"
        assert set(container["resources"]["limits"]) == {"memory"}
        args = _parse(container["command"][1], container["args"])
        assert from_args(EngineConfig, args).device.device == "cpu"
