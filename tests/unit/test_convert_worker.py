"""worker.proto ↔ services/common/step_plan.py: every field of every message survives the wire."""

import dataclasses

import pytest
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
    TokenIdLogprob,
    WorkerInfo,
)
from pagedserve.services.rpc.convert_worker import (
    memory_profile_from_proto,
    memory_profile_to_proto,
    step_output_from_proto,
    step_output_to_proto,
    step_plan_from_proto,
    step_plan_to_proto,
    worker_info_from_proto,
    worker_info_to_proto,
)
from pagedserve.services.rpc.internal.v1 import worker_pb2

BIG = 2**40  # ids and counters beyond 32 bits must survive

SAMPLING = SamplingParams(n=2, best_of=3, temperature=0.7, top_p=0.95, top_k=40, min_p=0.01,
                          presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.15,
                          seed=1234, stop=("END",), stop_token_ids=(2, 5), max_tokens=64,
                          min_tokens=3, logprobs=4, prompt_logprobs=2, ignore_eos=True,
                          include_stop_str_in_output=True, skip_special_tokens=False)

PLAN = StepPlan(
    scheduler_epoch=BIG + 3, step_id=BIG + 17,
    new_seqs=[
        NewSequence(seq_id=BIG + 1, request_id="req-a", token_ids=[1, 2, 3, 49151, 7],
                    prompt_len=4, block_ids=[9, 4], num_computed_tokens=16,
                    num_scheduled_tokens=5, sampling=SAMPLING, seed=-(2**62), num_samples=3,
                    num_lookahead_slots=2),
        NewSequence(seq_id=8, request_id="req-b", token_ids=[5], prompt_len=1, block_ids=[0],
                    num_computed_tokens=0, num_scheduled_tokens=1, sampling=SamplingParams(),
                    pooling_type="mean"),
    ],
    running_seqs=[
        RunningSequence(seq_id=11, new_token_ids=[42, 43], block_ids_start=2, block_ids=[12, 13],
                        num_scheduled_tokens=2, num_samples=4, num_lookahead_slots=1),
        RunningSequence(seq_id=12, new_token_ids=[], block_ids_start=0, block_ids=[],
                        num_scheduled_tokens=1),
    ],
    decode_seq_ids=[BIG + 2, 13], decode_block_ids_start=[3, 0],
    finished_seq_ids=[3, BIG],
    preempted_seq_ids=[5],
    blocks_to_swap_out=[(1, 100), (2, 101)],
    blocks_to_swap_in=[(102, 7)],
    blocks_to_copy=[(8, 9), (8, 10), (3, 4)],
    previous_step_id=BIG + 16,
)

OUTPUT = StepOutput(
    step_id=BIG + 17,
    outputs=[
        SampledSequence(
            seq_id=BIG + 1, token_ids=[17, 4_000_000_000], logprobs=[-0.123456789012345, -7.5],
            top_logprobs=[[TokenIdLogprob(17, -0.123456789012345), TokenIdLogprob(3, -2.0)],
                          [TokenIdLogprob(9, -1e-12)]],
            prompt_logprobs=[[TokenIdLogprob(2, -3.25), TokenIdLogprob(8, -0.5)]]),
        SampledSequence(seq_id=8, token_ids=[], logprobs=[],
                        prompt_logprobs=[[TokenIdLogprob(1, -9.75)]]),
        SampledSequence(seq_id=9, token_ids=[5], logprobs=[-1.0], is_draft_behind=True),
        SampledSequence(seq_id=BIG + 2, token_ids=[4_000_000_001], logprobs=[-0.987654321]),
    ],
    timings=StepTimings(cache_ops_ns=11, prepare_ns=BIG, forward_ns=3_000_000_000, sample_ns=7,
                        swap_out_ns=5, swap_in_ns=6, draft_ns=9, draft_catch_up_ns=10),
    pooled=[PooledSequence(seq_id=BIG + 3, embedding=[0.5, -0.25, 0.0])],
)

INFO = WorkerInfo(rank=3, device="cuda:3", dtype="bfloat16", architecture="LlamaForCausalLM",
                  vocab_size=49152, max_model_len=8192, eos_token_ids=[2, 0], num_layers=30,
                  num_kv_heads=3, head_size=64, attention_backend="triton")

PROFILE = MemoryProfile(num_gpu_blocks=12345, num_cpu_blocks=678, weights_bytes=3 * 2**32,
                        activations_peak_bytes=2**33 + 5, kv_bytes_per_block=2**21)


def _wire(msg):
    """Serialize and parse, as a gRPC call does."""
    return type(msg).FromString(msg.SerializeToString())


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


PACKED: set[str] = set()  # wire fields that are no fields of the dataclass


@pytest.mark.parametrize("cls, message", [
    (StepPlan, worker_pb2.ExecuteStepRequest), (NewSequence, worker_pb2.NewSequence),
    (RunningSequence, worker_pb2.RunningSequence), (StepOutput, worker_pb2.ExecuteStepResponse),
    (SampledSequence, worker_pb2.SampledSequence), (StepTimings, worker_pb2.StepTimings),
    (WorkerInfo, worker_pb2.WorkerInfo), (MemoryProfile, worker_pb2.ProfileMemoryResponse),
])
def test_proto_mirrors_the_dataclass(cls, message):
    assert _field_names(cls) == set(message.DESCRIPTOR.fields_by_name) - PACKED


def test_single_samples_travel_packed():
    output = dataclasses.replace(OUTPUT, sampled_seq_ids=[BIG + 5], sampled_token_ids=[3],
                                 sampled_logprobs=[-0.5])
    msg = _wire(step_output_to_proto(output))
    assert [s.seq_id for s in msg.outputs] == [BIG + 1, 8, 9]  # one that says more, apart
    assert list(msg.sampled_seq_ids) == [BIG + 2, BIG + 5]
    assert list(msg.sampled_token_ids) == [4_000_000_001, 3]
    back = step_output_from_proto(msg)  # and stay packed in the scheduler
    assert [s.seq_id for s in back.outputs] == [BIG + 1, 8, 9]
    assert back.sampled_seq_ids == [BIG + 2, BIG + 5]
    assert back.sampled_by_seq() == {s.seq_id: s for s in [
        *OUTPUT.outputs, SampledSequence(BIG + 5, [3], [-0.5])]}


@pytest.mark.parametrize("convert, field, match", [
    (step_plan_to_proto, "decode_block_ids_start", "one entry per decode_seq_ids entry"),
    (step_output_to_proto, "sampled_logprobs", "equal lengths, got 1, 1 and 0"),
])
def test_packed_lists_of_unequal_lengths_are_refused(convert, field, match):
    msg = convert(PLAN if convert is step_plan_to_proto else OUTPUT)
    getattr(msg, field).pop()
    parse = step_plan_from_proto if convert is step_plan_to_proto else step_output_from_proto
    with pytest.raises(InvalidRequest, match=match):
        parse(msg)


def test_step_plan_round_trip_keeps_every_field():
    # a plain decode that came as a RunningSequence (seq 12) goes as one: the scheduler packs
    assert step_plan_from_proto(_wire(step_plan_to_proto(PLAN))) == PLAN


def test_empty_step_plan_round_trip():
    plan = StepPlan(scheduler_epoch=1, step_id=0)
    assert step_plan_from_proto(_wire(step_plan_to_proto(plan))) == plan


def test_unseeded_sequence_stays_unseeded():
    msg = _wire(step_plan_to_proto(PLAN))
    assert msg.new_seqs[0].HasField("seed") and not msg.new_seqs[1].HasField("seed")
    assert step_plan_from_proto(msg).new_seqs[1].seed is None


def test_block_pairs_travel_as_packed_id_lists():
    msg = step_plan_to_proto(PLAN)
    assert list(msg.blocks_to_copy.src) == [8, 8, 3]
    assert list(msg.blocks_to_copy.dst) == [9, 10, 4]


def test_unpaired_block_ids_are_refused():
    msg = step_plan_to_proto(PLAN)
    msg.blocks_to_copy.dst.pop()
    with pytest.raises(InvalidRequest, match="blocks_to_copy.*3 src and 2 dst"):
        step_plan_from_proto(msg)


def test_invalid_sampling_params_in_a_step_are_refused():
    msg = step_plan_to_proto(PLAN)
    msg.new_seqs[0].sampling.top_p = 1.5
    with pytest.raises(InvalidRequest, match="top_p"):
        step_plan_from_proto(msg)


def test_new_sequences_with_equal_sampling_share_one_converted_params():
    """Converted once per distinct parameters (a cache keyed by the message's bytes), not once
    per sequence; a message that fails its checks is refused every time, never cached."""
    same = dataclasses.replace(SAMPLING)  # equal, another instance
    other = dataclasses.replace(SAMPLING, max_tokens=65)
    new_seqs = [dataclasses.replace(PLAN.new_seqs[0], seq_id=i, sampling=sampling)
                for i, sampling in enumerate((SAMPLING, same, other))]
    first, second = (step_plan_from_proto(_wire(step_plan_to_proto(
        dataclasses.replace(PLAN, new_seqs=new_seqs)))) for _ in range(2))
    assert [s.sampling for s in first.new_seqs] == [SAMPLING, SAMPLING, other]
    assert first.new_seqs[0].sampling is first.new_seqs[1].sampling
    assert first.new_seqs[0].sampling is second.new_seqs[0].sampling
    assert first.new_seqs[2].sampling is not first.new_seqs[0].sampling
    # a large message (here 300 allowed ids) is converted each time: the cache stays small
    large = dataclasses.replace(SAMPLING, allowed_token_ids=tuple(range(1000, 1300)))
    plan = dataclasses.replace(PLAN, new_seqs=[dataclasses.replace(PLAN.new_seqs[0], seq_id=i,
                                                                   sampling=large)
                                               for i in range(2)])
    converted = step_plan_from_proto(_wire(step_plan_to_proto(plan))).new_seqs
    assert converted[0].sampling == converted[1].sampling == large
    assert converted[0].sampling is not converted[1].sampling
    msg = step_plan_to_proto(PLAN)
    msg.new_seqs[0].sampling.top_p = 1.5
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="top_p"):
            step_plan_from_proto(msg)


def test_step_output_round_trip_keeps_every_field():
    # OUTPUT's last sequence sampled a single token: it comes back packed
    single = OUTPUT.outputs[-1]
    packed = dataclasses.replace(OUTPUT, outputs=OUTPUT.outputs[:-1],
                                 sampled_seq_ids=[single.seq_id],
                                 sampled_token_ids=single.token_ids,
                                 sampled_logprobs=single.logprobs)
    assert step_output_from_proto(_wire(step_output_to_proto(OUTPUT))) == packed
    assert step_output_from_proto(_wire(step_output_to_proto(packed))) == packed


def test_worker_info_round_trip_keeps_every_field():
    assert worker_info_from_proto(_wire(worker_info_to_proto(INFO))) == INFO


def test_memory_profile_round_trip_keeps_every_field():
    assert memory_profile_from_proto(_wire(memory_profile_to_proto(PROFILE))) == PROFILE
