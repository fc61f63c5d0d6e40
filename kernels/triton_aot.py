"""Ahead-of-time compilation of the Triton launches for a named NVIDIA GPU, on a machine without
one: Triton lowers to PTX and ptxas to a cubin, and the `cuobjdump` shipped in the Triton wheel
reads what each kernel costs (registers, spill stack, local and shared memory).

The launches are built by the same functions the ops run (`triton_ops.*_launch`), on CPU tensors
whose dtypes, strides and alignment match what the worker passes, and specialized by Triton's own
binder, so each compile is the one a GPU would JIT. Needs the compiler: not `TRITON_INTERPRET=1`."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from pagedserve.kernels import triton_layer_ops, triton_ops
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.triton_config import KernelLaunch
from pagedserve.kernels.triton_ops import Launch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, CompiledKernel, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

ARCHS = (80, 90)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NUM_KV_HEADS = 8  # Llama-3-8B's; the GQA ratio sets the query heads


@dataclass(frozen=True, slots=True)
class ArchLimits:
    max_shared_per_block_bytes: int  # opt-in maximum of dynamic shared memory
    max_shared_per_sm_bytes: int
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_programs_per_sm: int = 32
    reserved_shared_per_block_bytes: int = 1024  # the driver's, on sm_80 and newer


ARCH_LIMITS = {
    80: ArchLimits(max_shared_per_block_bytes=163 * 1024, max_shared_per_sm_bytes=164 * 1024),
    90: ArchLimits(max_shared_per_block_bytes=227 * 1024, max_shared_per_sm_bytes=228 * 1024),
}


@dataclass(slots=True)
class KernelReport:
    """One compiled launch: where it comes from and what ptxas made of it."""

    kernel: str
    phase: str  # one of BATCHES' phases, "cache" for write_kv and copy_blocks, "layer" for the
    # layer ops (kernels.triton_layer_ops)
    arch: int
    dtype: str
    head_size: int
    block_size: int
    gqa: int
    num_warps: int
    num_stages: int
    constexprs: dict[str, int | str]
    registers: int
    stack_bytes: int  # spills
    local_bytes: int
    shared_bytes: int  # static + dynamic
    shared_unpipelined_bytes: int | None  # the same kernel at num_stages=1, for loop kernels
    programs_per_sm: int
    warps_per_sm: int
    compile_s: float

    @property
    def occupancy(self) -> float:
        return self.warps_per_sm / ARCH_LIMITS[self.arch].max_warps_per_sm


def cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_launch(launch: Launch, arch: int, **overrides: object) -> CompiledKernel:
    """triton.compile of exactly what `launch()` would JIT on a GPU of compute capability
    arch // 10 (overrides replace launch options such as num_stages)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset")
    fn = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = {**launch.kwargs, **overrides}
    bind = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = bind(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


@functools.cache
def _binder(kernel: object, arch: int) -> tuple[JITFunction, object]:
    """The compiler's view of a kernel (under TRITON_INTERPRET=1 the decorator wraps it for the
    interpreter, with the same options) and Triton's argument binder for arch."""
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    return fn, create_function_from_signature(fn.signature, fn.params, backend)


def compile_key(launch: Launch, arch: int = 90) -> tuple:
    """What Triton's JIT keys its compiled kernels by (kernel, each argument's type and
    specialization, constexprs, launch options): two launches with one key run one compiled
    kernel, a new key compiles. Needs no compiler, so it also runs under TRITON_INTERPRET=1."""
    fn, bind = _binder(launch.kernel, arch)
    _, specialization, options = bind(*launch.args, **launch.kwargs)
    return fn.__name__, tuple(specialization), tuple(sorted(options.items()))


_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(compiled: CompiledKernel) -> dict[str, int]:
    """registers, stack_bytes, local_bytes and shared_bytes (static + Triton's dynamic)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(cuobjdump()), "-res-usage", str(path)], check=True,
                              capture_output=True, text=True).stdout
    match = _RES_USAGE.search(text)
    if match is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line: {text!r}")
    registers, stack, static_shared, local = map(int, match.groups())
    return dict(registers=registers, stack_bytes=stack, local_bytes=local,
                shared_bytes=static_shared + compiled.metadata.shared)


def programs_per_sm(arch: int, registers: int, shared_bytes: int, num_warps: int) -> int:
    """Theoretical: registers are granted per warp in 256-register units."""
    limits = ARCH_LIMITS[arch]
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = limits.registers_per_sm // per_warp // num_warps
    per_program_shared = shared_bytes + limits.reserved_shared_per_block_bytes
    by_shared = limits.max_shared_per_sm_bytes // per_program_shared
    by_warps = limits.max_warps_per_sm // num_warps
    return min(by_registers, by_shared, by_warps, limits.max_programs_per_sm)


def step_metadata(query_lens: list[int], seq_lens: list[int], block_size: int) -> AttentionMetadata:
    """A step as worker_svc.model_input builds it (prefills first, block tables as wide as the
    longest sequence needs), on CPU tensors."""
    num_prefills = sum(q > 1 for q in query_lens)  # the batches list prompts first
    max_blocks = triton.cdiv(max(seq_lens), block_size)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_prefills=num_prefills,
        num_prefill_tokens=sum(query_lens[:num_prefills]), query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens)


# (phase, query lens, seq lens): a decode batch inside one partition (unified kernel, 16 rows),
# a prompt (unified, prefill rows), decodes at 2k context (split-KV and its reduce), and a short
# prompt beside decodes at 32k (wide reduce; the decodes start at an odd token, which Triton
# specializes differently from 0).
BATCHES = (
    ("decode", [1] * 32, [512] * 32),
    ("prefill", [2048], [2048]),
    ("split", [1] * 32, [2048] * 32),
    ("mixed-32k", [7, 1, 1], [7, 32768, 32768]),
)
# The loops whose K/V tiles must be pipelined: they are also compiled at num_stages=1 to compare.
PIPELINED = {("decode", "unified_attention_kernel"), ("split", "decode_partition_kernel")}


def worker_launches(arch: int, dtype: torch.dtype, head_size: int, block_size: int,
                    gqa: int) -> list[tuple[str, Launch]]:
    """(phase, Launch) for every launch the worker makes at this configuration."""
    num_heads = NUM_KV_HEADS * gqa
    kv_cache = torch.empty(2, 4, block_size, NUM_KV_HEADS, head_size, dtype=dtype)
    launches = []
    for phase, query_lens, seq_lens in BATCHES:
        meta = step_metadata(query_lens, seq_lens, block_size)
        num_tokens = sum(query_lens)
        qkv = torch.empty(num_tokens, num_heads + 2 * NUM_KV_HEADS, head_size, dtype=dtype)
        query, key = qkv[:, :num_heads], qkv[:, num_heads:num_heads + NUM_KV_HEADS]
        value = qkv[:, num_heads + NUM_KV_HEADS:]
        out = torch.empty(num_tokens, num_heads, head_size, dtype=dtype)
        launches += [(phase, launch) for launch in triton_ops.attention_launches(
            out, query, kv_cache[0], kv_cache[1], meta, head_size ** -0.5, arch // 10)]
        if phase == "prefill":
            launches.append(("cache", triton_ops.write_kv_launch(
                key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)))
    launches.append(("cache", triton_ops.copy_blocks_launch(
        [kv_cache, torch.empty_like(kv_cache)], torch.tensor([[0, 1], [2, 3]]))))
    return launches


# Whole-model layer ops: Llama-3-8B's hidden and intermediate sizes, and a 70B's hidden size.
NORM_HIDDEN_SIZES = (4096, 8192)
INTERMEDIATE_SIZE = 14336
LAYER_TOKENS = 32


def layer_launches(dtype: torch.dtype, head_size: int, gqa: int,
                   has_model_ops: bool) -> list[tuple[str, Launch]]:
    """The layer ops' launches: rotary + K/V write, alone and with the per-head (q/k) norms
    (Qwen3), and the per-head norm at this head size, and with has_model_ops the hidden-size
    norms and SiLU-and-mul."""
    num_heads = NUM_KV_HEADS * gqa
    qkv = torch.empty(LAYER_TOKENS, (num_heads + 2 * NUM_KV_HEADS) * head_size, dtype=dtype)
    query, key, value = qkv.split([num_heads * head_size, NUM_KV_HEADS * head_size,
                                   NUM_KV_HEADS * head_size], dim=-1)
    kv_cache = torch.empty(2, 4, 16, NUM_KV_HEADS, head_size, dtype=dtype)
    positions = torch.zeros(LAYER_TOKENS, dtype=torch.int64)
    cos_sin = torch.empty(8192, head_size, dtype=torch.float32)
    heads = query.unflatten(-1, (num_heads, head_size))
    norm_weight = torch.empty(head_size, dtype=dtype)
    launches = [
        triton_layer_ops.rotary_write_kv_launch(
            torch.empty_like(heads), positions, query, key, value, cos_sin, kv_cache[0],
            kv_cache[1], positions),
        triton_layer_ops.rotary_write_kv_launch(
            torch.empty_like(heads), positions, query, key, value, cos_sin, kv_cache[0],
            kv_cache[1], positions, norm_weight, norm_weight, 1e-6),
        triton_layer_ops.rms_norm_launch(torch.empty_like(heads), None, heads, None,
                                         torch.empty(head_size, dtype=dtype), 1e-6),
    ]
    if has_model_ops:
        for hidden in NORM_HIDDEN_SIZES:
            x = torch.empty(LAYER_TOKENS, hidden, dtype=dtype)
            weight = torch.empty(hidden, dtype=dtype)
            launches.append(triton_layer_ops.rms_norm_launch(torch.empty_like(x),
                                                             torch.empty_like(x), x,
                                                             torch.empty_like(x), weight, 1e-6))
        x = torch.empty(LAYER_TOKENS, 2 * INTERMEDIATE_SIZE, dtype=dtype)
        launches.append(triton_layer_ops.silu_and_mul_launch(
            torch.empty(LAYER_TOKENS, INTERMEDIATE_SIZE, dtype=dtype), x))
    return [("layer", launch) for launch in launches]


@dataclass(frozen=True, slots=True)
class CompileConfig:
    arch: int
    dtype: str
    head_size: int
    block_size: int
    gqa: int
    has_cache_ops: bool  # write_kv and copy_blocks do not depend on the GQA ratio
    has_model_ops: bool  # the hidden-size layer ops: once per architecture and dtype
    is_full: bool  # also mixed-32k's unified and partition launches, close kin of others


def _constexprs(launch: Launch) -> dict[str, int | str]:
    return {k: v for k, v in launch.kwargs.items() if k not in ("num_warps", "num_stages")}


def compile_config(config: CompileConfig) -> list[KernelReport]:
    reports = []
    dtype = DTYPES[config.dtype]
    launches = worker_launches(config.arch, dtype, config.head_size, config.block_size,
                               config.gqa)
    if config.has_cache_ops:
        launches += layer_launches(dtype, config.head_size, config.gqa, config.has_model_ops)
    for phase, launch in launches:
        name = launch.kernel.__name__
        if (phase == "cache" and not config.has_cache_ops) or (
                phase == "mixed-32k" and name != "decode_reduce_kernel" and not config.is_full):
            continue
        started = time.perf_counter()
        compiled = compile_launch(launch, config.arch)
        usage = resource_usage(compiled)
        unpipelined = None
        if (phase, name) in PIPELINED:
            unpipelined = resource_usage(
                compile_launch(launch, config.arch, num_stages=1))["shared_bytes"]
        tuning = KernelLaunch(compiled.metadata.num_warps, compiled.metadata.num_stages)
        programs = programs_per_sm(config.arch, usage["registers"], usage["shared_bytes"],
                                   tuning.num_warps)
        reports.append(KernelReport(
            kernel=name, phase=phase, arch=config.arch, dtype=config.dtype,
            head_size=config.head_size, block_size=config.block_size, gqa=config.gqa,
            num_warps=tuning.num_warps, num_stages=tuning.num_stages,
            constexprs=_constexprs(launch), **usage, shared_unpipelined_bytes=unpipelined,
            programs_per_sm=programs, warps_per_sm=programs * tuning.num_warps,
            compile_s=round(time.perf_counter() - started, 2)))
    return reports


FULL_SHAPES = [(head, block, gqa) for head in (64, 128) for block in (16, 32)
               for gqa in range(1, 9)]
# Every kernel at head 128, each head size, block size and GQA extreme, and Llama-3-8B's ratio 4.
DEFAULT_SHAPES = [(128, 16, 1), (128, 16, 4), (128, 16, 8), (128, 32, 8), (64, 16, 8),
                  (64, 32, 1)]


def matrix(is_full: bool) -> list[CompileConfig]:
    """(head size, block size, GQA ratio) shapes × sm_80, sm_90 × fp16, bf16."""
    configs = []
    for arch in ARCHS:
        for dtype in DTYPES:
            seen_cache_ops = set()
            for head, block, gqa in FULL_SHAPES if is_full else DEFAULT_SHAPES:
                configs.append(CompileConfig(arch, dtype, head, block, gqa, is_full=is_full,
                                             has_cache_ops=(head, block) not in seen_cache_ops,
                                             has_model_ops=not seen_cache_ops))
                seen_cache_ops.add((head, block))
    return configs


def compile_matrix(is_full: bool = False, jobs: int = 2) -> list[KernelReport]:
    from concurrent.futures import ProcessPoolExecutor

    configs = matrix(is_full)
    if jobs <= 1:
        return [r for config in configs for r in compile_config(config)]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return [r for reports in pool.map(compile_config, configs) for r in reports]


def report_dict(report: KernelReport) -> dict:
    return {**dataclasses.asdict(report), "occupancy": round(report.occupancy, 3)}


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Compile the worker's Triton launches for "
                                     "sm_80 and sm_90 and print their resource usage as JSON.")
    parser.add_argument("--full", action="store_true", help="every head size, block size and "
                        "GQA ratio (default: head 128 and the extremes of the rest)")
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes")
    args = parser.parse_args()
    print(json.dumps([report_dict(r) for r in compile_matrix(args.full, args.jobs)]))


if __name__ == "__main__":
    main()
