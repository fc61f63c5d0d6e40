"""Runs one engine step: cache ops, mirror deltas, the flattened forward, sampling."""

from __future__ import annotations

import dataclasses
import logging
import time
from itertools import pairwise

import torch
from pagedserve.kernels.cdiv import cdiv
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import SampledSequence, StepOutput, StepPlan, StepTimings
from pagedserve.worker_svc.cache_engine import CacheEngine
from pagedserve.worker_svc.cuda_graphs import DecodeGraphs
from pagedserve.worker_svc.model_input import ModelInput, build_model_input
from pagedserve.worker_svc.parallel import SINGLE, TensorParallel
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState, prompt_logprobs
from pagedserve.worker_svc.sequence_mirrors import CachedSequence, SequenceMirrors
from torch import nn

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: nn.Module, sampler: Sampler, vocab_size: int, block_size: int,
                 max_model_len: int, device: torch.device, tp: TensorParallel = SINGLE) -> None:
        self.model = model
        self.tp = tp
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.mirrors = SequenceMirrors(block_size, max_model_len)
        self.decode_graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def execute_step(self, plan: StepPlan, cache_engine: CacheEngine) -> StepOutput:
        clock = _PhaseClock(self.device)
        cache_engine.swap_out(plan.blocks_to_swap_out)
        cache_engine.swap_in(plan.blocks_to_swap_in)
        cache_engine.copy(plan.blocks_to_copy)
        clock.mark()
        scheduled = self.mirrors.apply(plan)
        if not scheduled:
            clock.mark()
            # no result comes to the host, so no sync to read events after: host times
            cache_ops_ns, prepare_ns = clock.host_phases_ns()
            return StepOutput(step_id=plan.step_id, timings=StepTimings(
                cache_ops_ns=cache_ops_ns, prepare_ns=prepare_ns))
        model_input = build_model_input(scheduled, self.block_size, self.device)
        clock.mark()
        logits = self._forward(model_input, cache_engine.gpu_cache)
        clock.mark()
        outputs = self._sample(model_input, logits)  # the sampled ids on the host: synced
        self.mirrors.advance(scheduled, outputs)
        clock.mark()
        cache_ops_ns, prepare_ns, forward_ns, sample_ns = clock.phases_ns()
        return StepOutput(step_id=plan.step_id, outputs=outputs, timings=StepTimings(
            cache_ops_ns=cache_ops_ns, prepare_ns=prepare_ns, forward_ns=forward_ns,
            sample_ns=sample_ns))

    def _forward(self, model_input: ModelInput,
                 kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
        """[num_logits_rows, vocab] float32 on tensor-parallel rank 0, which samples; None on
        the others."""
        graphs = self.decode_graphs
        batch_size = graphs.batch_size_for(model_input, kv_caches) if graphs else None
        if batch_size is None:
            hidden_states = self.model(model_input.input_ids, model_input.positions, kv_caches,
                                       model_input.meta)  # [num_tokens, hidden]
        else:
            hidden_states = graphs.replay(model_input, batch_size)  # [num_tokens, hidden]
        return self.model.compute_logits(hidden_states[model_input.logits_indices])

    def _sample(self, model_input: ModelInput,
                logits: torch.Tensor | None) -> list[SampledSequence]:
        sample_seqs = model_input.sample_seqs
        if logits is None:  # a tensor-parallel rank > 0: rank 0's tokens
            return self.tp.broadcast_samples([], [s.seq_id for s in sample_seqs], self.device)
        states = [SeqSamplingState(seq_id=s.seq_id, sampling=s.sampling, token_ids=s.token_ids,
                                   prompt_len=s.prompt_len, seed=s.seed,
                                   num_samples=s.num_samples) for s in sample_seqs]
        sampled = self.tp.broadcast_samples(self.sampler(logits[:len(sample_seqs)], states),
                                            [s.seq_id for s in sample_seqs], self.device)
        if not model_input.prompt_logprob_spans:
            return sampled
        by_seq = {s.seq_id: s for s in sampled}
        for span in model_input.prompt_logprob_spans:
            rows = logits[span.start:span.start + len(span.target_ids)]
            entries = prompt_logprobs(rows, span.target_ids, span.seq.sampling.prompt_logprobs,
                                      self.vocab_size)
            seq_id = span.seq.seq_id
            if seq_id in by_seq:
                by_seq[seq_id] = dataclasses.replace(by_seq[seq_id], prompt_logprobs=entries)
            else:
                by_seq[seq_id] = SampledSequence(seq_id=seq_id, token_ids=[], logprobs=[],
                                                 prompt_logprobs=entries)
        return list(by_seq.values())

    @torch.inference_mode()
    def dummy_run(self, query_lens: list[int], kv_caches: list[torch.Tensor]) -> None:
        """Prompts of these lengths, block after block: the memory profile and the warm-up."""
        seqs, next_block = [], 0
        for i, query_len in enumerate(query_lens):
            num_blocks = cdiv(query_len, self.block_size)
            seqs.append(CachedSequence(
                seq_id=i, request_id="dummy", token_ids=[0] * query_len, prompt_len=query_len,
                block_table=list(range(next_block, next_block + num_blocks)),
                num_computed_tokens=0, sampling=SamplingParams(temperature=0.0), seed=None,
                num_samples=1, num_scheduled_tokens=query_len))
            next_block += num_blocks
        seqs.sort(key=lambda s: not s.is_prefill)
        self._forward(build_model_input(seqs, self.block_size, self.device), kv_caches)
        if self.device.type == "cuda":  # the profile and the warm-up measure the finished work
            torch.cuda.synchronize(self.device)


class _PhaseClock:
    """On CUDA the phase boundaries are stream events, read once the sampled ids are on the host
    (that copy waited for them all), so timing adds no sync. Host clocks serve CPU devices and
    steps that never wait for the device."""

    def __init__(self, device: torch.device) -> None:
        self._host_ns: list[int] = []
        self._events: list[torch.cuda.Event] | None = [] if device.type == "cuda" else None
        self.mark()

    def mark(self) -> None:
        self._host_ns.append(time.perf_counter_ns())
        if self._events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)

    def host_phases_ns(self) -> list[int]:
        return [end - start for start, end in pairwise(self._host_ns)]

    def phases_ns(self) -> list[int]:
        if self._events is None:
            return self.host_phases_ns()
        self._events[-1].synchronize()  # recorded after that copy: the stream is idle already
        return [round(start.elapsed_time(end) * 1e6) for start, end in pairwise(self._events)]


def dummy_num_blocks(query_lens: list[int], block_size: int) -> int:
    return sum(cdiv(n, block_size) for n in query_lens)
