"""make gpu-check's plan, checked on CPU: what travels as wheels, what it runs, in which order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from bench import gpu_check, serving

ROOT = Path(__file__).resolve().parents[2]
GPU_MACHINE = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "implementation_name": "cpython",
               "platform_python_implementation": "CPython", "extra": ""}


def test_every_runtime_dependency_travels_or_is_on_the_gpu_machine():
    """A new dependency must join CARRIED (or PROVIDED, if a CUDA image has it), else the GPU
    machine, which has no index, fails to import pagedserve (or to run make test-gpu-kernels,
    which needs pytest-xdist)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    todo = [Requirement(r) for r in project["dependencies"]]
    todo += [Requirement(r) for r in extras["smollm2"] if Requirement(r).name == "gguf"]
    todo += [Requirement(r) for r in extras["test"] if Requirement(r).name == "pytest-xdist"]
    carried = {gpu_check.normalize(n) for n in gpu_check.CARRIED}
    provided = {gpu_check.normalize(n) for n in gpu_check.PROVIDED}
    seen, missing = set(), []
    while todo:
        req = todo.pop()
        name = gpu_check.normalize(req.name)
        if name in seen or (req.marker and not req.marker.evaluate(GPU_MACHINE)):
            continue
        seen.add(name)
        if name in provided:
            continue
        if name not in carried:
            missing.append(name)
            continue
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    assert missing == []
    assert carried <= seen, "a carried package nothing needs"


def test_check_wheels_names_a_missing_and_a_doubled_package():
    wheels = [f"{gpu_check.normalize(n).replace('-', '_')}-1.0-py3-none-any.whl"
              for n in gpu_check.CARRIED if n != "uvicorn"]
    wheels.append("grpcio-1.0.1-cp312-cp312-manylinux_2_17_x86_64.whl")
    assert gpu_check.check_wheels(wheels) == [
        "no wheel of uvicorn in .whl/ (run make gpu-wheels where an index is reachable)",
        "two wheels of grpcio in .whl/: grpcio-1.0-py3-none-any.whl, "
        "grpcio-1.0.1-cp312-cp312-manylinux_2_17_x86_64.whl"]


def test_plan_runs_the_benches_first_each_offline_model_alone_and_fits_in_9_minutes():
    """A 600 s command holds the steps' limits and a minute for the install."""
    steps = gpu_check.plan("python3", "nvidia-h100")
    assert [s.argv for s in steps[-2:]] == [["make", "test-gpu-kernels", "PY=python3"],
                                            ["make", "test-gpu-engine", "PY=python3"]]
    assert all(s.argv[:2] == ["python3", "-m"] for s in steps[:-2])
    offline = [s.argv for s in steps if "bench.offline_gpu" in s.argv]
    assert [a[a.index("--models") + 1:a.index("--tag")] for a in offline] == [
        [m] for m in gpu_check.OFFLINE_MODELS]
    (serve,) = [s.argv for s in steps if "bench.serving" in s.argv]
    assert serve[serve.index("--device") + 1] == "cuda"
    assert serve[serve.index("--api") + 1] == "openai"  # both doors
    assert all(a[a.index("--tag") + 1].startswith("nvidia-h100") for a in [*offline, serve])
    assert sum(s.timeout_s for s in steps) <= 9 * 60


def test_make_test_gpu_shares_the_gpu_among_kernel_tests_only():
    """tests/gpu size the KV cache from the GPU's free memory: they must run in one process."""
    done = subprocess.run(["make", "-s", "-n", "test-gpu", "PY=python3"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    commands = [line for line in done.stdout.splitlines() if "pytest" in line]
    assert len(commands) == 2
    kernels, engine = (command.split() for command in commands)
    assert kernels[-3:] == ["-n", "8", "tests/kernels"]
    assert engine[-1] == "tests/gpu" and "-n" not in engine


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    wheel_dir = tmp_path / ".whl"
    (wheel_dir / "smollm2-tokenizer").mkdir(parents=True)
    (wheel_dir / "smollm2-tokenizer" / "tokenizer.json").write_text("{}")
    for name in gpu_check.CARRIED:
        (wheel_dir / f"{name.replace('-', '_')}-1.0-py3-none-any.whl").touch()
    stubs = (tmp_path / "v1", tmp_path / "internal" / "v1")
    for d in stubs:
        d.mkdir(parents=True)
        (d / "__init__.py").touch()
    monkeypatch.setattr(gpu_check, "WHEEL_DIR", wheel_dir)
    monkeypatch.setattr(gpu_check, "TOKENIZER_DIR", wheel_dir / "smollm2-tokenizer")
    monkeypatch.setattr(gpu_check, "STUB_DIRS", stubs)
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    return tmp_path


def test_dry_run_prints_the_offline_install_then_the_steps(checkout, capsys):
    assert gpu_check.main(["run", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "--no-index --no-deps" in lines[0] and "--target /tmp/site" in lines[0]
    assert lines[0].endswith(f".whl/*.whl ({len(gpu_check.CARRIED)})")
    assert lines[1] == f"{gpu_check.sys.executable} -m bench.kernels_gpu"
    assert lines[-1] == f"make test-gpu-engine PY={gpu_check.sys.executable}"


def test_the_record_holds_each_step_as_it_ends(checkout, monkeypatch):
    """A command killed during the tests still leaves the benches' statuses."""
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(gpu_check, "device_slug", lambda python, env: "gpu")
    record = checkout / "bench" / "results" / "gpu_check-gpu.json"
    seen = []

    def run_step(step, env, limit_s):
        seen.append([s["step"] for s in json.loads(record.read_text())["steps"]]
                    if record.exists() else [])
        return 0

    monkeypatch.setattr(gpu_check, "run_step", run_step)
    assert gpu_check.main(["run"]) == 0
    names = [s.name for s in gpu_check.plan("python3", "gpu")]
    assert seen == [names[:i] for i in range(len(names))]


def test_a_step_gets_the_time_the_steps_before_it_left_unused(checkout, monkeypatch):
    """The tests, last, may run past their own limit by what the benches did not use; the
    check still ends by the sum of the limits."""
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(gpu_check, "device_slug", lambda python, env: "gpu")
    monkeypatch.setattr(gpu_check, "plan", lambda python, device: [
        gpu_check.Step(name, [name], 100) for name in ("bench", "slow bench", "tests")])
    now = [0.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: now[0])
    used = {"bench": 40, "slow bench": 130, "tests": 0}
    limits = {}

    def run_step(step, env, limit_s):
        limits[step.name] = limit_s
        now[0] += min(used[step.name], limit_s)
        return 0 if used[step.name] < limit_s else "timeout"

    monkeypatch.setattr(gpu_check, "run_step", run_step)
    assert gpu_check.main(["run"]) == 0
    assert limits == {"bench": 100, "slow bench": 160, "tests": 130}


def test_a_step_past_its_limit_is_killed_with_what_it_started_in_other_sessions(tmp_path):
    """bench.serving's stack puts each service in a session of its own, which killpg misses:
    such a service would keep its share of the GPU from the steps after."""
    pid_file = tmp_path / "pid"
    service = "import time; time.sleep(60)"
    bench = (f"import subprocess, sys, time, pathlib; p = subprocess.Popen([sys.executable, '-c', "
             f"{service!r}], start_new_session=True); "
             f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid)); time.sleep(60)")
    step = gpu_check.Step("bench", [sys.executable, "-c", bench], 60)
    assert gpu_check.run_step(step, dict(os.environ), 3) == "timeout"
    pid = int(pid_file.read_text())
    try:
        for _ in range(100):
            if not is_running(pid):
                break
            time.sleep(0.05)
        assert not is_running(pid)
    finally:
        if is_running(pid):
            os.kill(pid, signal.SIGKILL)


def is_running(pid: int) -> bool:
    """Neither gone nor a zombie that nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_run_stops_before_anything_when_the_stubs_did_not_travel(checkout, capsys):
    (checkout / "internal" / "v1" / "__init__.py").unlink()
    assert gpu_check.main(["run", "--dry-run"]) == 2
    assert "no generated stubs in internal/v1" in capsys.readouterr().err


def test_serving_on_cuda_gives_each_side_its_share_of_the_device():
    args = serving.parse_args(["--device", "cuda", "--shape", "smollm2-1.7b",
                               "--tokenizer", "/tok", "--concurrency", "1", "256"])
    kwargs = serving.engine_kwargs(args)
    assert kwargs["gpu_memory_utilization"] == 0.4 and "kv_cache_memory_gib" not in kwargs
    assert (kwargs["dtype"], kwargs["load_format"], kwargs["max_num_seqs"]) == (
        "bfloat16", "dummy", 256)
    flags = serving.serve_args(args, 1, 2)
    assert flags[flags.index("--device") + 1] == "cuda"
    assert flags[flags.index("--tokenizer") + 1] == "/tok"


def test_the_gpu_tests_worker_config_builds_on_cpu(tmp_path):
    """tests/gpu only runs on a lent GPU: its config helper, at its defaults and with the knobs the
    GPU tests turn, is checked here (a slots dataclass's class attribute, once its default, made
    every CUDA-graph test fail on the 2026-11-27 H100 before a step ran)."""
    from tests.gpu.gpu_worker import cuda_config

    assert cuda_config(tmp_path).device.max_cuda_graph_tokens > 0
    config = cuda_config(tmp_path, backend="torch", dtype="bfloat16", max_num_seqs=256,
                         enable_cuda_graph=True, max_cuda_graph_tokens=0)
    assert (config.device.device, config.device.attention_backend) == ("cuda", "torch")
    assert config.device.max_cuda_graph_tokens == 0 and config.scheduler.max_num_seqs == 256
