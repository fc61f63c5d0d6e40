"""Every Triton kernel compiled ahead of time for sm_80 and sm_90 at the launches the worker makes
(`kernels.triton_aot`): no compile error, no spill, shared memory within the architecture, and
the decode budgets the launch table promises. No GPU needed: ptxas and cuobjdump ship in Triton.

The compiler cannot run under TRITON_INTERPRET=1 (which `make test` sets), so one subprocess
compiles the whole matrix; PAGEDSERVE_AOT_FULL=1 widens it to every head size × block size × GQA
ratio (the default covers head 128 fully and the extremes of the rest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from pagedserve.kernels.triton import attention_kernels, cache_kernels, layer_kernels  # noqa: E402
from pagedserve.kernels.triton_aot import ARCH_LIMITS, ARCHS, DTYPES  # noqa: E402
from pagedserve.kernels.triton_config import LAUNCH_CONFIGS, launch_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DECODE_KERNELS = {("decode", "unified_attention_kernel"), ("split", "decode_partition_kernel")}
ELEMENT_BYTES = {"fp16": 2, "bf16": 2}


def _kernel_names() -> set[str]:
    """Public @triton.jit functions of the kernel modules (helpers start with an underscore)."""
    return {name for module in (attention_kernels, cache_kernels, layer_kernels)
            for name, obj in vars(module).items()
            if not name.startswith("_") and hasattr(obj, "fn") and hasattr(obj, "arg_names")}


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton wheel ships no NVIDIA toolchain (cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "pagedserve.kernels.triton_aot", "--jobs", "2"]
    if os.environ.get("PAGEDSERVE_AOT_FULL") == "1":
        command.append("--full")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, f"ahead-of-time compile failed:\n{done.stderr[-6000:]}"
    return json.loads(done.stdout)


def _select(reports: list[dict], **fields) -> list[dict]:
    return [r for r in reports if all(r[k] == v for k, v in fields.items())]


def _label(r: dict) -> str:
    return (f"{r['kernel']}[{r['phase']}] sm_{r['arch']} {r['dtype']} head {r['head_size']} "
            f"block {r['block_size']} gqa {r['gqa']}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", sorted(_kernel_names()))
def test_compiles_without_spills(reports, kernel, arch):
    selected = _select(reports, kernel=kernel, arch=arch)
    assert {r["dtype"] for r in selected} == set(DTYPES), f"{kernel} is not in the matrix"
    limit = ARCH_LIMITS[arch].max_shared_per_block_bytes
    for r in selected:
        assert r["stack_bytes"] == 0 and r["local_bytes"] == 0, f"{_label(r)} spills: {r}"
        assert r["shared_bytes"] <= limit, f"{_label(r)} needs {r['shared_bytes']} B shared"
        assert r["programs_per_sm"] >= 1, f"{_label(r)} cannot be resident: {r}"


def test_every_worker_phase_is_compiled(reports):
    phases = {(r["phase"], r["kernel"]) for r in reports}
    assert phases >= DECODE_KERNELS | {("prefill", "unified_attention_kernel"),
                                       ("split", "decode_reduce_kernel"),
                                       ("mixed-32k", "decode_reduce_kernel"),
                                       ("cache", "write_kv_kernel"),
                                       ("cache", "copy_blocks_kernel"),
                                       ("layer", "rms_norm_kernel"),
                                       ("layer", "silu_and_mul_kernel"),
                                       ("layer", "rotary_write_kv_kernel")}
    assert any(r["constexprs"].get("HAS_QK_NORM") for r in reports
               if r["kernel"] == "rotary_write_kv_kernel")  # Qwen3's q/k norms fused
    shapes = {(r["head_size"], r["block_size"], r["gqa"]) for r in reports}
    assert {h for h, _, _ in shapes} == {64, 128} and {b for _, b, _ in shapes} == {16, 32}
    assert {1, 8} <= {g for _, _, g in shapes}


def test_decode_budget_on_sm90_head_128(reports):
    """At most 128 registers (at least four 4-warp programs per SM by registers), and the K/V
    tiles double-buffered: shared memory grows by at least one more K and V tile over the same
    kernel at num_stages=1."""
    selected = [r for r in _select(reports, arch=90, head_size=128)
                if (r["phase"], r["kernel"]) in DECODE_KERNELS]
    assert selected
    for r in selected:
        tile_bytes = r["constexprs"]["TILE_N"] * r["head_size"] * ELEMENT_BYTES[r["dtype"]]
        assert r["num_warps"] == 4 and r["num_stages"] >= 2, _label(r)
        assert r["registers"] <= 128, f"{_label(r)}: {r['registers']} registers"
        assert r["programs_per_sm"] >= 4, f"{_label(r)}: {r['programs_per_sm']} programs/SM"
        assert r["shared_bytes"] - r["shared_unpipelined_bytes"] >= 2 * tile_bytes, \
            f"{_label(r)}: K/V not pipelined ({r['shared_bytes']} vs " \
            f"{r['shared_unpipelined_bytes']} B unpipelined)"


def test_launch_parameters_come_from_the_table(reports):
    for r in reports:
        if r["phase"] in ("cache", "layer"):
            continue
        config = launch_config(r["arch"] // 10, r["head_size"])
        if r["kernel"] == "decode_reduce_kernel":
            tuning, tile_n = config.reduce, None
        elif r["phase"] == "prefill":
            tuning, tile_n = config.prefill, config.prefill_tile_n
        else:
            tuning, tile_n = config.decode, config.decode_tile_n
        assert (r["num_warps"], r["num_stages"]) == (tuning.num_warps, tuning.num_stages), \
            _label(r)
        assert r["constexprs"].get("TILE_N") == tile_n, _label(r)


def test_launch_config_lookup():
    assert set(LAUNCH_CONFIGS) == {(8, 64), (8, 128), (9, 64), (9, 128)}
    assert launch_config(8, 128) is LAUNCH_CONFIGS[8, 128]
    assert launch_config(10, 64) is LAUNCH_CONFIGS[9, 64]  # newer GPUs: the newest row
    assert launch_config(7, 64) is LAUNCH_CONFIGS[8, 64]  # older: the oldest row
    assert launch_config(9, 96) is LAUNCH_CONFIGS[9, 128]  # the bucket that holds the head
    assert launch_config(9, 256) is LAUNCH_CONFIGS[9, 128]
    assert launch_config(None, 64) is LAUNCH_CONFIGS[8, 64]  # the interpreter
