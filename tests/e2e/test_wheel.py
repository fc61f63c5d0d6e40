"""The wheel as a user installs it: one import root with its stubs inside, `from pagedserve import
LLM, SamplingParams`, the `pagedserve` command, and Hugging Face's `kernels` package beside it
unharmed. The wheel is built from the tracked files alone (no stubs, no venv) and installed into
a fresh venv whose only other path is the project venv's dependencies."""

import base64
import csv
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNELS_WHEELS = REPO / ".venv" / "wheels"


def _run(*argv, cwd):
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in _run("git", "ls-files", cwd=REPO).splitlines():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp / "dist"), str(src), cwd=tmp)
    env_dir = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(env_dir), cwd=tmp)
    python = env_dir / "bin" / "python"
    site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                     cwd=tmp).strip())
    (site / "project_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    _run(*pip, "--no-index", "--find-links", str(KERNELS_WHEELS), "kernels", cwd=tmp)
    _run(*pip, *map(str, (tmp / "dist").glob("pagedserve-*.whl")), cwd=tmp)
    return env_dir, site


def test_the_wheel_claims_only_the_pagedserve_import_root(venv):
    _, site = venv
    record = next(site.glob("pagedserve-*.dist-info")) / "RECORD"
    roots = {row[0].split("/")[0] for row in csv.reader(record.read_text().splitlines())}  # ".." = bin/
    assert {r for r in roots if not r.endswith(".dist-info") and r != ".."} == {"pagedserve"}
    rpc = site / "pagedserve" / "services" / "rpc"
    assert (rpc / "v1" / "gateway_pb2_grpc.py").is_file()
    assert (rpc / "internal" / "v1" / "scheduler_pb2_grpc.py").is_file()


def test_a_user_imports_llm_and_sampling_params_and_runs_the_command(venv, tmp_path):
    env_dir, site = venv
    code = ("import pagedserve; from pagedserve import LLM, SamplingParams; "
            "from pagedserve.services.rpc.v1 import gateway_pb2_grpc; "
            "from pagedserve.services.rpc.internal.v1 import scheduler_pb2_grpc, worker_pb2_grpc; "
            "print(pagedserve.__file__, SamplingParams(max_tokens=3).max_tokens)")
    out = _run(str(env_dir / "bin" / "python"), "-c", code, cwd=tmp_path)
    assert out.split() == [str(site / "pagedserve" / "__init__.py"), "3"]
    assert "serve" in _run(str(env_dir / "bin" / "pagedserve"), "--help", cwd=tmp_path)


def test_the_wheel_carries_every_source_of_the_cpu_kernels(venv):
    """They compile on first use from the installed package: a missing header there means a
    failed build and the torch fallbacks."""
    _, site = venv
    shipped = {p.name for p in (site / "pagedserve" / "kernels" / "csrc").iterdir()}
    assert shipped == {p.name for p in (REPO / "kernels" / "csrc").iterdir()}


def test_hugging_face_kernels_beside_it_is_unharmed(venv):
    _, site = venv
    record = next(site.glob("kernels-*.dist-info")) / "RECORD"
    for path, digest, _ in csv.reader(record.read_text().splitlines()):
        if not digest:
            continue
        algorithm, expected = digest.split("=", 1)
        data = (site / path).read_bytes()
        actual = base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=")
        assert actual.decode() == expected, f"{path} was overwritten"
    assert not (site / "kernels" / "ref.py").exists()
    assert os.listdir(site / "kernels")


def test_the_images_install_of_the_wheel_with_its_extras_resolves(venv, tmp_path):
    """What Dockerfile installs (the wheel with [triton]) and Dockerfile.cpu (the wheel alone):
    every requirement either declares holds in the venv, and the OTLP exporter the chart offers
    imports; run under the image's environment (HOME and caches under one writable folder)."""
    env_dir, _ = venv
    code = (
        "import importlib.metadata as m, sys\n"
        "from packaging.requirements import Requirement\n"
        "unmet = []\n"
        "for extra in ('', 'triton'):\n"
        "    for text in m.requires('pagedserve'):\n"
        "        req = Requirement(text)\n"
        "        if req.marker and not req.marker.evaluate({'extra': extra}):\n"
        "            continue\n"
        "        try:\n"
        "            version = m.version(req.name)\n"
        "        except m.PackageNotFoundError:\n"
        "            unmet.append(f'{extra}: {req} (missing)'); continue\n"
        "        if not req.specifier.contains(version, prereleases=True):\n"
        "            unmet.append(f'{extra}: {req} (have {version})')\n"
        "assert not unmet, unmet\n"
        "assert 'triton' in m.metadata('pagedserve').get_all('Provides-Extra')\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "print('ok')\n")
    cache = tmp_path / "cache"
    env = {"PATH": os.environ["PATH"], "HOME": str(cache), "XDG_CACHE_HOME": str(cache),
           "HF_HOME": str(cache / "huggingface"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(env_dir / "bin" / "python"), "-c", code], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


def test_a_user_imports_the_client(venv, tmp_path):
    env_dir, site = venv
    code = ("from pagedserve import AsyncClient, Client, ClientError, RetryPolicy; "
            "import pagedserve.client.sync as m; print(m.__file__, RetryPolicy().max_attempts)")
    out = _run(str(env_dir / "bin" / "python"), "-c", code, cwd=tmp_path)
    assert out.split() == [str(site / "pagedserve" / "client" / "sync.py"), "4"]
