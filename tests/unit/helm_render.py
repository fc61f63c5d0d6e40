"""Renders helm/pagedserve with the real Helm engine (helm-python-sdk: Helm's Go library, no
binary) for the chart tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from helm_python.chart import Chart

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "pagedserve"
RELEASE = "demo"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-pagedserve"

_chart: Chart | None = None


def chart() -> Chart:
    global _chart
    if _chart is None:
        _chart = Chart.load(CHART_DIR)
    return _chart


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object `helm template demo helm/pagedserve -n llm` prints, hooks included."""
    rendered = chart().render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def by_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pod spec of every workload and bare pod, by component label."""
    specs = {}
    for o in objects:
        spec = o["spec"]["template"]["spec"] if o["kind"] in ("Deployment", "StatefulSet") \
            else o["spec"] if o["kind"] == "Pod" else None
        if spec is not None:
            specs[o["metadata"]["labels"]["app.kubernetes.io/component"]] = spec
    return specs


def merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of values layers, later winning."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
    return out
