"""The layering contract of `make lint`: clean on the repository, and it catches each kind of
violation when one is planted in a copy."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.architecture import check

REPO = Path(__file__).resolve().parents[2]


def test_the_repository_keeps_the_contract():
    assert [str(v) for v in check(REPO)] == []


@pytest.fixture
def tree(tmp_path):
    for folder in ("pagedserve", "services", "scheduler_svc", "worker_svc", "kernels"):
        shutil.copytree(REPO / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "v1"))
    return tmp_path


@pytest.mark.parametrize(("path", "line", "rule"), [
    ("services/common/bad.py", "from pagedserve.scheduler_svc.sequence import Sequence",
     "services.common may not import scheduler_svc"),
    ("services/text/bad.py", "from pagedserve.services.gateway import app",
     "services.text may not import services.gateway"),
    ("scheduler_svc/bad.py", "from pagedserve.worker_svc.worker import Worker",
     "scheduler_svc may not import worker_svc"),
    ("worker_svc/bad.py", "from pagedserve import cli", "worker_svc may not import pagedserve"),
    ("kernels/bad.py", "from pagedserve.services.text import tokenizer",
     "kernels may not import services.text"),
    ("scheduler_svc/bad.py", "from pagedserve.services.gateway.frontend import Frontend",
     "scheduler_svc may not import services.gateway"),
    ("worker_svc/bad.py", "from pagedserve.services.gateway import frontend",
     "worker_svc may not import services.gateway"),
    ("worker_svc/bad.py", "from pagedserve.services.text.tokenizer import Tokenizer",
     "worker_svc may not import services.text"),
    ("scheduler_svc/bad.py", "from pagedserve.kernels.metadata import AttentionMetadata",
     "scheduler_svc may not import kernels"),
    ("scheduler_svc/bad.py", "from pagedserve.scheduler_svc.servicer import SchedulerServicer",
     "loads no gRPC or protobuf, not even through another module"),
    ("services/common/bad.py", "def f(): from pagedserve.services.gateway import app",
     "services.common may not import services.gateway"),
    ("scheduler_svc/bad.py", "import grpc", "imports no gRPC or protobuf"),
    ("worker_svc/models/bad.py", "from pagedserve.services.rpc.v1 import worker_pb2",
     "imports no gRPC or protobuf"),
    ("services/text/bad.py", "from google.protobuf import message",
     "imports no gRPC or protobuf"),
    ("pagedserve/bad.py", "from services.common import config", "import it as pagedserve."),
])
def test_a_planted_violation_is_caught(tree, path, line, rule):
    (tree / path).write_text(f"{line}\n")
    violations = check(tree)
    assert [(str(v.path), v.line) for v in violations] == [(path, 1)]
    assert rule in violations[0].rule


def test_a_transport_free_module_may_not_load_the_transport_through_another(tree):
    frontend = tree / "services/gateway/frontend.py"
    lines = frontend.read_text().splitlines()
    lines.append("from pagedserve.services.gateway.replica_set import ReplicaSet")
    frontend.write_text("\n".join(lines) + "\n")
    violations = check(tree)
    assert [(str(v.path), v.line) for v in violations] == [
        ("services/gateway/frontend.py", len(lines))]
    assert "services.gateway.replica_set -> pagedserve.services.rpc" in str(violations[0])


def test_what_only_type_checking_imports_is_not_loaded(tree):
    (tree / "services/text/typed.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pagedserve.services.gateway.replica_set import ReplicaSet\n")
    assert [v.rule for v in check(tree)] == ["services.text may not import services.gateway"]
    (tree / "services/gateway/typed.py").write_text((tree / "services/text/typed.py").read_text())
    (tree / "services/text/typed.py").unlink()
    (tree / "services/text/uses_typed.py").write_text(
        "from pagedserve.services.common import errors\n")
    assert check(tree) == []


@pytest.mark.parametrize(("num_lines", "is_caught"), [(60, False), (61, True)])
def test_a_function_over_60_lines_is_caught(tree, num_lines, is_caught):
    body = "".join(f"    x{i} = {i}\n" for i in range(num_lines - 2))
    (tree / "worker_svc/long.py").write_text(f"def long():\n{body}    return 0\n")
    violations = check(tree)
    assert [(str(v.path), v.line) for v in violations] == (
        [("worker_svc/long.py", 1)] if is_caught else [])
    assert all(f"{num_lines} lines" in v.rule for v in violations)


def test_a_name_on_the_floor_that_only_the_gateway_uses_is_caught(tree):
    (tree / "services/common/extra.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Part:\n    x: int = 0\n\n\n"
        "@dataclass\nclass OnlyGatewayConfig:\n    part: Part\n")
    (tree / "services/gateway/uses_extra.py").write_text(
        "from pagedserve.services.common.extra import OnlyGatewayConfig, Part\n")
    (tree / "pagedserve/uses_extra.py").write_text(
        "from pagedserve.services.common.extra import OnlyGatewayConfig\n")
    violations = check(tree)
    assert [(str(v.path), v.line, v.subject) for v in violations] == [
        ("services/common/extra.py", 5, "defines Part"),
        ("services/common/extra.py", 10, "defines OnlyGatewayConfig")]
    assert "only the gateway uses it" in violations[0].rule
    (tree / "scheduler_svc/uses_extra.py").write_text(
        "from pagedserve.services.common.extra import OnlyGatewayConfig\n")
    assert check(tree) == []  # shared now, and so is the Part it holds


def test_edge_modules_may_speak_grpc(tree):
    (tree / "scheduler_svc/servicer.py").write_text("import grpc\n")
    (tree / "services/rpc/bad.py").write_text("from pagedserve.services.rpc.v1 import common_pb2\n")
    assert check(tree) == []


def test_the_frontend_loads_no_transport():
    code = ("import sys; import pagedserve.services.gateway.frontend; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'prometheus_client')"
            " or m.startswith(('google.protobuf', 'pagedserve.services.rpc'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_offline_engine_imports_no_grpc():
    code = ("import sys; from pagedserve import LLM, SamplingParams; import pagedserve.llm_engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("statement", [
    "from services.common.sampling_params import SamplingParams",
    "import scheduler_svc.engine_core",
    "from worker_svc import worker",
    "from kernels import metadata",
])
def test_a_layer_imported_by_its_bare_name_fails_naming_the_right_import(statement):
    layer = statement.split()[1].split(".")[0]
    result = subprocess.run([sys.executable, "-c", statement], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 1
    assert (f"ImportError: {layer} is a layer of pagedserve: import it as pagedserve.{layer}"
            in result.stderr)


def test_the_bare_kernels_name_loads_no_second_copy_and_transformers_still_probes_it():
    """transformers imports `kernels` (Hugging Face's, which this folder shadows in a checkout)
    to read its version; the bare name loads empty and only using it fails."""
    code = ("import transformers, kernels; transformers.LlamaConfig; "
            "print(getattr(kernels, '__version__', 'N/A'), kernels.__path__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["N/A", "[]"]
    result = subprocess.run([sys.executable, "-c", "import kernels.metadata"], cwd=REPO,
                            capture_output=True, text=True)
    assert "No module named 'kernels.metadata'" in result.stderr
