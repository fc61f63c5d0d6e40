"""The chart's commands, run: an engine pod as rendered (its scheduler and two tensor-parallel
rank containers meeting on loopback) and a gateway dialling it, each started with exactly the
rendered argv (CPU, a tiny model, free ports); then the `helm test` hook's own script against
the gateway, over HTTP and over gRPC; then SIGTERM drains every service to a clean exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pagedserve.kernels import cpu_extension

from pagedserve.supervisor import free_port
from tests.unit.helm_render import FULLNAME, NAMESPACE, pod_specs, render

VENV_BIN = str(Path(sys.executable).parent)


def _values(model_dir: Path) -> dict[str, Any]:
    return {"model": {"mountPath": str(model_dir.parent), "path": str(model_dir),
                      "hostPath": str(model_dir.parent)},
            "engine": {"device": "cpu", "gpuResource": "", "tensorParallelSize": 2,
                       "enableCudaGraph": False, "maxNumSeqs": 8, "maxModelLen": 256,
                       "maxNumBatchedTokens": 256, "swapSpaceGib": 0.01},
            "listenHost": "127.0.0.1", "drainTimeoutS": 2,
            "scheduler": {"port": free_port()},
            "worker": {"port": free_port(), "distributedPort": free_port()},
            "metrics": {"enabled": False},
            "gateway": {"port": free_port(), "httpPort": free_port()}}


def _start(container: dict[str, Any], env: dict[str, str], log: Path) -> subprocess.Popen:
    argv = [a.replace(f"{FULLNAME}-engine.{NAMESPACE}.svc.cluster.local", "127.0.0.1")
            for a in container["args"]]
    return subprocess.Popen([f"{VENV_BIN}/pagedserve", container["command"][1], *argv],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_the_rendered_pods_serve_and_the_helm_test_hook_passes(tiny_served_model_dir, tmp_path):
    values = _values(tiny_served_model_dir)
    specs = pod_specs(render(values))
    # a HOME of its own, but the CPU kernels this machine has built already (two workers
    # compiling them again under an empty HOME took most of this test's time)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PATH=f"{VENV_BIN}:{os.environ['PATH']}",
               HOME=str(tmp_path), TRITON_INTERPRET="1",
               TORCH_EXTENSIONS_DIR=cpu_extension.build_root())
    containers = [*specs["engine"]["containers"], *specs["gateway"]["containers"]]
    assert [c["name"] for c in containers] == ["scheduler", "worker-0", "worker-1", "gateway"]
    procs = [_start(c, env, tmp_path / f"{c['name']}.log") for c in containers]
    hook = specs["test"]["containers"][0]
    script, *args = hook["command"][2:]
    args = [a.replace(f"{FULLNAME}-gateway", "127.0.0.1") for a in args]
    try:
        deadline = time.monotonic() + 240
        while True:
            result = subprocess.run([sys.executable, "-c", script, *args], env=env,
                                    capture_output=True, text=True, timeout=180)
            if result.returncode == 0 or time.monotonic() > deadline or \
                    any(p.poll() is not None for p in procs):
                break
            time.sleep(2)
        logs = {p.name: p.read_text()[-1500:] for p in tmp_path.glob("*.log")}
        assert result.returncode == 0, (result.stdout, result.stderr[-1500:], logs)
        assert "gateway health: SERVING" in result.stdout
        assert "generated 4 tokens" in result.stdout
        # with gateway.httpPort 0 the hook's HTTP base is "": `pagedserve generate` over gRPC
        grpc_args = [args[0], "", *args[2:]]
        result = subprocess.run([sys.executable, "-c", script, *grpc_args], env=env,
                                capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr[-1500:]
        assert result.stdout.startswith("gateway health: SERVING\n")  # then the stream
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(60))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append("killed")
    assert codes == [0, 0, 0, 0]
