"""The GPU check in one command, for a machine that has a CUDA torch and no network.

`make gpu-wheels` runs where a package index is reachable: it downloads, at this checkout's venv
versions, a Python 3.12 manylinux x86-64 wheel of every package such a machine lacks (CARRIED)
into the ignored folder .whl/, with the SmolLM2 tokenizer beside them (bench.serving's 1.7B shape).
`make gpu-check` runs on the GPU machine: it installs those wheels into /tmp/site (no index, no
dependency resolution), then runs bench.kernels_gpu, bench.offline_gpu (one process per model,
so that one engine's memory cannot starve the next), bench.serving on CUDA through both doors,
and last the tests marked gpu (`make test-gpu-kernels`, then `make test-gpu-engine`). Each bench
writes its record to bench/results/ with the device in its name; this script adds
gpu_check-<device>.json (each step's exit status and time), rewritten as each step ends. It runs
every step even after one fails, and exits non-zero if any did. docs/gpu-readiness.md says what
must travel.

    python -m bench.gpu_check wheels           # here, in the checkout's venv
    python -m bench.gpu_check run              # there, with the GPU machine's python3
    python -m bench.gpu_check run --dry-run    # the commands, checked against .whl/, not run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / ".whl"
TOKENIZER_DIR = WHEEL_DIR / "smollm2-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SITE_DIR = Path("/tmp/site")
STUB_DIRS = (ROOT / "services/rpc/v1", ROOT / "services/rpc/internal/v1")
PYTHON_VERSION = "3.12"
# the 2026-11-26 H100 machine ran Python 3.12.3 built by GCC 13.3 (Ubuntu 24.04, glibc 2.39);
# llguidance ships manylinux_2_31 wheels only
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")

# What pagedserve needs at run time and a CUDA PyTorch image (torch, triton, transformers and
# their kin) lacks: the 2026-11-26 H100 machine had none of these. grpcio and protobuf are there,
# but at versions other than the stubs': they travel too. typing-extensions travels because
# pydantic needs a newer one than such images hold.
CARRIED = (
    "grpcio", "grpcio-status", "grpcio-health-checking", "grpcio-reflection", "protobuf",
    "googleapis-common-protos",
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-semantic-conventions",
    "opentelemetry-proto", "opentelemetry-exporter-otlp-common",
    "opentelemetry-exporter-otlp-proto-common", "opentelemetry-exporter-otlp-proto-grpc",
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types",
    "typing-inspection", "typing-extensions",
    "cryptography", "cffi", "pycparser",
    "gguf", "llguidance",
    "pytest-xdist", "execnet",  # make test-gpu-kernels' 8 processes
)
# What such an image brings that pagedserve or a carried package needs (the check's premise).
PROVIDED = (
    "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "jinja2", "tqdm",
    "prometheus-client", "anyio", "click", "h11", "annotated-doc", "pyyaml", "requests", "httpx",
    "pytest", "hypothesis",
)
# each with its time limit (s): HF's padded batches take most of it
OFFLINE_MODELS = {"qwen2.5-0.5b": 70, "llama-3-8b": 70}
SERVING_SHAPE = "smollm2-1.7b"


def normalize(name: str) -> str:
    """PEP 503: 'Pydantic_Core' and 'pydantic-core' are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(filename: str) -> str:
    return normalize(filename.split("-", 1)[0])


def check_wheels(filenames: list[str]) -> list[str]:
    """What stops the offline install: a carried package without a wheel, or one with two."""
    found: dict[str, list[str]] = {}
    for name in filenames:
        if name.endswith(".whl"):
            found.setdefault(wheel_project(name), []).append(name)
    problems = [f"no wheel of {name} in .whl/ (run make gpu-wheels where an index is reachable)"
                for name in CARRIED if normalize(name) not in found]
    problems += [f"two wheels of {name} in .whl/: {', '.join(sorted(names))}"
                 for name, names in sorted(found.items()) if len(names) > 1]
    return problems


def _target_args(python_version: str) -> list[str]:
    """pip's options that pick another interpreter's and platform's wheels."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *platforms]


def download_command(dest: Path, versions: dict[str, str]) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
            *_target_args(PYTHON_VERSION), "-d", str(dest),
            *(f"{name}=={version}" for name, version in versions.items())]


def install_command(wheels: list[Path], target: Path, *,
                    for_python: str | None = None) -> list[str]:
    """The offline install; for_python installs another interpreter's wheels (a check here)."""
    cross = _target_args(for_python) if for_python else []
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target), *cross,
            *map(str, wheels)]


def download_wheels(tokenizer_source: Path) -> None:
    versions = {name: metadata.version(name) for name in CARRIED}
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        subprocess.run(download_command(Path(tmp), versions), check=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        problems = check_wheels([w.name for w in wheels])
        if problems:
            raise SystemExit("\n".join(problems))
        with tempfile.TemporaryDirectory(prefix="gpu-site-") as site:
            subprocess.run(install_command(wheels, Path(site), for_python=PYTHON_VERSION),
                           check=True)
        WHEEL_DIR.mkdir(exist_ok=True)
        for old in WHEEL_DIR.glob("*.whl"):
            old.unlink()
        for wheel in wheels:
            shutil.move(wheel, WHEEL_DIR / wheel.name)
    TOKENIZER_DIR.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy2(tokenizer_source / name, TOKENIZER_DIR / name)
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise SystemExit(f"no tokenizer.json in {tokenizer_source} (make model writes it)")
    size = sum(p.stat().st_size for p in WHEEL_DIR.rglob("*") if p.is_file())
    print(f"{len(wheels)} wheels and the tokenizer in {WHEEL_DIR} ({size / 2**20:.1f} MiB)")


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    argv: list[str]
    timeout_s: float


def plan(python: str, device: str) -> list[Step]:
    """Every step after the install; device names the records (bench/results/*-<device>.json).

    Each limit is the 2026-11-27 H100's time with a margin: kernels_gpu 14 / 13 s (that
    morning / evening), offline_gpu 64 / 51 and 66 / 53 s, serving 114 / 75 s, tests/kernels in
    8 processes 98 s (evening), tests/gpu 125 / 86 s. Together they come to 540 s, which leaves
    a 600 s command a minute for the install and the device query; run_check lets a step use
    what the steps before it left unused. The benches go first: their records are what a GPU
    session is for and nothing else makes them. The tests go last because their time is the
    least known (Triton compiles most of it): they get the benches' unused time, and a command
    cut short, by a session with less device time left than the limits add up to, loses only
    tests, which `make test-gpu` reruns by hand. tests/gpu run alone: they size the KV cache
    from the GPU's free memory."""
    bench = [python, "-m"]
    steps = [Step("kernels_gpu", [*bench, "bench.kernels_gpu"], 25)]
    steps += [Step(f"offline_gpu {model}", [*bench, "bench.offline_gpu", "--models", model,
                                            "--tag", f"{device}-{model}"], timeout_s)
              for model, timeout_s in OFFLINE_MODELS.items()]
    steps.append(Step("serving", [
        *bench, "bench.serving", "--device", "cuda", "--shape", SERVING_SHAPE,
        "--tokenizer", str(TOKENIZER_DIR), "--api", "openai", "--concurrency", "1", "32", "256",
        "--requests-per-client", "2", "--min-requests", "8", "--tag", device], 110))
    steps += [Step("tests/kernels", ["make", "test-gpu-kernels", f"PY={python}"], 115),
              Step("tests/gpu", ["make", "test-gpu-engine", f"PY={python}"], 150)]
    return steps


def device_slug(python: str, env: dict[str, str]) -> str:
    """In a child process, so that this one never holds a CUDA context beside the benches."""
    name = subprocess.run([python, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def descendants(pid: int) -> list[int]:
    """pid's children, their children and so on, as /proc has them now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def run_step(step: Step, env: dict[str, str], limit_s: float) -> int | str:
    """The step's exit status, or "timeout" after limit_s: then its process group and every
    process it started are killed (a stack's services run in sessions of their own, where killpg
    does not reach, and would keep their share of the GPU from the steps after), and the check
    goes on."""
    proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, start_new_session=True)
    try:
        return proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        started = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return "timeout"


def preflight() -> list[str]:
    problems = check_wheels([p.name for p in WHEEL_DIR.glob("*.whl")])
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        problems.append(f"no tokenizer in {TOKENIZER_DIR} (run make gpu-wheels)")
    problems += [f"no generated stubs in {d.relative_to(ROOT)} (run make proto here, then carry "
                 f"services/rpc/v1 and services/rpc/internal)"
                 for d in STUB_DIRS if not (d / "__init__.py").is_file()]
    return problems


def run_check(dry_run: bool) -> int:
    problems = preflight()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(ROOT)]),
           "PYTHONUNBUFFERED": "1"}
    install = install_command(wheels, SITE_DIR)
    if dry_run:
        print(" ".join(install[:install.index("--target") + 2]), f".whl/*.whl ({len(wheels)})")
        for step in plan(sys.executable, "DEVICE"):
            print(" ".join(step.argv))
        return 0
    subprocess.run(install, check=True)
    device = device_slug(sys.executable, env)
    steps = plan(sys.executable, device)
    out = ROOT / "bench" / "results" / f"gpu_check-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results, start = [], time.monotonic()
    deadline = start
    for step in steps:
        # a step may also take the time the steps before it left unused: the tests, last,
        # get what the benches did not need, and the check still ends by the limits' sum
        deadline += step.timeout_s
        began = time.monotonic()
        limit_s = round(deadline - began, 1)
        print(f"== {step.name} (limit {limit_s} s)", flush=True)
        rc = run_step(step, env, limit_s)
        results.append({"step": step.name, "rc": rc, "s": round(time.monotonic() - began, 1),
                        "limit_s": limit_s})
        print(f"== {step.name}: {rc} in {results[-1]['s']} s", flush=True)
        # a command killed before the last step still leaves the steps that ended
        record = {"device": device, "total_s": round(time.monotonic() - start, 1),
                  "steps": results, "plan": [asdict(s) for s in steps]}
        out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(results), f"\nrecorded {out}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels", help="download the wheels into .whl/ (needs an index)")
    wheels.add_argument("--tokenizer", type=Path, default=Path.home() / ".cache" / "pagedserve"
                        / "models" / "SmolLM2-135M-Instruct",
                        help="a SmolLM2 folder (make model) whose tokenizer travels")
    run = sub.add_parser("run", help="install .whl/ into /tmp/site and run the check")
    run.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    if args.command == "wheels":
        download_wheels(args.tokenizer)
        return 0
    return run_check(args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
