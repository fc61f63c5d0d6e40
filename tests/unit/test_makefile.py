"""The Makefile's targets against what they manage: `make clean` removes every stub folder
protos/generate.py writes (make proto), so a clean checkout regenerates both contracts."""

import runpy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GEN_OUT = REPO / "services" / "rpc" / "v1"  # the Makefile's `proto` target's argument


def _removed_by_clean() -> list[Path]:
    dry_run = subprocess.run(["make", "-n", "clean"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout
    return [REPO / arg for line in dry_run.splitlines() if line.startswith("rm -rf ")
            for arg in shlex.split(line)[2:]]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_clean_removes_every_generated_stub_folder():
    package_dirs = runpy.run_path(str(REPO / "protos" / "generate.py"))["_package_dirs"]
    dirs = package_dirs(GEN_OUT)
    # the internal package's own __init__.py is generated beside its v1/ too
    generated = [*dirs.values(), dirs["pagedserve/internal/v1"].parent,
                 GEN_OUT.with_name(GEN_OUT.name + ".tmp")]
    removed = _removed_by_clean()
    kept = [str(d.relative_to(REPO)) for d in generated
            if not any(d == r or r in d.parents for r in removed)]
    assert not kept, f"make clean leaves the generated {kept}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_clean_removes_nothing_git_tracks():
    removed = [str(p.relative_to(REPO)) for p in _removed_by_clean() if "*" not in p.name]
    tracked = subprocess.run(["git", "ls-files", "--", *removed], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert not tracked, f"make clean would remove tracked files {tracked[:5]}"
