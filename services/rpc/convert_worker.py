"""worker.proto ↔ services/common/step_plan.py: the only place they meet. ExecuteStep runs these
once per engine step, so they copy repeated fields wholesale rather than element by element, and
plain decodes and single samples (most of a large batch) travel packed, not one message each."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import (
    MemoryProfile,
    NewSequence,
    PooledSequence,
    RunningSequence,
    SampledSequence,
    StepOutput,
    StepPlan,
    StepTimings,
    WorkerInfo,
)
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.rpc.convert_common import (
    add_logprob_lists,
    fill_structured_outputs,
    logprob_lists_from_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    structured_outputs_from_proto,
)
from pagedserve.services.rpc.internal.v1 import common_pb2, worker_pb2


def block_pairs_to_proto(pairs: Sequence[tuple[int, int]], msg: worker_pb2.BlockPairs) -> None:
    msg.src.extend(src for src, _ in pairs)
    msg.dst.extend(dst for _, dst in pairs)


def block_pairs_from_proto(msg: worker_pb2.BlockPairs, name: str) -> list[tuple[int, int]]:
    """`name` is the field, for the error message when src and dst differ in length."""
    if len(msg.src) != len(msg.dst):
        raise InvalidRequest(
            f"{name} must pair every src with a dst, got {len(msg.src)} src and {len(msg.dst)} dst")
    return list(zip(msg.src, msg.dst, strict=True))


def new_sequence_to_proto(seq: NewSequence) -> worker_pb2.NewSequence:
    msg = worker_pb2.NewSequence(
        seq_id=seq.seq_id, request_id=seq.request_id, token_ids=seq.token_ids,
        prompt_len=seq.prompt_len, block_ids=seq.block_ids,
        num_computed_tokens=seq.num_computed_tokens, num_scheduled_tokens=seq.num_scheduled_tokens,
        sampling=sampling_params_to_proto(seq.sampling), num_samples=seq.num_samples,
        pooling_type=seq.pooling_type, draft_token_ids=seq.draft_token_ids,
        num_lookahead_slots=seq.num_lookahead_slots)
    if seq.seed is not None:
        msg.seed = seq.seed
    return msg


# distinct sampling parameters the worker keeps converted; a workload has few (each request's
# sequences, every request of a client's settings), and the conversion with its checks costs
# ~40 µs against ~1 µs for the key. A larger message (long token lists, a schema) is converted
# each time, so the cache stays under ~1 MB.
MAX_CACHED_SAMPLING_PARAMS = 1024
MAX_CACHED_SAMPLING_BYTES = 512


def _sampling_params(msg: common_pb2.SamplingParams) -> SamplingParams:
    data = msg.SerializeToString(deterministic=True)
    if len(data) > MAX_CACHED_SAMPLING_BYTES:
        return sampling_params_from_proto(msg)
    return _sampling_params_from_bytes(data)


@functools.lru_cache(maxsize=MAX_CACHED_SAMPLING_PARAMS)
def _sampling_params_from_bytes(data: bytes) -> SamplingParams:
    """SamplingParams is frozen, so the sequences with equal parameters share one. A message
    that fails its checks is not cached: it raises again."""
    return sampling_params_from_proto(common_pb2.SamplingParams.FromString(data))


def new_sequence_from_proto(msg: worker_pb2.NewSequence) -> NewSequence:
    return NewSequence(
        seq_id=msg.seq_id, request_id=msg.request_id, token_ids=list(msg.token_ids),
        prompt_len=msg.prompt_len, block_ids=list(msg.block_ids),
        num_computed_tokens=msg.num_computed_tokens, num_scheduled_tokens=msg.num_scheduled_tokens,
        sampling=_sampling_params(msg.sampling),
        seed=msg.seed if msg.HasField("seed") else None, num_samples=msg.num_samples,
        pooling_type=msg.pooling_type, draft_token_ids=list(msg.draft_token_ids),
        num_lookahead_slots=msg.num_lookahead_slots)


def running_sequence_to_proto(seq: RunningSequence) -> worker_pb2.RunningSequence:
    return worker_pb2.RunningSequence(
        seq_id=seq.seq_id, new_token_ids=seq.new_token_ids, block_ids_start=seq.block_ids_start,
        block_ids=seq.block_ids, num_scheduled_tokens=seq.num_scheduled_tokens,
        num_samples=seq.num_samples, draft_token_ids=seq.draft_token_ids,
        num_lookahead_slots=seq.num_lookahead_slots)


def running_sequence_from_proto(msg: worker_pb2.RunningSequence) -> RunningSequence:
    return RunningSequence(
        seq_id=msg.seq_id, new_token_ids=list(msg.new_token_ids),
        block_ids_start=msg.block_ids_start, block_ids=list(msg.block_ids),
        num_scheduled_tokens=msg.num_scheduled_tokens, num_samples=msg.num_samples,
        draft_token_ids=list(msg.draft_token_ids), num_lookahead_slots=msg.num_lookahead_slots)


def step_plan_to_proto(plan: StepPlan) -> worker_pb2.ExecuteStepRequest:
    msg = worker_pb2.ExecuteStepRequest(
        scheduler_epoch=plan.scheduler_epoch, step_id=plan.step_id,
        previous_step_id=plan.previous_step_id,
        new_seqs=[new_sequence_to_proto(s) for s in plan.new_seqs],
        running_seqs=[running_sequence_to_proto(s) for s in plan.running_seqs],
        finished_seq_ids=plan.finished_seq_ids, preempted_seq_ids=plan.preempted_seq_ids,
        decode_seq_ids=plan.decode_seq_ids, decode_block_ids_start=plan.decode_block_ids_start)
    block_pairs_to_proto(plan.blocks_to_swap_out, msg.blocks_to_swap_out)
    block_pairs_to_proto(plan.blocks_to_swap_in, msg.blocks_to_swap_in)
    block_pairs_to_proto(plan.blocks_to_copy, msg.blocks_to_copy)
    return msg


def step_plan_from_proto(msg: worker_pb2.ExecuteStepRequest) -> StepPlan:
    """Plain decodes stay packed: no RunningSequence for each."""
    if len(msg.decode_seq_ids) != len(msg.decode_block_ids_start):
        raise InvalidRequest(
            f"decode_block_ids_start must have one entry per decode_seq_ids entry, got "
            f"{len(msg.decode_block_ids_start)} for {len(msg.decode_seq_ids)}")
    return StepPlan(
        scheduler_epoch=msg.scheduler_epoch, step_id=msg.step_id,
        previous_step_id=msg.previous_step_id,
        new_seqs=[new_sequence_from_proto(s) for s in msg.new_seqs],
        running_seqs=[running_sequence_from_proto(s) for s in msg.running_seqs],
        decode_seq_ids=list(msg.decode_seq_ids),
        decode_block_ids_start=list(msg.decode_block_ids_start),
        finished_seq_ids=list(msg.finished_seq_ids),
        preempted_seq_ids=list(msg.preempted_seq_ids),
        blocks_to_swap_out=block_pairs_from_proto(msg.blocks_to_swap_out, "blocks_to_swap_out"),
        blocks_to_swap_in=block_pairs_from_proto(msg.blocks_to_swap_in, "blocks_to_swap_in"),
        blocks_to_copy=block_pairs_from_proto(msg.blocks_to_copy, "blocks_to_copy"))


def sampled_sequence_to_proto(seq: SampledSequence) -> worker_pb2.SampledSequence:
    msg = worker_pb2.SampledSequence(seq_id=seq.seq_id, token_ids=seq.token_ids,
                                     logprobs=seq.logprobs, is_draft_behind=seq.is_draft_behind)
    add_logprob_lists(msg.top_logprobs, seq.top_logprobs)
    add_logprob_lists(msg.prompt_logprobs, seq.prompt_logprobs)
    return msg


def sampled_sequence_from_proto(msg: worker_pb2.SampledSequence) -> SampledSequence:
    return SampledSequence(
        seq_id=msg.seq_id, token_ids=list(msg.token_ids), logprobs=list(msg.logprobs),
        top_logprobs=logprob_lists_from_proto(msg.top_logprobs),
        prompt_logprobs=logprob_lists_from_proto(msg.prompt_logprobs),
        is_draft_behind=msg.is_draft_behind)


def step_timings_to_proto(timings: StepTimings) -> worker_pb2.StepTimings:
    return worker_pb2.StepTimings(cache_ops_ns=timings.cache_ops_ns, prepare_ns=timings.prepare_ns,
                                  forward_ns=timings.forward_ns, sample_ns=timings.sample_ns,
                                  swap_out_ns=timings.swap_out_ns, swap_in_ns=timings.swap_in_ns,
                                  draft_ns=timings.draft_ns,
                                  draft_catch_up_ns=timings.draft_catch_up_ns,
                                  mask_ns=timings.mask_ns)


def step_timings_from_proto(msg: worker_pb2.StepTimings) -> StepTimings:
    return StepTimings(cache_ops_ns=msg.cache_ops_ns, prepare_ns=msg.prepare_ns,
                       forward_ns=msg.forward_ns, sample_ns=msg.sample_ns,
                       swap_out_ns=msg.swap_out_ns, swap_in_ns=msg.swap_in_ns,
                       draft_ns=msg.draft_ns, draft_catch_up_ns=msg.draft_catch_up_ns,
                       mask_ns=msg.mask_ns)


def _is_single_sample(seq: SampledSequence) -> bool:
    return (len(seq.token_ids) == 1 and len(seq.logprobs) == 1 and not seq.top_logprobs
            and not seq.prompt_logprobs and not seq.is_draft_behind)


def step_output_to_proto(output: StepOutput) -> worker_pb2.ExecuteStepResponse:
    """Single samples go packed (those of `outputs` too), after the other outputs."""
    single: list[SampledSequence] = []
    others: list[SampledSequence] = []
    for s in output.outputs:
        (single if _is_single_sample(s) else others).append(s)
    return worker_pb2.ExecuteStepResponse(
        step_id=output.step_id, outputs=[sampled_sequence_to_proto(s) for s in others],
        timings=step_timings_to_proto(output.timings),
        sampled_seq_ids=[s.seq_id for s in single] + output.sampled_seq_ids,
        sampled_token_ids=[s.token_ids[0] for s in single] + output.sampled_token_ids,
        sampled_logprobs=[s.logprobs[0] for s in single] + output.sampled_logprobs,
        pooled=[worker_pb2.PooledSequence(seq_id=p.seq_id, embedding=p.embedding)
                for p in output.pooled])


def step_output_from_proto(msg: worker_pb2.ExecuteStepResponse) -> StepOutput:
    """Single samples stay packed."""
    seq_ids, token_ids, logprobs = msg.sampled_seq_ids, msg.sampled_token_ids, msg.sampled_logprobs
    if not len(seq_ids) == len(token_ids) == len(logprobs):
        raise InvalidRequest(
            f"sampled_seq_ids, sampled_token_ids and sampled_logprobs must have equal lengths, "
            f"got {len(seq_ids)}, {len(token_ids)} and {len(logprobs)}")
    return StepOutput(step_id=msg.step_id,
                      outputs=[sampled_sequence_from_proto(s) for s in msg.outputs],
                      timings=step_timings_from_proto(msg.timings),
                      pooled=[PooledSequence(p.seq_id, list(p.embedding)) for p in msg.pooled],
                      sampled_seq_ids=list(seq_ids), sampled_token_ids=list(token_ids),
                      sampled_logprobs=list(logprobs))


def worker_info_to_proto(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        rank=info.rank, device=info.device, dtype=info.dtype, architecture=info.architecture,
        vocab_size=info.vocab_size, max_model_len=info.max_model_len,
        eos_token_ids=info.eos_token_ids, num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads, head_size=info.head_size,
        attention_backend=info.attention_backend)


def worker_info_from_proto(msg: worker_pb2.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        rank=msg.rank, device=msg.device, dtype=msg.dtype, architecture=msg.architecture,
        vocab_size=msg.vocab_size, max_model_len=msg.max_model_len,
        eos_token_ids=list(msg.eos_token_ids), num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads, head_size=msg.head_size,
        attention_backend=msg.attention_backend)


def memory_profile_to_proto(profile: MemoryProfile) -> worker_pb2.ProfileMemoryResponse:
    return worker_pb2.ProfileMemoryResponse(
        num_gpu_blocks=profile.num_gpu_blocks, num_cpu_blocks=profile.num_cpu_blocks,
        weights_bytes=profile.weights_bytes, activations_peak_bytes=profile.activations_peak_bytes,
        kv_bytes_per_block=profile.kv_bytes_per_block)


def memory_profile_from_proto(msg: worker_pb2.ProfileMemoryResponse) -> MemoryProfile:
    return MemoryProfile(
        num_gpu_blocks=msg.num_gpu_blocks, num_cpu_blocks=msg.num_cpu_blocks,
        weights_bytes=msg.weights_bytes, activations_peak_bytes=msg.activations_peak_bytes,
        kv_bytes_per_block=msg.kv_bytes_per_block)


def prepare_grammars_to_proto(constraints: Sequence[StructuredOutputsParams]
                              ) -> worker_pb2.PrepareGrammarsRequest:
    msg = worker_pb2.PrepareGrammarsRequest()
    for params in constraints:
        fill_structured_outputs(msg.constraints.add(), params)
    return msg


def prepare_grammars_from_proto(msg: worker_pb2.PrepareGrammarsRequest
                                ) -> list[StructuredOutputsParams]:
    return [structured_outputs_from_proto(c) for c in msg.constraints]
