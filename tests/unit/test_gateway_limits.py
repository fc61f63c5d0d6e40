"""Admission by cost and the delta buffer, without gRPC: the Frontend's prepare and the buffer
between the scheduler's stream and a slow client."""

import asyncio
import time

import pytest
from pagedserve.services.common.errors import ConfigError, InvalidRequest
from pagedserve.services.common.outputs import Usage
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.config import RequestLimitsConfig
from pagedserve.services.gateway.delta_buffer import DeltaBuffer
from pagedserve.services.gateway.frontend import MAX_INLINE_PROMPT_TOKENS, Admission, Frontend
from pagedserve.services.gateway.limits import bytes_by_field, num_blocks_at_most
from pagedserve.services.gateway.validation import ChatMessage, GenerateInput, ServedModel
from pagedserve.services.text.text_stream import TextDelta

from tests.unit.tiny_tokenizers import byte_level_bpe

TOKENIZER = byte_level_bpe()
INFO = ServedModel("tiny", "LlamaForCausalLM", 4096, TOKENIZER.vocab_size, (2,), True,
                   block_size=16, num_gpu_blocks=100, max_num_seqs=128)


def prepare(request, limits=None, info=INFO):
    frontend = Frontend(TOKENIZER, None, info, Admission(8), limits=limits)
    return asyncio.run(frontend.prepare(request))


def sampled(**sampling):
    return GenerateInput(text="the quick brown fox", sampling=SamplingParams(**sampling))


def test_huge_n_is_refused_before_any_per_output_work():
    start = time.monotonic()
    with pytest.raises(InvalidRequest) as err:
        prepare(sampled(n=2**31 - 1, temperature=1.0))
    assert time.monotonic() - start < 5.0  # main built n detokenizers first
    assert "n must be at most max_num_seqs_per_request=64, got 2147483647" in str(err.value)


@pytest.mark.parametrize("request_, limits, words", [
    (sampled(n=2, best_of=65, temperature=1.0), {}, ["best_of", "65", "max_num_seqs_per_request=64"]),
    (sampled(n=3, temperature=1.0), {"max_num_seqs_per_request": 2}, ["n", "3", "=2"]),
    (sampled(logprobs=6), {"max_logprobs": 5}, ["logprobs", "6", "max_logprobs=5"]),
    (sampled(prompt_logprobs=6), {"max_logprobs": 5}, ["prompt_logprobs", "6", "max_logprobs=5"]),
    (sampled(stop=[f"s{i}" for i in range(1_000_000)]), {},
     ["stop strings", "1000000", "max_stop_strings=64"]),
    (sampled(stop=["ok", "x" * 257]), {}, ["stop[1]", "257", "max_stop_string_chars=256"]),
    (GenerateInput(messages=(ChatMessage("user", "hi"),) * 3), {"max_chat_messages": 2},
     ["messages", "3", "max_chat_messages=2"]),
    (GenerateInput(text="é" * 600), {"max_request_bytes": 1000},
     ["bytes", "1200", "max_request_bytes=1000"]),
    (GenerateInput(token_ids=(1,) * 300), {"max_request_bytes": 1000},
     ["bytes", "1200", "max_request_bytes=1000"]),
    (sampled(max_tokens=4096), {}, ["max_tokens", "4096", "max_model_len=4096"]),
])
def test_each_limit_names_the_field_the_value_and_the_limit(request_, limits, words):
    with pytest.raises(InvalidRequest) as err:
        prepare(request_, RequestLimitsConfig(**limits))
    for word in words:
        assert word in str(err.value)


def test_the_replicas_max_num_seqs_caps_sequences_below_the_gateway_limit():
    info = ServedModel("tiny", "LlamaForCausalLM", 4096, TOKENIZER.vocab_size, (2,), True,
                       max_num_seqs=4)
    with pytest.raises(InvalidRequest, match="best_of must be at most max_num_seqs=4, got 5"):
        prepare(sampled(n=1, best_of=5, temperature=1.0), info=info)


class CountingExecutor:
    """Runs each call at once, on the caller's thread, and counts them."""

    def __init__(self) -> None:
        self.num_calls = 0

    def submit(self, fn, *args):
        from concurrent.futures import Future

        self.num_calls += 1
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:
            future.set_exception(exc)
        return future


@pytest.mark.parametrize("request_, num_executor_calls", [
    (GenerateInput(token_ids=(5, 6, 7)), 0),  # checked on the event loop
    (GenerateInput(token_ids=(5,) * (MAX_INLINE_PROMPT_TOKENS + 1)), 1),
    (GenerateInput(token_ids=(5, 6, 7), sampling=SamplingParams(bad_words=["fox"])), 1),
    (GenerateInput(text="the quick brown fox"), 1),
])
def test_only_short_token_id_prompts_skip_the_executor(request_, num_executor_calls):
    executor = CountingExecutor()
    info = ServedModel("tiny", "LlamaForCausalLM", 4096, TOKENIZER.vocab_size, (2,), True)
    frontend = Frontend(TOKENIZER, None, info, Admission(8), executor=executor)
    prepared = asyncio.run(frontend.prepare(request_))
    assert executor.num_calls == num_executor_calls
    if request_.token_ids is not None:
        assert prepared.prompt_token_ids == list(request_.token_ids)
    with pytest.raises(InvalidRequest, match="vocab_size"):  # still checked
        asyncio.run(frontend.prepare(GenerateInput(token_ids=(5, 10**9))))


def test_sequences_that_could_never_fit_the_kv_cache_are_refused():
    # 100 blocks of 16 tokens; a 4-token prompt + 200 tokens needs 13 blocks per sequence
    assert prepare(sampled(n=7, temperature=1.0, max_tokens=200)).sampling.n == 7
    with pytest.raises(InvalidRequest) as err:
        prepare(sampled(n=8, temperature=1.0, max_tokens=200))
    assert "need 104 KV-cache blocks" in str(err.value)
    assert "num_gpu_blocks=100" in str(err.value)


def test_num_blocks_at_most_shares_the_prompts_full_blocks():
    sampling = SamplingParams(n=4, temperature=1.0, max_tokens=10)
    # 40 prompt tokens: 2 full blocks shared; each sequence grows to 50 tokens: 4 blocks, 2 own
    assert num_blocks_at_most(40, sampling, 16) == 2 + 4 * 2
    assert num_blocks_at_most(40, SamplingParams(max_tokens=10), 16) == 4


def test_request_bytes_counts_utf8_prompt_messages_stop_strings_and_token_ids():
    assert bytes_by_field(GenerateInput(text="a€"))["text"] == 4
    assert bytes_by_field(GenerateInput(messages=(ChatMessage("user", "hi"),)))["messages"] == 6
    assert bytes_by_field(GenerateInput(token_ids=(1, 2), sampling=SamplingParams(
        stop=("ab",), stop_token_ids=(7,)))) == {"token_ids": 8, "sampling.stop": 2,
                                                 "sampling.stop_token_ids": 4}


def test_a_limit_config_out_of_range_is_refused():
    with pytest.raises(ConfigError, match="max_logprobs must be in \\[0, 20\\], got 21"):
        RequestLimitsConfig(max_logprobs=21)
    with pytest.raises(ConfigError, match="stalled_stream_timeout_s"):
        RequestLimitsConfig(stalled_stream_timeout_s=0)


def test_tokenize_checks_the_cost_too():
    frontend = Frontend(TOKENIZER, None, INFO, Admission(8),
                        limits=RequestLimitsConfig(max_chat_messages=1))
    with pytest.raises(InvalidRequest, match="max_chat_messages=1"):
        asyncio.run(frontend.tokenize(GenerateInput(messages=(ChatMessage("user", "hi"),) * 2)))


# --- the delta buffer -----------------------------------------------------------------------


def test_a_buffer_nobody_reads_stays_bounded_and_loses_nothing():
    async def main():
        buffer = DeltaBuffer(num_outputs=2)
        for i in range(10_000):
            buffer.put(TextDelta(index=i % 2, text=str(i % 10), token_ids=[i],
                                 cumulative_logprob=-i))
            assert len(buffer) <= buffer.max_pending
        buffer.put(TextDelta(index=1, finish_reason="length", usage=Usage(3, 10_000)))
        buffer.close()
        return [d async for d in _drain(buffer)]

    deltas = asyncio.run(main())
    assert len(deltas) <= 64 + 1
    by_index = {0: TextDelta(0), 1: TextDelta(1)}
    for delta in deltas:
        merged = by_index[delta.index]
        merged.text += delta.text
        merged.token_ids += delta.token_ids
    assert by_index[0].token_ids == list(range(0, 10_000, 2))
    assert by_index[1].token_ids == list(range(1, 10_000, 2))
    assert by_index[0].text == "".join(str(i % 10) for i in range(0, 10_000, 2))
    assert deltas[-1].usage == Usage(3, 10_000) and deltas[-1].finish_reason == "length"


async def _drain(buffer):
    while (delta := await buffer.get()) is not None:
        yield delta


def test_a_reader_behind_gets_what_piled_up_for_an_index_in_one_delta():
    async def main():
        buffer = DeltaBuffer(num_outputs=2)
        for index, text in ((0, "a"), (0, "b"), (1, "x"), (0, "c"), (0, "d")):
            buffer.put(TextDelta(index=index, text=text, token_ids=[ord(text)]))
        buffer.close()
        return [d async for d in _drain(buffer)]

    deltas = asyncio.run(main())
    assert [(d.index, d.text, d.token_ids) for d in deltas] == [
        (0, "ab", [97, 98]), (1, "x", [120]), (0, "cd", [99, 100])]


def test_a_buffer_raises_the_streams_error_after_the_pending_deltas():
    async def main():
        buffer = DeltaBuffer(num_outputs=1)
        buffer.put(TextDelta(0, "a"))
        buffer.close(InvalidRequest("boom"))
        first = await buffer.get()
        with pytest.raises(InvalidRequest, match="boom"):
            await buffer.get()
        return first

    assert asyncio.run(main()).text == "a"


def test_wait_stalled_fires_only_when_the_consumer_stays_away_after_a_delta():
    async def main():
        buffer = DeltaBuffer(num_outputs=1)
        stalled = asyncio.create_task(buffer.wait_stalled(1.0))
        buffer.put(TextDelta(0, "unread"))
        await asyncio.sleep(1.2)
        assert not stalled.done()  # nobody took a delta yet: no consumer to be stalled
        for i in range(5):  # a consumer that keeps coming back is not stalled
            assert (await buffer.get()).text in ("unread", str(i - 1))
            buffer.put(TextDelta(0, str(i)))
            await asyncio.sleep(0.05)
        assert (await buffer.get()).text == "4"
        getting = asyncio.create_task(buffer.get())  # waiting for output is not stalling
        await asyncio.sleep(1.2)
        assert not stalled.done()
        buffer.put(TextDelta(0, "taken, then never back"))
        assert (await getting).text == "taken, then never back"
        await asyncio.wait_for(stalled, 10)

    asyncio.run(main())


def test_a_stream_interval_holds_deltas_until_they_carry_that_many_tokens():
    async def main():
        buffer = DeltaBuffer(num_outputs=1, stream_interval=3)
        taken = []

        async def consume():
            async for delta in _drain(buffer):
                taken.append((delta.text, delta.finish_reason))

        consumer = asyncio.create_task(consume())
        for i, text in enumerate("abcdefgh"):
            buffer.put(TextDelta(0, text, token_ids=[i]))
            await asyncio.sleep(0)  # the consumer takes whatever it was woken for
        buffer.put(TextDelta(0, "", finish_reason="stop"))
        buffer.close()
        await consumer
        return taken

    # the first token at once, then a message per 3 tokens, the end at once with what is left
    assert asyncio.run(main()) == [("a", None), ("bcd", None), ("efg", None), ("h", "stop")]


def test_a_stream_interval_sends_each_outputs_first_token_and_errors_at_once():
    async def main():
        buffer = DeltaBuffer(num_outputs=2, stream_interval=8)
        buffer.put(TextDelta(0, "a", token_ids=[1]))
        first = await asyncio.wait_for(buffer.get(), 1)
        buffer.put(TextDelta(1, "x", token_ids=[2]))
        second = await asyncio.wait_for(buffer.get(), 1)
        buffer.put(TextDelta(0, "b", token_ids=[3]))
        held = asyncio.create_task(buffer.get())
        await asyncio.sleep(0.05)
        assert not held.done()
        buffer.put(TextDelta(0, "", error="worker lost"))
        return first, second, await asyncio.wait_for(held, 1)

    first, second, third = asyncio.run(main())
    assert (first.index, first.text, second.index, second.text) == (0, "a", 1, "x")
    assert (third.text, third.error) == ("b", "worker lost")


def test_stream_interval_is_checked_against_backpressure():
    assert RequestLimitsConfig(stream_interval=16).stream_interval == 16
    assert RequestLimitsConfig(stream_interval=64, max_unread_stream_tokens=0).stream_interval == 64
    with pytest.raises(ConfigError, match="stream_interval must be at most "
                                          "max_unread_stream_tokens \\(16\\).*got 17"):
        RequestLimitsConfig(stream_interval=17)
    with pytest.raises(ConfigError, match="stream_interval must be >= 1, got 0"):
        RequestLimitsConfig(stream_interval=0)
