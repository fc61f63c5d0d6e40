"""Worker, scheduler and gateway over loopback (one process, real gRPC between them) on a tiny
random-weight Llama: what a client of the public API sees."""

import asyncio

import grpc
import pytest
import torch
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.internal.v1 import common_pb2 as internal_common_pb2
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from pagedserve.llm import LLM
from tests.e2e.stack import assert_idle
from tests.e2e.submit_call import SubmitCall
from tests.tiny_models import load_hf

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


def request(prompt, **sampling) -> gateway_pb2.GenerateRequest:
    prompt_field = ({"text": prompt} if isinstance(prompt, str)
                    else {"token_ids": common_pb2.TokenIds(token_ids=prompt)})
    return gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling),
                                       **prompt_field)


def hf_greedy(model_dir, prompt: list[int], num_tokens: int) -> list[int]:
    """Hugging Face's argmax, token by token, EOS included (the requests set ignore_eos)."""
    hf = load_hf(model_dir)
    token_ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = hf(torch.tensor([token_ids])).logits  # [1, num_tokens, vocab]
            token_ids.append(int(logits[0, -1].argmax()))
    return token_ids[len(prompt):]


def test_greedy_equals_hugging_face_and_llm(stack, generation, tiny_served_model_dir):
    prompt = [1, 57, 300, 12, 99, 401, 7]
    response = generation.Generate(request(prompt, temperature=0.0, max_tokens=24,
                                           ignore_eos=True), timeout=60)
    expected = hf_greedy(tiny_served_model_dir, prompt, 24)
    llm = LLM(model=str(tiny_served_model_dir), device="cpu", kv_cache_memory_gib=0.01,
              swap_space_gib=0.01)
    (in_process,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                        ignore_eos=True), use_tqdm=False)
    (output,) = response.outputs
    assert list(output.token_ids) == expected == in_process.outputs[0].token_ids
    assert output.text == in_process.outputs[0].text
    assert output.finish_reason == LENGTH
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == 24


def test_stream_deltas_concatenate_to_the_unary_result(generation):
    kwargs = dict(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, logprobs=2)
    unary = generation.Generate(request("hello world, the quick brown fox", **kwargs),
                                timeout=60)
    deltas = list(generation.GenerateStream(request("hello world, the quick brown fox",
                                                    **kwargs), timeout=60))
    assert len(deltas) > 1
    assert "".join(d.text for d in deltas) == unary.outputs[0].text
    assert [t for d in deltas for t in d.token_ids] == list(unary.outputs[0].token_ids)
    assert [lp.token_id for d in deltas for lp in d.logprobs] == list(unary.outputs[0].token_ids)
    assert deltas[-1].finish_reason == unary.outputs[0].finish_reason != 0
    assert deltas[-1].usage.completion_tokens == len(unary.outputs[0].token_ids)


def test_n2_with_a_seed_is_reproducible(generation):
    def run():
        response = generation.Generate(request("the lazy dog", n=2, temperature=1.0, seed=1234,
                                               max_tokens=12, ignore_eos=True), timeout=60)
        return [list(o.token_ids) for o in sorted(response.outputs, key=lambda o: o.index)]

    first, second = run(), run()
    assert first == second
    assert len(first) == 2 and first[0] != first[1]
    assert all(len(ids) == 12 for ids in first)


def _mixed_requests() -> list[gateway_pb2.GenerateRequest]:
    """32 requests: greedy ones of different lengths, seeded samplers with every knob, n = 2,
    logprobs, stop token ids."""
    requests = []
    for i in range(32):
        prompt = [1 + i, 40 + 3 * i, 7, 200 + i][: 2 + i % 3] * (1 + i % 4)
        kind = i % 4
        if kind == 0:
            requests.append(request(prompt, temperature=0.0, max_tokens=4 + i % 9,
                                    ignore_eos=True))
        elif kind == 1:
            requests.append(request(prompt, temperature=0.7, top_k=40, top_p=0.95, seed=i,
                                    max_tokens=10, presence_penalty=0.5, logprobs=3))
        elif kind == 2:
            requests.append(request(prompt, n=2, temperature=1.0, seed=i, max_tokens=8,
                                    repetition_penalty=1.2, min_tokens=2))
        else:
            requests.append(request(prompt, temperature=0.0, max_tokens=16,
                                    stop_token_ids=[5, 6, 7, 8, 9], ignore_eos=True))
    return requests


def test_32_concurrent_streams_complete_and_free_every_block(stack, generation):
    requests = _mixed_requests()
    # alone, one at a time: what each request gives without batching
    alone = [generation.Generate(r, timeout=60) for r in requests]

    async def stream_all():
        async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)

            async def one(r):
                return [d async for d in stub.GenerateStream(r, timeout=120)]

            return await asyncio.gather(*(one(r) for r in requests))

    streamed = asyncio.run(stream_all())
    for r, solo, deltas in zip(requests, alone, streamed, strict=True):
        n = r.sampling.n if r.sampling.HasField("n") else 1
        by_index = {i: [t for d in deltas if d.index == i for t in d.token_ids] for i in range(n)}
        finish = {d.index: d.finish_reason for d in deltas if d.finish_reason}
        assert sorted(finish) == list(range(n)), deltas
        for output in solo.outputs:
            assert len(by_index[output.index]) <= r.sampling.max_tokens
            if finish[output.index] == LENGTH:
                assert len(by_index[output.index]) == r.sampling.max_tokens
            if r.sampling.temperature == 0.0:  # greedy does not depend on the batch
                assert by_index[output.index] == list(output.token_ids)
                assert finish[output.index] == output.finish_reason
            if r.sampling.stop_token_ids and finish[output.index] == STOP:
                assert by_index[output.index][-1] in r.sampling.stop_token_ids
    assert_idle(stack)


def test_load_right_after_a_request_ends_shows_it_gone(stack, generation):
    # the scheduler refreshes its load snapshot before the last event leaves, even while it
    # drains the step already sent after the request's last one (async scheduling)
    for _ in range(3):
        generation.Generate(request([1, 2, 3], temperature=0.0, max_tokens=32), timeout=60)
        load = stack.load()
        assert (load.num_running_requests, load.num_gpu_blocks_used) == (0, 0), load


def test_cancelling_a_stream_frees_its_blocks(stack, generation):
    call = generation.GenerateStream(request([1, 2, 3, 4], temperature=0.0, max_tokens=480,
                                             ignore_eos=True), timeout=60)
    first = [next(call) for _ in range(3)]
    assert all(d.finish_reason == 0 for d in first)
    assert stack.load().num_gpu_blocks_used > 0
    call.cancel()
    assert_idle(stack)


def test_abort_by_request_id_ends_the_stream_with_abort(stack, generation):
    call = generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
        request_id="abort-me", token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)),
        timeout=60)
    next(call)
    generation.Abort(gateway_pb2.AbortRequest(request_id="abort-me"), timeout=10)
    rest = list(call)
    assert rest[-1].finish_reason == ABORT
    with pytest.raises(grpc.RpcError) as again:  # finished now: unknown to the scheduler
        generation.Abort(gateway_pb2.AbortRequest(request_id="abort-me"), timeout=10)
    assert again.value.code() == grpc.StatusCode.NOT_FOUND
    assert "abort-me" in again.value.details()
    assert_idle(stack)


@pytest.mark.parametrize("bad, field", [
    (request(""), "text"),
    (request([3] * 600), "max_model_len"),
    (request("hello", temperature=-0.5), "temperature"),
    (request("hello", top_p=0.0), "top_p"),
    (request("hello", n=0), "n must"),
    (request("hello", max_tokens=0), "max_tokens"),
    (request("hello", stop_token_ids=[512]), "stop_token_ids"),
    (request("hello", logprobs=21), "logprobs"),
    (request([1, 512]), "token_ids"),
], ids=["empty-prompt", "too-long", "temperature", "top_p", "n", "max_tokens", "stop-token-id",
        "logprobs", "token-id"])
def test_bad_input_is_invalid_argument_and_the_service_keeps_serving(generation, bad, field):
    with pytest.raises(grpc.RpcError) as info:
        generation.Generate(bad, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(generation.GenerateStream(bad, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    good = generation.Generate(request("hello", temperature=0.0, max_tokens=3, ignore_eos=True),
                               timeout=30)
    assert len(good.outputs[0].token_ids) == 3


@pytest.mark.parametrize("prompt, sampling, field", [
    ([], {}, "prompt_token_ids"),
    ([1, 512], {}, "prompt_token_ids"),
    ([1] * 512, {}, "max_model_len"),
    ([1], {"top_p": 0.0}, "top_p"),
    ([1], {"stop_token_ids": [9999]}, "stop_token_ids"),
], ids=["empty", "out-of-vocab", "too-long", "top_p", "stop-token-id"])
def test_scheduler_refuses_bad_submits_with_invalid_argument(stack, prompt, sampling, field):
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(SubmitCall(stub, scheduler_pb2.SubmitRequest(
                request_id="bad", prompt_token_ids=prompt,
                sampling=internal_common_pb2.SamplingParams(**sampling)), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
        events = list(SubmitCall(stub, scheduler_pb2.SubmitRequest(
            request_id="good", prompt_token_ids=[1, 2],
            sampling=internal_common_pb2.SamplingParams(temperature=0.0, max_tokens=2,
                                                        ignore_eos=True)),
            timeout=30))
        assert [t for e in events for o in e.outputs for t in o.token_ids].__len__() == 2
        assert events[-1].outputs[-1].finish_reason == LENGTH


def test_requests_the_replica_could_never_run_are_refused_by_the_gateway(stack, generation):
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        served = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetServedModel(
            scheduler_pb2.GetServedModelRequest(), timeout=10)
    assert served.block_size > 0 and served.num_gpu_blocks > 0 and served.max_num_seqs > 0
    max_tokens = served.max_model_len - 8  # each sequence then holds max_model_len tokens
    blocks_per_seq = -(-served.max_model_len // served.block_size)
    n = min(64, served.num_gpu_blocks // blocks_per_seq + 1)
    assert n * blocks_per_seq > served.num_gpu_blocks  # the tiny cache: 64 full sequences overflow
    too_big = request([1] * 8, n=n, temperature=1.0, max_tokens=max_tokens)
    for bad, words in ((too_big, ["num_gpu_blocks", str(served.num_gpu_blocks)]),
                       (request("hi", n=2**31 - 1, temperature=1.0), ["2147483647"])):
        with pytest.raises(grpc.RpcError) as info:
            list(generation.GenerateStream(bad, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for word in words:
            assert word in info.value.details()
    assert_idle(stack)


def test_malformed_protobuf_is_invalid_argument_on_every_service(stack, generation):
    worker_address = f"127.0.0.1:{stack.worker[0].port}"
    for address, method in ((stack.gateway_address, "/pagedserve.v1.GenerationService/Generate"),
                            (stack.scheduler_address,
                             "/pagedserve.internal.v1.SchedulerService/GetLoad"),
                            (worker_address, "/pagedserve.internal.v1.WorkerService/ExecuteStep")):
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(method)(b"\xff\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (address, method)
    good = generation.Generate(request("hello", temperature=0.0, max_tokens=3, ignore_eos=True),
                               timeout=30)
    assert len(good.outputs[0].token_ids) == 3
