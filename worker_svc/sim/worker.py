"""The simulated worker (device "sim"): the real Worker with the forward, the sampler and the KV
cache swapped for models of a named GPU; a step takes the time of the kernels the real model
code would launch for it (worker_svc/sim/step_model.py). Its timings are a model, never a measurement: they tell
how the control plane would keep up with that GPU, not how fast the GPU is.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from pagedserve.services.common.config import EngineConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.step_plan import MemoryProfile, WorkerInfo
from pagedserve.worker_svc.cache_engine import KVCacheSpec
from pagedserve.worker_svc.cuda_graphs import MAX_CAPTURE_SEQ_LEN
from pagedserve.worker_svc.grammar_matchers import GrammarMatchers
from pagedserve.worker_svc.graph_buckets import GraphBuckets, capture_buckets
from pagedserve.worker_svc.loader import eos_token_ids, load_hf_config
from pagedserve.worker_svc.model_runner import ModelRunner
from pagedserve.worker_svc.models.registry import resolve_architecture
from pagedserve.worker_svc.sim.cache_engine import SimCacheEngine
from pagedserve.worker_svc.sim.draft_proposer import SimDraftProposer
from pagedserve.worker_svc.sim.memory import sim_memory_profile
from pagedserve.worker_svc.sim.model import SimModel
from pagedserve.worker_svc.sim.roofline import (
    GpuSpec,
    ModelShape,
    Roofline,
    resolve_gpu,
    resolve_model_shape,
)
from pagedserve.worker_svc.sim.sampler import SimSampler
from pagedserve.worker_svc.sim.step_model import StepModel, traced_ops
from pagedserve.worker_svc.sim.timeline import GpuTimeline
from pagedserve.worker_svc.sim.trace import sim_hf_config
from pagedserve.worker_svc.worker import Worker

logger = logging.getLogger(__name__)

_DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SimWorker(Worker):
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        super().__init__(config, rank)
        if config.model.dtype not in _DTYPES:
            raise ConfigError(f"device='sim' models 16-bit weights: dtype must be one of "
                              f"{list(_DTYPES)}, got {config.model.dtype!r}")
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigError(f"device='sim' models one GPU: tensor_parallel_size must be 1, "
                              f"got {config.parallel.tensor_parallel_size}")
        self.dtype = _DTYPES[config.model.dtype]
        device = config.device
        self.timeline = GpuTimeline(device.sim_time_scale)
        self.roofline: Roofline | None = None
        self.draft_roofline: Roofline | None = None
        self.step_model: StepModel | None = None

    def load_model(self) -> WorkerInfo:
        """The served folder gives the vocabulary, EOS and length limit (its tokenizer is the
        gateway's); sim_model gives the shapes that are timed and sized."""
        model_config, device = self.config.model, self.config.device
        hf_config = load_hf_config(model_config.model)
        shape = resolve_model_shape(device.sim_model or model_config.model)
        gpu = resolve_gpu(device.sim_gpu)
        model_max_len = int(hf_config.max_position_embeddings)
        if model_config.max_model_len > model_max_len:
            raise ConfigError(f"max_model_len={model_config.max_model_len} exceeds the model's "
                              f"max_position_embeddings={model_max_len}")
        max_model_len = model_config.max_model_len or model_max_len
        self.kv_spec = KVCacheSpec(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                                   head_size=shape.head_size,
                                   block_size=self.config.cache.block_size, dtype=self.dtype)
        vocab_size = int(hf_config.vocab_size)
        eos_ids = eos_token_ids(model_config.model, hf_config)
        sampler = SimSampler(vocab_size, eos_ids, device.sim_eos_probability, model_config.seed)
        scheduler = self.config.scheduler
        graph_buckets = (capture_buckets(scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                                         device.max_cuda_graph_tokens,
                                         min(max_model_len, MAX_CAPTURE_SEQ_LEN))
                         if device.enable_cuda_graph else None)
        model = self._sim_model(shape, gpu, device.sim_model, hf_config, graph_buckets,
                                vocab_size)
        self.roofline, self.step_model = model.roofline, model.step_model
        drafter = None
        speculative = scheduler.speculative
        if speculative is not None and speculative.method == "draft_model":
            draft_shape = resolve_model_shape(speculative.model)
            draft_model = self._sim_model(draft_shape, gpu, speculative.model, None,
                                          graph_buckets, vocab_size)
            self.draft_roofline = draft_model.roofline
            drafter = SimDraftProposer(draft_model, self.kv_spec.block_size, self.device,
                                       sampler, device.sim_draft_acceptance)
            self.kv_spec = dataclasses.replace(
                self.kv_spec, num_draft_layers=draft_shape.num_layers,
                draft_num_kv_heads=draft_shape.num_kv_heads, draft_head_size=draft_shape.head_size)
        self.runner = ModelRunner(model, sampler,
                                  vocab_size, self.kv_spec.block_size, max_model_len, self.device,
                                  new_fence=self.timeline.fence, drafter=drafter)
        # the real matchers on the served tokenizer: their host time is real
        self.runner.grammars = GrammarMatchers.for_model(model_config.tokenizer_path, vocab_size,
                                                         eos_ids)
        architecture = resolve_architecture(getattr(hf_config, "architectures", None) or [])
        self.info = WorkerInfo(
            rank=self.rank, device=f"sim:{gpu.name}", dtype=str(self.dtype).removeprefix("torch."),
            architecture=architecture, vocab_size=vocab_size, max_model_len=max_model_len,
            eos_token_ids=eos_ids, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_size, attention_backend="sim")
        logger.info("simulating %s on %s (%s); vocabulary of %s, tokenizer of %s", shape.name,
                    gpu.name, self.info.dtype, model_config.model, model_config.tokenizer_path)
        return self.info

    def _sim_model(self, shape: ModelShape, gpu: GpuSpec, name: str, hf_config: Any,
                   graph_buckets: GraphBuckets | None, vocab_size: int) -> SimModel:
        """The model of `shape` on `gpu`, timed as sim_step_model says; its traced config is the
        preset's or folder's `name`, else hf_config."""
        device = self.config.device
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        roofline = Roofline(shape, gpu, dtype_bytes, device.sim_flops_efficiency,
                            device.sim_bandwidth_efficiency, device.sim_launch_overhead_us * 1e-6)
        step_model = None
        if device.sim_step_model == "kernels":
            ops = traced_ops(sim_hf_config(name) if name else hf_config, self.dtype)
            step_model = StepModel(ops, Roofline(shape, gpu, dtype_bytes),
                                   graph_buckets=graph_buckets)
        return SimModel(step_model, roofline, self.timeline, vocab_size)

    def _profile_memory(self) -> MemoryProfile:
        return sim_memory_profile(self.roofline, self.kv_spec, self.config.cache,
                                  self.config.scheduler, self.draft_roofline)

    def _new_cache_engine(self, num_gpu_blocks: int, num_cpu_blocks: int) -> SimCacheEngine:
        return SimCacheEngine(self.kv_spec, num_gpu_blocks, num_cpu_blocks, self.roofline,
                              self.timeline)
