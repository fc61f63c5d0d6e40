"""The worker core: one model replica on one device, driven by the scheduler one call at a time
(directly, or through the gRPC servicer, which wraps these methods 1:1).

Lifecycle: load_model → profile_memory → init_cache → warm_up → execute_step per engine step.
A restarted scheduler takes a live worker over by repeating the handshake: the memory profile is
the one taken before the first cache, and a cache of the same sizes is kept (init_cache).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
import weakref
from concurrent.futures import Future
from types import ModuleType

import torch
from pagedserve.kernels.backend import get_backend, resolve_backend_name
from pagedserve.services.common.config import EngineConfig
from pagedserve.services.common.errors import (
    ConfigError,
    InvalidRequest,
    StaleEpoch,
    Unavailable,
)
from pagedserve.services.common.step_plan import MemoryProfile, StepOutput, StepPlan, WorkerInfo
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.worker_svc.cache_engine import (
    CacheEngine,
    KVCacheSpec,
    allocate_kv_caches,
    check_cache_ops,
)
from pagedserve.worker_svc.cuda_graphs import CAPTURABLE_BACKENDS, MAX_CAPTURE_SEQ_LEN
from pagedserve.worker_svc.draft_proposer import load_draft_proposer
from pagedserve.worker_svc.grammar_matchers import GrammarMatchers
from pagedserve.worker_svc.graph_buckets import GraphBuckets, capture_buckets
from pagedserve.worker_svc.in_flight import InFlightStep
from pagedserve.worker_svc.launch_window import LaunchWindow
from pagedserve.worker_svc.layers.attention import Attention
from pagedserve.worker_svc.loader import eos_token_ids, load_hf_config, load_model
from pagedserve.worker_svc.memory import non_torch_bytes, profile_memory
from pagedserve.worker_svc.mixed_graphs import MIXED_CAPTURABLE_BACKENDS, capture_graphs
from pagedserve.worker_svc.model_runner import ModelRunner, dummy_num_blocks
from pagedserve.worker_svc.model_thread import ModelThread
from pagedserve.worker_svc.models.registry import resolve_architecture
from pagedserve.worker_svc.parallel import SINGLE, init_tensor_parallel
from pagedserve.worker_svc.sampler import Sampler

logger = logging.getLogger(__name__)

# how far a scheduler's clock may run ahead of its workers' (they share a node or a pod)
MAX_EPOCH_LEAD_S = 60.0

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """"cuda": the GPU of this tensor-parallel rank when the process sees several (ranks on
    one machine), else the current one (a pod that sees its own GPU only)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "sim":  # the simulated GPU's host side: the worker's small tensors live on CPU
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' but CUDA is not available")
        count = torch.cuda.device_count()
        return torch.device("cuda", rank % count if count > 1 else torch.cuda.current_device())
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def check_epoch_not_ahead(scheduler_epoch: int) -> None:
    """A handshake's epoch is its scheduler's start time: one far ahead of this worker's clock
    would lock out every scheduler started before that time."""
    lead_s = (scheduler_epoch - time.time_ns() // 1000) / 1e6
    if lead_s > MAX_EPOCH_LEAD_S:
        raise InvalidRequest(
            f"scheduler_epoch={scheduler_epoch} lies {lead_s:.0f} s ahead of this worker's clock; "
            f"an epoch is its scheduler's start time in microseconds since the Unix epoch, at "
            f"most {MAX_EPOCH_LEAD_S:.0f} s ahead", field="scheduler_epoch")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.device.device, rank)
        if self.device.type == "cuda":  # for this (the model) thread: NCCL and graph capture
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.backend_name = resolve_backend_name(config.device.attention_backend, self.device)
        if config.device.num_threads > 0:
            torch.set_num_threads(config.device.num_threads)
        self.scheduler_epoch = 0
        self.steps = LaunchWindow()
        self.model_thread: ModelThread | None = None  # submit_step's
        self._close_thread: weakref.finalize | None = None  # ends it (close, or the worker goes)
        self.info: WorkerInfo | None = None
        self.runner: ModelRunner | None = None
        self.cache_engine: CacheEngine | None = None
        self.kv_spec: KVCacheSpec | None = None
        self.backend: ModuleType | None = None  # the kernel module
        # taken once, before any KV cache existed: a later profile would count the cache as used
        self._memory_profile: MemoryProfile | None = None
        self._non_torch_baseline = 0  # non_torch_bytes before the model was loaded (CUDA)
        self.tp = SINGLE

    def load_model(self) -> WorkerInfo:
        model_config = self.config.model
        hf_config = load_hf_config(model_config.model)
        architecture = resolve_architecture(getattr(hf_config, "architectures", None) or [])
        model_max_len = int(hf_config.max_position_embeddings)
        if model_config.max_model_len > model_max_len:
            raise ConfigError(f"max_model_len={model_config.max_model_len} exceeds the model's "
                              f"max_position_embeddings={model_max_len}")
        max_model_len = model_config.max_model_len or model_max_len
        if self.device.type == "cuda":
            self._non_torch_baseline = non_torch_bytes(self.device)
        self.backend = get_backend(self.backend_name, self.device)
        parallel = self.config.parallel
        self.tp = init_tensor_parallel(self.rank, parallel.tensor_parallel_size,
                                       parallel.distributed_init_address, self.device,
                                       parallel.distributed_timeout_s)
        model = load_model(model_config, hf_config, self.dtype, self.device, backend=self.backend,
                           max_position=max_model_len, tp=self.tp)
        attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_spec = KVCacheSpec(num_layers=len(attn_layers),
                                   num_kv_heads=attn_layers[0].num_kv_heads,
                                   head_size=attn_layers[0].head_size,
                                   block_size=self.config.cache.block_size, dtype=self.dtype)
        vocab_size = int(hf_config.vocab_size)
        eos_ids = eos_token_ids(model_config.model, hf_config)
        speculative = self.config.scheduler.speculative
        sampler = Sampler(vocab_size, eos_ids, self.device, model_config.seed)
        drafter = None
        if speculative is not None and speculative.method == "draft_model":
            drafter, self.kv_spec = load_draft_proposer(
                speculative.model, model_config, self.kv_spec, vocab_size, self.device,
                self.backend, max_model_len, parallel.tensor_parallel_size, sampler)
        self.runner = ModelRunner(model, sampler, vocab_size,
                                  self.kv_spec.block_size, max_model_len, self.device, self.tp,
                                  drafter=drafter)
        if self.rank == 0:  # the rank that samples
            self.runner.grammars = GrammarMatchers.for_model(model_config.tokenizer_path,
                                                             vocab_size, eos_ids)
        self.info = WorkerInfo(
            rank=self.rank, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            architecture=architecture, vocab_size=vocab_size, max_model_len=max_model_len,
            eos_token_ids=eos_ids, num_layers=self.kv_spec.num_layers,
            num_kv_heads=self.kv_spec.num_kv_heads, head_size=self.kv_spec.head_size,
            attention_backend=self.backend_name)
        logger.info("loaded %s from %s on %s (%s, %s backend)", architecture, model_config.model,
                    self.device, self.info.dtype, self.backend_name)
        return self.info

    def get_info(self) -> WorkerInfo:
        if self.info is None:
            raise Unavailable("worker has no model loaded yet (call load_model)")
        return self.info

    def profile_memory(self) -> MemoryProfile:
        """How many blocks fit; measured on the first call, the same answer after (a scheduler
        that takes the worker over asks again while the cache is allocated)."""
        self._runner()
        if self._memory_profile is None:
            self._memory_profile = self._profile_memory()
        return self._memory_profile

    def _profile_memory(self) -> MemoryProfile:
        runner = self._runner()
        return profile_memory(runner, runner.model, self.kv_spec, self.config.cache,
                              self.config.scheduler, self.get_info().max_model_len, self.device,
                              self._graph_buckets(), self._non_torch_baseline)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, scheduler_epoch: int) -> bool:
        """The end of a scheduler's handshake: serve `scheduler_epoch` from now on, with empty
        mirrors and the KV cache allocated already if it has these sizes (a restarted scheduler
        taking the worker over: its block manager starts with every block free, so the old
        contents are never read), else a new one. True if kept."""
        runner = self._runner()
        if num_gpu_blocks < 1 or num_cpu_blocks < 0:
            raise InvalidRequest(f"num_gpu_blocks must be >= 1 and num_cpu_blocks >= 0, got "
                                 f"{num_gpu_blocks} and {num_cpu_blocks}")
        check_epoch_not_ahead(scheduler_epoch)
        self.check_epoch(scheduler_epoch, "init_cache", is_handshake=True)
        cache = self.cache_engine
        is_kept = (cache is not None and cache.num_gpu_blocks == num_gpu_blocks
                   and cache.num_cpu_blocks == num_cpu_blocks)
        if not is_kept:
            runner.drop_graphs()  # warm_up captures new ones
            self.cache_engine = None
            gc.collect()
            self.cache_engine = self._new_cache_engine(num_gpu_blocks, num_cpu_blocks)
        self.scheduler_epoch = scheduler_epoch
        self._reset_steps()
        return is_kept

    def warm_up(self, batch_sizes: list[int] | None = None) -> int:
        """Returns the number of CUDA graphs captured, none above the default largest size: the
        memory profile reserved for those."""
        runner = self._runner()
        for query_lens, context_lens in self._warm_up_batches():
            kv_caches = allocate_kv_caches(
                self.kv_spec, dummy_num_blocks(query_lens, self.kv_spec.block_size, context_lens),
                self.device)
            runner.dummy_run(query_lens, kv_caches, context_lens)
            del kv_caches
        default = self._graph_buckets()
        if default is None:
            return 0
        sizes = sorted(set(batch_sizes)) if batch_sizes else default.batch_sizes
        if not 1 <= sizes[0] <= sizes[-1] <= default.batch_sizes[-1]:
            raise InvalidRequest(f"batch_sizes must lie in [1, {default.batch_sizes[-1]}], got "
                                 f"{batch_sizes}")
        buckets = dataclasses.replace(default, batch_sizes=sizes)
        cache_engine = self._cache_engine()
        drafter = runner.drafter
        num_graphs = (len(sizes) + len(buckets.num_tokens)) * (1 if drafter is None else 2)
        if runner.decode_graphs is not None and runner.decode_graphs.batch_sizes == sizes:
            return num_graphs  # captured on this very cache (init_cache kept it)
        runner.drop_graphs()
        runner.decode_graphs, runner.mixed_graphs = capture_graphs(
            runner.model, buckets, self.kv_spec.block_size, cache_engine.gpu_cache, self.device)
        if drafter is not None:
            drafter.capture_graphs(buckets, cache_engine.draft_gpu_cache)
        return num_graphs

    def execute_step(self, plan: StepPlan) -> StepOutput:
        """Run one StepPlan (the protocol is in services/common/step_plan.py), strictly in
        `previous_step_id` order.

        A step with a bad block id, token id or delta is refused before it touches the KV cache
        or the mirror. A step that raises later may leave the mirror half-updated, so the steps
        after it are refused until clear_state (the KV blocks stay valid).
        """
        step = self.launch_step(plan)
        self.sample_step(step)
        return self.finish_step(step)

    def launch_step(self, plan: StepPlan, ahead_of: InFlightStep | None = None) -> InFlightStep:
        """execute_step in three calls; `ahead_of`: the step in flight
        (LaunchWindow.can_launch_ahead)."""
        self.check_step(plan)
        self.steps.check_order(plan)
        runner, cache_engine = self._runner(), self._cache_engine()
        check_cache_ops(plan.blocks_to_swap_out, plan.blocks_to_swap_in, plan.blocks_to_copy,
                        cache_engine.num_gpu_blocks, cache_engine.num_cpu_blocks)
        runner.mirrors.check(plan, cache_engine.num_gpu_blocks, runner.vocab_size)
        self.steps.last_step_id = plan.step_id
        with self.steps.failing():
            return runner.launch(plan, cache_engine, ahead_of)

    def sample_step(self, step: InFlightStep) -> None:
        with self.steps.failing():
            self._runner().sample(step)

    def finish_step(self, step: InFlightStep) -> StepOutput:
        with self.steps.failing():
            return self._runner().finish(step)

    def check_step(self, plan: StepPlan) -> None:
        self._runner()
        self._cache_engine()
        self.check_epoch(plan.scheduler_epoch, f"step {plan.step_id}")

    def submit_step(self, plan: StepPlan) -> Future[StepOutput]:
        """Steps submitted in order run in order, while the caller schedules the next."""
        if self.model_thread is None:
            self.model_thread = ModelThread("worker-step", functools.partial(
                _init_step_thread, self.config.device.num_threads, self.device))
            # the thread must not outlive the worker, nor the interpreter's last moments: a
            # daemon thread still inside torch at exit aborts the process
            self._close_thread = weakref.finalize(self, self.model_thread.shutdown, True)
        return self.model_thread.submit_step(self, plan)

    def close(self) -> None:
        """Ends the model thread after the steps submitted, and lets go of the model, the KV
        cache and the CUDA graphs, giving the device memory back. Idempotent; a closed worker
        needs load_model again."""
        if self.model_thread is not None:
            self._close_thread()
            self.model_thread = None
        if self.runner is not None:
            self.runner.drop_graphs()
            if self.runner.grammars is not None:
                self.runner.grammars.shutdown()
        self.cache_engine = self.runner = self.info = self._memory_profile = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def prepare_grammars(self, constraints: list[StructuredOutputsParams]) -> Future[None]:
        """Done once each constraint is compiled into the grammar cache (or failed to): the
        scheduler admits a constrained request then, so its first mask finds it compiled. A rank
        that does not sample, or holds no model, has nothing to compile."""
        grammars = None if self.runner is None else self.runner.grammars
        if grammars is None:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return grammars.compiled(constraints)

    def clear_state(self, scheduler_epoch: int) -> None:
        """Forget every sequence; the KV blocks stay. Unavailable without a KV cache: a worker
        that restarted has lost the blocks the scheduler counts on."""
        self._runner()
        self._cache_engine()
        self.check_epoch(scheduler_epoch, "clear_state")
        self._reset_steps()

    @property
    def bytes_per_kv_block(self) -> int:
        return self._cache_engine().spec.bytes_per_block

    def read_kv_blocks(self, block_ids: list[int]) -> bytes:
        """For another worker's pull (prefill/decode disaggregation)."""
        return self._cache_engine().read_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: bytes) -> None:
        self._cache_engine().write_blocks(block_ids, data)
        drafter = self._runner().drafter
        if drafter is not None:  # the sender's draft layers may not hold these tokens' KV
            drafter.blocks.overwrite(block_ids)

    def check_epoch(self, scheduler_epoch: int, what: str, is_handshake: bool = False) -> None:
        """The worker serves only the scheduler whose handshake set its epoch; a later one (a
        larger epoch) takes over by doing the handshake. The message leaves out the worker's
        epoch, so a caller cannot learn it to pass as the scheduler."""
        if scheduler_epoch == self.scheduler_epoch or (
                is_handshake and scheduler_epoch > self.scheduler_epoch):
            return
        raise StaleEpoch(f"{what} has scheduler_epoch={scheduler_epoch}, not the epoch of the "
                         "scheduler this worker serves; a newer scheduler takes the worker over "
                         "with the handshake (InitCache)")

    def _reset_steps(self) -> None:
        self.steps.reset()
        self._runner().mirrors.clear()

    def _new_cache_engine(self, num_gpu_blocks: int, num_cpu_blocks: int) -> CacheEngine:
        return CacheEngine(self.kv_spec, num_gpu_blocks, num_cpu_blocks, self.device,
                           self.backend)

    def _warm_up_batches(self) -> list[tuple[list[int], list[int]]]:
        """(query lens, context lens) of the eager warm-up steps: a prompt beside a one-token
        one, and on CUDA the backend's steps that compile each of its kernel variants (so no
        step compiles one mid-serving; kernels/triton_ops.py)."""
        max_model_len = self.get_info().max_model_len
        batches = [([min(8, max_model_len), 1], [0, 0])]
        backend_batches = getattr(self.backend, "warm_up_batches", None)
        if self.device.type == "cuda" and backend_batches is not None:
            batches += backend_batches(max_model_len)
        return batches

    def _graph_buckets(self) -> GraphBuckets | None:
        """None under tensor parallelism (the all-reduces run eagerly) or with a backend whose
        kernels size their launches by each step's real lengths."""
        device = self.config.device
        if self.device.type != "cuda" or not device.enable_cuda_graph or self.tp.size > 1:
            return None
        if self.backend_name not in CAPTURABLE_BACKENDS:
            logger.info("no CUDA graphs with the %s attention backend (capturable: %s)",
                        self.backend_name, ", ".join(CAPTURABLE_BACKENDS))
            return None
        scheduler = self.config.scheduler
        max_mixed_tokens = (device.max_cuda_graph_tokens
                            if self.backend_name in MIXED_CAPTURABLE_BACKENDS else 0)
        return capture_buckets(scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                               max_mixed_tokens,
                               min(self.get_info().max_model_len, MAX_CAPTURE_SEQ_LEN))

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise Unavailable("worker has no model loaded yet (call load_model)")
        return self.runner

    def _cache_engine(self) -> CacheEngine:
        if self.cache_engine is None:
            raise Unavailable("worker has no KV cache yet (call init_cache)")
        return self.cache_engine


def _init_step_thread(num_threads: int, device: torch.device) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def create_worker(config: EngineConfig, rank: int = 0) -> Worker:
    """"sim": the same core with the model, sampler and KV cache modelled."""
    if config.device.device == "sim":
        from pagedserve.worker_svc.sim.worker import SimWorker

        return SimWorker(config, rank)
    return Worker(config, rank)
