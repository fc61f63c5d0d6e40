"""Runs one engine step: cache ops, mirror deltas, the flattened forward, sampling, in three
calls (launch, sample, finish) so that a step can be launched while the one before is in flight
(worker_svc/in_flight.py)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from pagedserve.services.common.cdiv import cdiv
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import SampledSequence, StepOutput, StepPlan, StepTimings
from pagedserve.worker_svc.cache_engine import CacheEngine
from pagedserve.worker_svc.cuda_graphs import DecodeGraphs
from pagedserve.worker_svc.draft_proposer import DraftProposer
from pagedserve.worker_svc.grammar_matchers import GrammarMatchers
from pagedserve.worker_svc.in_flight import (
    DraftTimes,
    Fence,
    InFlightStep,
    PhaseClock,
    device_fence,
    split_swaps,
)
from pagedserve.worker_svc.mixed_graphs import MixedGraphs, replay_forward
from pagedserve.worker_svc.model_input import ModelInput, build_model_input
from pagedserve.worker_svc.parallel import SINGLE, TensorParallel
from pagedserve.worker_svc.pooler import pool, pooled_to_host
from pagedserve.worker_svc.sampler import HostSamples, Sampler, prompt_logprobs
from pagedserve.worker_svc.sequence_mirrors import CachedSequence, SequenceMirrors
from pagedserve.worker_svc.spec_decode import launch_samples
from torch import nn

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: nn.Module, sampler: Sampler, vocab_size: int, block_size: int,
                 max_model_len: int, device: torch.device, tp: TensorParallel = SINGLE,
                 new_fence: Callable[[], Fence] | None = None,
                 drafter: DraftProposer | None = None) -> None:
        """new_fence: the work queued on the device so far (default: device_fence); drafter:
        speculative decoding's draft model."""
        self.model = model
        self.tp = tp
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.mirrors = SequenceMirrors(block_size, max_model_len)
        self.drafter = drafter
        self.mirrors.draft_blocks = None if drafter is None else drafter.blocks
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.grammars: GrammarMatchers | None = None  # None: structured outputs unconstrained
        self._new_fence = new_fence

    def execute_step(self, plan: StepPlan, cache_engine: CacheEngine) -> StepOutput:
        step = self.launch(plan, cache_engine)
        self.sample(step)
        return self.finish(step)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, cache_engine: CacheEngine,
               ahead_of: InFlightStep | None = None) -> InFlightStep:
        """Cache ops, the mirror's deltas, the inputs and the forward, queued on the device.
        `ahead_of`: the step still in flight, whose draws are the last tokens of this step's
        sequences that it sampled; they reach the inputs on the device (the host has not read
        them yet); the swaps that touch none of its blocks overlap it (split_swaps). Then
        sample(), then finish()."""
        clock = PhaseClock(self.device)
        early, late = split_swaps(plan.blocks_to_swap_out, plan.blocks_to_swap_in, ahead_of)
        early_s = (cache_engine.swap_out(early.out, wait_for_compute=False),
                   cache_engine.swap_in(early.into, wait_for_compute=False))
        late_out_s = cache_engine.swap_out(late.out)
        clock.mark(on_device=bool(late.out))
        late_in_s = cache_engine.swap_in(late.into)
        clock.mark(on_device=bool(late.into))
        modelled_swap_s = (_total_s(early_s[0], late_out_s), _total_s(early_s[1], late_in_s))
        cache_engine.copy(plan.blocks_to_copy)
        clock.mark(on_device=bool(plan.blocks_to_copy))
        if self.drafter is not None:
            blocks = self.drafter.blocks
            blocks.swap_out(plan.blocks_to_swap_out)
            blocks.swap_in(plan.blocks_to_swap_in)
            blocks.copy(plan.blocks_to_copy)
        scheduled = self.mirrors.apply(plan, is_checked=True)
        if self.grammars is not None:
            self.grammars.prepare(plan.new_seqs)
        if not scheduled:
            clock.mark()
            return InFlightStep(plan.step_id, clock, scheduled, modelled_swap_s=modelled_swap_s,
                                blocks_to_copy=plan.blocks_to_copy)
        drafting = DraftTimes()
        if self.drafter is not None:
            self.drafter.blocks.target_writes(scheduled)
            drafting = self._propose(scheduled, cache_engine)
        drawn = ahead_of.draws_by_seq() if ahead_of is not None else {}
        model_input = build_model_input(scheduled, self.block_size, self.device, drawn,
                                        self.mirrors.block_rows)
        if model_input.drawn_rows:
            model_input.take_draws(ahead_of.samples.token_ids)
        self.mirrors.mark_computed(scheduled)
        clock.mark()
        logits, pooled = self._forward(model_input, cache_engine.gpu_cache)
        clock.mark()
        return InFlightStep(plan.step_id, clock, scheduled, model_input=model_input, logits=logits,
                            pooled=pooled, modelled_swap_s=modelled_swap_s,
                            blocks_to_copy=plan.blocks_to_copy, drafting=drafting)

    def _propose(self, scheduled: list[CachedSequence], cache_engine: CacheEngine
                 ) -> DraftTimes:
        """The draft model's catch-up and proposals. The proposer reads its drafts on the host,
        so its host time holds its device time; the catch-up is waited for, to be timed apart
        (a sync in the steps that catch up only); a modelled device gives its own times."""
        kv_caches = cache_engine.draft_gpu_cache
        start = time.perf_counter_ns()
        behind = self.drafter.catch_up(scheduled, kv_caches)
        catch_up_ns = 0
        if behind is not None:
            fence = self.new_fence()
            fence.wait()
            catch_up_ns = _device_ns(fence, time.perf_counter_ns() - start)
        proposed_at = time.perf_counter_ns()
        draft_ns = 0
        if self.drafter.propose(scheduled, kv_caches):
            draft_ns = _device_ns(self.new_fence(), time.perf_counter_ns() - proposed_at)
        return DraftTimes(time.perf_counter_ns() - start, draft_ns, catch_up_ns,
                          frozenset(behind or ()))

    def drop_graphs(self) -> None:
        """The target's and the draft model's CUDA graphs: they read the KV cache they were
        captured on."""
        self.decode_graphs = self.mixed_graphs = None
        if self.drafter is not None:
            self.drafter.graphs = self.drafter.mixed_graphs = None

    @torch.inference_mode()
    def sample(self, step: InFlightStep) -> None:
        """Queues the draws; the sequences' histories must hold every earlier step's tokens."""
        if step.model_input is None:
            return
        step.clock.mark()  # the step before may have been finished since the launch
        if step.logits is not None:  # tensor-parallel rank 0
            sample_seqs = step.model_input.sample_seqs
            bitmask = None
            if self.grammars is not None:
                start = time.perf_counter_ns()
                bitmask = self.grammars.bitmask(sample_seqs, self.mirrors.seqs,
                                                self.mirrors.drawing)
                step.mask_ns = time.perf_counter_ns() - start if bitmask is not None else 0
            step.samples = launch_samples(self.sampler, step.logits, sample_seqs, bitmask)
        step.clock.mark()
        step.fence = self.new_fence()

    @torch.inference_mode()
    def finish(self, step: InFlightStep) -> StepOutput:
        """Waits for the step's draws and appends them to the mirror."""
        if step.model_input is None:
            # no result comes to the host, so no sync to read events after: host times
            swap_out_ns, swap_in_ns, copy_ns, prepare_ns = step.clock.host_phases_ns()
            return StepOutput(step_id=step.step_id, timings=_cache_op_timings(
                step, swap_out_ns, swap_in_ns, copy_ns, prepare_ns=prepare_ns))
        step.fence.wait()
        samples = self._sampled(step)
        behind = step.drafting.behind_seq_ids
        if behind:
            outputs = [dataclasses.replace(out, is_draft_behind=True) if out.seq_id in behind
                       else out for out in samples.outputs]
            samples = samples._replace(outputs=outputs)
        self.mirrors.append_drawn(step.scheduled, samples.outputs, samples.seq_ids,
                                  samples.token_ids)
        if self.grammars is not None and step.samples is not None and self.runs_apart:
            self.grammars.mask_ahead(step.model_input.sample_seqs)
        step.clock.mark(on_device=False)
        (swap_out_ns, swap_in_ns, copy_ns, prepare_ns, launch_ns, _, sample_ns,
         wait_ns) = step.clock.phases_ns()
        forward_ns = launch_ns + wait_ns
        if step.fence.device_s is not None:  # a modelled device: its time, not the host's
            forward_ns = round(step.fence.device_s * 1e9)
        return StepOutput(step_id=step.step_id, outputs=samples.outputs, timings=_cache_op_timings(
            step, swap_out_ns, swap_in_ns, copy_ns,
            prepare_ns=max(0, prepare_ns - step.drafting.host_ns), forward_ns=forward_ns,
            sample_ns=sample_ns, draft_ns=step.drafting.draft_ns,
            draft_catch_up_ns=step.drafting.catch_up_ns, mask_ns=step.mask_ns),
            pooled=pooled_to_host(step.pooled), sampled_seq_ids=samples.seq_ids,
            sampled_token_ids=samples.token_ids, sampled_logprobs=samples.logprobs)

    def new_fence(self) -> Fence:
        return self._new_fence() if self._new_fence is not None else device_fence(self.device)

    @property
    def runs_apart(self) -> bool:
        """Whether the device works while the host goes on: then launching a step before the
        one in flight finishes overlaps the two (one tensor-parallel rank: the others wait for
        rank 0's draws in a collective)."""
        return (self._new_fence is not None or self.device.type == "cuda") and self.tp.size == 1

    def _forward(self, model_input: ModelInput, kv_caches: list[torch.Tensor]
                 ) -> tuple[torch.Tensor | None, list[tuple[int, torch.Tensor]]]:
        """[num_logits_rows, vocab] float32 on tensor-parallel rank 0, which samples; None on
        the others. Then the embeddings of the pooling sequences whose prompt is done."""
        hidden_states = replay_forward(model_input, kv_caches, self.decode_graphs,
                                       self.mixed_graphs)  # [num_tokens, hidden]
        if hidden_states is None:
            hidden_states = self.model(model_input.input_ids, model_input.positions, kv_caches,
                                       model_input.meta)
        pooled = pool(hidden_states, model_input.pool_spans)
        if not model_input.is_every_row_a_logits_row:
            hidden_states = hidden_states[model_input.logits_indices]
        return self.model.compute_logits(hidden_states), pooled

    def _sampled(self, step: InFlightStep) -> HostSamples:
        """Single samples packed, where nothing is added to them (a sequence's drafts behind its
        draft model are marked by finish)."""
        model_input = step.model_input
        if (step.samples is not None and self.tp.size == 1
                and not model_input.prompt_logprob_spans and not step.drafting.behind_seq_ids):
            return step.samples.host_samples()
        return HostSamples(self._sampled_seqs(step), [], [], [])

    def _sampled_seqs(self, step: InFlightStep) -> list[SampledSequence]:
        model_input = step.model_input
        seq_ids = [s.seq_id for s in model_input.sample_seqs]
        if step.samples is None:  # a tensor-parallel rank > 0: rank 0's tokens
            return self.tp.broadcast_samples([], seq_ids, self.device)
        sampled = self.tp.broadcast_samples(step.samples.result(), seq_ids, self.device)
        if not model_input.prompt_logprob_spans:
            return sampled
        by_seq = {s.seq_id: s for s in sampled}
        for span in model_input.prompt_logprob_spans:
            rows = step.logits[span.start:span.start + len(span.target_ids)]
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
    def dummy_run(self, query_lens: list[int], kv_caches: list[torch.Tensor],
                  context_lens: list[int] | None = None) -> None:
        """Prompts of these lengths, block after block, each after its context_lens tokens
        (none by default) already cached: the memory profile and the warm-up."""
        seqs, next_block = [], 0
        for i, (query_len, context_len) in enumerate(
                zip(query_lens, context_lens or [0] * len(query_lens), strict=True)):
            seq_len = context_len + query_len
            num_blocks = cdiv(seq_len, self.block_size)
            seqs.append(CachedSequence(
                seq_id=i, request_id="dummy", token_ids=[0] * seq_len, prompt_len=seq_len,
                block_table=list(range(next_block, next_block + num_blocks)),
                num_computed_tokens=context_len, sampling=SamplingParams(temperature=0.0),
                seed=None, num_samples=1, num_scheduled_tokens=query_len))
            next_block += num_blocks
        seqs.sort(key=lambda s: not s.is_prefill)
        self._forward(build_model_input(seqs, self.block_size, self.device), kv_caches)
        if self.device.type == "cuda":  # the profile and the warm-up measure the finished work
            torch.cuda.synchronize(self.device)


def _total_s(*modelled_s: float | None) -> float | None:
    """Modelled swap seconds added up; None where the cache returns none (the clock times it)."""
    if all(s is None for s in modelled_s):
        return None
    return sum(s or 0.0 for s in modelled_s)


def dummy_num_blocks(query_lens: list[int], block_size: int,
                     context_lens: list[int] | None = None) -> int:
    contexts = context_lens or [0] * len(query_lens)
    return sum(cdiv(c + q, block_size) for q, c in zip(query_lens, contexts, strict=True))


def _device_ns(fence: Fence, host_ns: int) -> int:
    """The device's time for the work before the fence: measured by the host that waited for it,
    or a modelled device's own."""
    return host_ns if fence.device_s is None else round(fence.device_s * 1e9)


def _cache_op_timings(step: InFlightStep, swap_out_ns: int, swap_in_ns: int, copy_ns: int,
                      **phases_ns: int) -> StepTimings:
    """A simulated cache's swaps take their modelled time, not the host's."""
    modelled_out_s, modelled_in_s = step.modelled_swap_s
    if modelled_out_s is not None:
        swap_out_ns = round(modelled_out_s * 1e9)
    if modelled_in_s is not None:
        swap_in_ns = round(modelled_in_s * 1e9)
    return StepTimings(cache_ops_ns=swap_out_ns + swap_in_ns + copy_ns, swap_out_ns=swap_out_ns,
                       swap_in_ns=swap_in_ns, **phases_ns)
