"""Warm-up steps: on CUDA the attention backend's compile-every-variant steps run before serving
(kernels/triton_ops.py), and the dummy forward can run a decode after cached context, which is how
they reach the split-KV kernels."""

from __future__ import annotations

import torch
from pagedserve.kernels import triton_ops
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedserve.worker_svc import model_runner
from pagedserve.worker_svc.cache_engine import allocate_kv_caches
from pagedserve.worker_svc.model_runner import dummy_num_blocks
from pagedserve.worker_svc.worker import Worker


def _worker(path) -> Worker:
    worker = Worker(EngineConfig(
        model=ModelConfig(model=str(path)), cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8),
        device=DeviceConfig(device="cpu", attention_backend="ref")))
    worker.load_model()
    return worker


def test_cuda_warm_up_adds_the_backends_steps(tiny_model_dir, monkeypatch):
    worker = _worker(tiny_model_dir("llama"))
    assert worker._warm_up_batches() == [([8, 1], [0, 0])]  # CPU: nothing compiles
    monkeypatch.setattr(worker, "device", torch.device("cuda"))
    monkeypatch.setattr(worker, "backend", triton_ops)
    max_model_len = worker.get_info().max_model_len
    assert worker._warm_up_batches() == [([8, 1], [0, 0]),
                                         *triton_ops.warm_up_batches(max_model_len)]


def test_dummy_run_decodes_after_cached_context(tiny_model_dir, monkeypatch):
    worker = _worker(tiny_model_dir("llama"))
    steps, build = [], model_runner.build_model_input

    def recording_build(*args, **kwargs):
        steps.append(build(*args, **kwargs))
        return steps[-1]

    monkeypatch.setattr(model_runner, "build_model_input", recording_build)
    num_blocks = dummy_num_blocks([1, 8], 16, [500, 0])
    assert num_blocks == 32 + 1
    kv_caches = allocate_kv_caches(worker.kv_spec, num_blocks, torch.device("cpu"))
    worker.runner.dummy_run([1, 8], kv_caches, [500, 0])
    meta = steps[-1].meta
    assert (meta.num_prefills, meta.query_lens_cpu, meta.seq_lens_cpu) == (1, [8, 1], [8, 501])
    assert meta.block_tables.shape[1] == 32
