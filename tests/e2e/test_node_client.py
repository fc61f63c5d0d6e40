"""The Node.js example client (examples/node/client.js, @grpc/grpc-js over protos/) against a
real stack: it streams, cancels a stream (then the scheduler's GetLoad shows the request gone)
and prints a field violation from the rich error details. Skipped only where node is absent."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.stack import assert_idle, start_stack, tiny_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node"
NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_node_client_streams_cancels_and_reads_a_field_violation(tiny_served_model_dir):
    assert (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        f"run `npm ci` in {EXAMPLE} (make test does)")
    stack = start_stack(tiny_config(tiny_served_model_dir))
    try:
        run = subprocess.run(
            [NODE, str(EXAMPLE / "client.js"), "--gateway", stack.gateway_address,
             "--scheduler", stack.scheduler_address, "--prompt", "hello world"],
            capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        lines = run.stdout.splitlines()
        assert any(line.startswith("model: tiny-llama (LlamaForCausalLM") for line in lines)
        assert "stream finished: FINISH_REASON_LENGTH" in run.stdout
        assert "scheduler load after cancel: running 0, waiting 0" in run.stdout
        assert any(line.startswith("gateway: node-cancel-") and "NOT_FOUND" in line
                   for line in lines)
        assert "error: INVALID_ARGUMENT: " in run.stdout
        violations = [line for line in lines if line.startswith("field violation: ")]
        assert violations and "temperature" in violations[0], run.stdout
        assert_idle(stack)
    finally:
        stack.close()
