"""The gRPC contracts under buf (make lint): protos/ is lint-clean, and protos/breaking.py, the
`buf breaking` step, fails a commit that breaks the last release and passes an additive one."""

import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / "tools" / "node_modules" / ".bin" / "buf"
GATEWAY = Path("protos/pagedserve/v1/gateway.proto")
PRIORITY = "  int32 priority = 6;\n}\n\n// A streamed request"

pytestmark = pytest.mark.skipif(not BUF.exists(),
                                reason="no buf: make lint and make test install it")
check = runpy.run_path(str(ROOT / "protos" / "breaking.py"))["check"]


def test_the_protos_pass_buf_lint():
    lint = subprocess.run([BUF, "lint", "protos"], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_a_field_without_a_leading_comment_fails_buf_lint(tmp_path):
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    path = tmp_path / GATEWAY
    text = path.read_text()
    assert "  // Token counts.\n" in text
    path.write_text(text.replace("  // Token counts.\n", "", 1))
    lint = subprocess.run([BUF, "lint", "protos"], cwd=tmp_path, capture_output=True, text=True)
    assert lint.returncode != 0 and '"usage"' in lint.stdout


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
                   check=True, capture_output=True)


def _commit(repo: Path, edit: tuple[str, str] | None = None) -> None:
    if edit is not None:
        path = repo / GATEWAY
        text = path.read_text()
        assert edit[0] in text
        path.write_text(text.replace(edit[0], edit[1], 1))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "change")


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A fresh git repository holding a copy of protos/, committed once."""
    monkeypatch.delenv("BUF_BREAKING_AGAINST", raising=False)
    shutil.copytree(ROOT / "protos", tmp_path / "protos",
                    ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    _git(tmp_path, "init", "-q")
    _commit(tmp_path)
    return tmp_path


DELETE_PRIORITY = (PRIORITY, "}\n\n// A streamed request")
RENUMBER_PRIORITY = (PRIORITY, "  int32 priority = 7;\n}\n\n// A streamed request")
ADD_FIELD = (PRIORITY, PRIORITY.replace("}", "  // A new field.\n  string user = 7;\n}"))
ADD_OTHER_FIELD = ("  SamplingParams sampling = 5;\n",
                   "  SamplingParams sampling = 5;\n  // A new field.\n  string user = 8;\n")


@pytest.mark.parametrize("edit", [DELETE_PRIORITY, RENUMBER_PRIORITY], ids=["delete", "renumber"])
def test_a_breaking_change_fails_against_the_previous_commit(repo, capfd, edit):
    _commit(repo, edit)
    assert check(str(BUF), repo) != 0
    assert "GenerateRequest" in capfd.readouterr().out


def test_an_additive_change_passes(repo):
    _commit(repo, ADD_FIELD)
    assert check(str(BUF), repo) == 0


def test_the_last_release_tag_is_the_baseline(repo, monkeypatch):
    """HEAD~1 already has the break, the release before it does not."""
    _git(repo, "tag", "v0.1.0")
    _commit(repo, DELETE_PRIORITY)
    _commit(repo, ADD_OTHER_FIELD)
    assert check(str(BUF), repo) != 0
    monkeypatch.setenv("BUF_BREAKING_AGAINST", "HEAD~1")
    assert check(str(BUF), repo) == 0
    monkeypatch.setenv("BUF_BREAKING_AGAINST", "none")
    assert check(str(BUF), repo) == 0


def test_a_baseline_missing_from_the_clone_fails_clearly(repo, monkeypatch, capfd):
    monkeypatch.setenv("BUF_BREAKING_AGAINST", "v9.9.9")
    assert check(str(BUF), repo) == 2
    assert "v9.9.9" in capfd.readouterr().err
