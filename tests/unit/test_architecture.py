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
    ("kernels/bad.py", "from pagedserve.services.common import errors",
     "kernels may not import services.common"),
    ("scheduler_svc/bad.py", "import grpc", "a core imports no gRPC or protobuf"),
    ("worker_svc/models/bad.py", "from pagedserve.services.rpc.v1 import worker_pb2",
     "a core imports no gRPC or protobuf"),
    ("services/text/bad.py", "from google.protobuf import message",
     "a core imports no gRPC or protobuf"),
    ("pagedserve/bad.py", "from services.common import config", "import it as pagedserve."),
])
def test_a_planted_violation_is_caught(tree, path, line, rule):
    (tree / path).write_text(f"{line}\n")
    violations = check(tree)
    assert [(str(v.path), v.line) for v in violations] == [(path, 1)]
    assert rule in violations[0].rule


def test_edge_modules_may_speak_grpc(tree):
    (tree / "scheduler_svc/servicer.py").write_text("import grpc\n")
    (tree / "services/rpc/bad.py").write_text("from pagedserve.services.rpc.v1 import common_pb2\n")
    assert check(tree) == []


def test_the_offline_engine_imports_no_grpc():
    code = ("import sys; from pagedserve import LLM, SamplingParams; import pagedserve.llm_engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
