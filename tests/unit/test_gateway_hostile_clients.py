"""Hostile and clumsy clients against the gateway over real gRPC (fake scheduler behind it): they
get a clear status and hurt only themselves."""

import asyncio
import logging
import threading
import time

import grpc
import pytest
from pagedserve.services.gateway.config import RequestLimitsConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pagedserve.services.text.tokenizer import Tokenizer

from tests.unit.test_gateway_servicer import collect, harness, read_rest, request
from tests.unit.tiny_tokenizers import byte_level_bpe


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    byte_level_bpe().hf_tokenizer.save_pretrained(path)
    return str(path)


def run(model_dir, body, timeout_s=30, **kw):
    async def main():
        async with harness(model_dir, **kw) as h:
            return await asyncio.wait_for(body(h), timeout_s)

    return asyncio.run(main())


async def refused(call):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    return err.value


def test_huge_n_is_answered_with_invalid_argument_fast(model_dir):
    async def body(h):
        start = time.monotonic()
        err = await refused(h.generation.GenerateStream(request(n=2**31 - 1, temperature=1.0),
                                                        timeout=10))
        return err, time.monotonic() - start, h.fake.submits

    err, elapsed, submits = run(model_dir, body)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2147483647" in err.details() and "max_num_seqs_per_request" in err.details()
    assert elapsed < 5.0 and submits == []


@pytest.mark.parametrize("max_request_bytes, code, words", [
    (None, grpc.StatusCode.RESOURCE_EXHAUSTED, [str(4 << 20)]),  # 8.9 MB: over the default
    (16 << 20, grpc.StatusCode.INVALID_ARGUMENT, ["max_stop_strings=64", "1000000"]),
])
def test_a_million_stop_strings_are_refused_at_the_gateway(model_dir, max_request_bytes, code,
                                                           words):
    async def body(h):
        stop = [f"s{i}" for i in range(1_000_000)]
        err = await refused(h.generation.GenerateStream(request(stop=stop), timeout=30))
        return err, h.fake.submits

    limits = RequestLimitsConfig(max_request_bytes=max_request_bytes or 4 << 20)
    err, submits = run(model_dir, body, limits=limits)
    assert err.code() == code
    for word in words:
        assert word in err.details()
    assert submits == []


def test_a_request_over_max_request_bytes_is_refused_by_grpc(model_dir):
    async def body(h):
        big = gateway_pb2.GenerateStreamRequest(text="x" * 300_000)
        return await refused(h.generation.GenerateStream(big, timeout=10)), h.fake.submits

    err, submits = run(model_dir, body, limits=RequestLimitsConfig(max_request_bytes=100_000))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "100000" in err.details()  # gRPC names the limit: "larger than max (... vs. 100000)"
    assert submits == []


def test_sequences_that_never_fit_the_replicas_cache_are_refused_up_front(model_dir):
    async def body(h):
        too_many = await refused(h.generation.GenerateStream(
            request(n=4, temperature=1.0, max_tokens=40), timeout=10))
        fits = await collect(h.generation.GenerateStream(
            request(n=2, temperature=1.0, max_tokens=40), timeout=10))
        return too_many, fits

    # blocks of 16 tokens: a 4-token prompt + 40 tokens needs 3 blocks a sequence
    too_many, fits = run(model_dir, body, max_model_len=4096, capacity=(16, 8, 256))
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_gpu_blocks=8" in too_many.details() and "12 KV-cache blocks" in too_many.details()
    assert fits[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def test_stop_token_ids_are_counted_before_the_sampling_parameters_scan_them(model_dir,
                                                                         monkeypatch):
    from pagedserve.services.gateway import convert

    def unreachable(msg):
        raise AssertionError("converted before the stop lists were bounded")

    monkeypatch.setattr(convert, "sampling_params_from_proto", unreachable)

    async def body(h):
        return await refused(h.generation.GenerateStream(
            request(stop_token_ids=[5] * 1025), timeout=10)), h.fake.submits

    err, submits = run(model_dir, body)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_stop_token_ids=1024" in err.details() and "1025" in err.details()
    assert submits == []


@pytest.mark.parametrize("request_id, words", [
    ("r1\nINFO forged scheduler line", ["printable", "'r1\\nINFO forged scheduler line'"]),
    ("r\x00", ["printable"]),
    ("r" * 257, ["at most 256 characters", "257"]),
])
def test_a_request_id_that_could_forge_a_log_line_is_refused(model_dir, request_id, words):
    async def body(h):
        generate = gateway_pb2.GenerateStreamRequest(request_id=request_id, text="the fox")
        refusals = [await refused(h.generation.GenerateStream(generate, timeout=10))]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.generation.Abort(gateway_pb2.AbortRequest(request_id=request_id), timeout=10)
        return [*refusals, err.value], h.fake.submits

    errors, submits = run(model_dir, body)
    for err in errors:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in err.details()
        for word in words:
            assert word in err.details()
    assert submits == []


def test_tokenize_goes_through_admission(model_dir):
    async def body(h):
        h.fake.hang = True
        live = h.generation.GenerateStream(request(max_tokens=4), timeout=30)
        await live.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.generation.Tokenize(gateway_pb2.TokenizeRequest(text="the fox"), timeout=10)
        live.cancel()
        return err.value

    err = run(model_dir, body, max_concurrent_requests=1)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_requests" in err.details()


@pytest.mark.parametrize("field", ["text", "messages"])
def test_text_that_cannot_fit_max_model_len_is_refused_before_tokenizing(model_dir, monkeypatch,
                                                                      field):
    """Tokenizing costs hundreds of bytes a token: 3 MB of text would cost the gateway ~600 MB
    only to learn it is too long."""
    encoded = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, *a, **k: encoded.append(text))
    monkeypatch.setattr(Tokenizer, "apply_chat_template", lambda self, m, *a, **k: encoded.append(m))
    text = "the fox " * 400_000
    prompt = {"text": text} if field == "text" else {"messages": common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="user", content=text)])}

    async def body(h):
        return await refused(h.generation.GenerateStream(
            gateway_pb2.GenerateStreamRequest(**prompt), timeout=10))

    err = run(model_dir, body)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "characters" in err.details() and "3200000" in err.details()
    assert not [e for e in encoded if len(e) > 1000]


# --- malformed wire data ----------------------------------------------------------------------

GARBAGE = [b"\xff\xff\xff\xff", b"\x12\x05ab",  # not protobuf; a string cut short
           gateway_pb2.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"\xff\xfe")]


@pytest.mark.parametrize("payload", GARBAGE, ids=["garbage", "truncated", "bad-utf8"])
def test_malformed_protobuf_is_invalid_argument_without_a_logged_traceback(model_dir, payload,
                                                                          caplog):
    async def body(h):
        unary = h.channel.unary_unary("/pagedserve.v1.GenerationService/Generate")
        streaming = h.channel.unary_stream("/pagedserve.v1.GenerationService/GenerateStream")
        errors = []
        for call in (unary(payload, timeout=5), streaming(payload, timeout=5)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call if isinstance(call, grpc.aio.UnaryUnaryCall) else await collect(call)
            errors.append(err.value)
        scheduler = grpc.aio.insecure_channel(h.fake_address)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                pause = scheduler.unary_unary("/pagedserve.internal.v1.SchedulerService/Pause")
                await pause(payload, timeout=5)
            errors.append(err.value)
        finally:
            await scheduler.close()
        ok = await collect(h.generation.GenerateStream(request(max_tokens=3), timeout=5))
        # what the requests logged: the harness's teardown may race its own server stop
        return errors, ok, list(caplog.records)

    with caplog.at_level(logging.WARNING):
        errors, ok, records = run(model_dir, body)
    for err in errors:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in err.details()
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info]
    assert ok[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


# --- tokenization off the event loop ----------------------------------------------------------


def test_a_small_request_is_served_while_a_large_prompt_tokenizes(model_dir, monkeypatch):
    """The large prompt's tokenization blocks (an event the test sets) until the small request
    is done: on the event loop that would be a deadlock."""
    small_done = threading.Event()
    encode = Tokenizer.encode

    def slow_encode(self, text, add_special_tokens=True):
        if len(text) > 100_000:
            small_done.wait(20)
        return encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", slow_encode)

    async def body(h):
        large = asyncio.ensure_future(collect(h.generation.GenerateStream(
            gateway_pb2.GenerateStreamRequest(request_id="large", text="the fox " * 50_000,
                                        sampling=common_pb2.SamplingParams(max_tokens=4)),
            timeout=30)))
        await asyncio.sleep(0.2)
        small = await collect(h.generation.GenerateStream(request(max_tokens=3), timeout=30))
        was_large_pending = not large.done()
        small_done.set()
        return small, was_large_pending, await large

    small, was_large_pending, large = run(model_dir, body, max_model_len=1_000_000)
    assert small[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert was_large_pending
    assert large[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_generation_is_served_while_tokenize_calls_fill_their_threads(model_dir, monkeypatch):
    """Big Tokenize calls block (until the test lets them go) in every thread they may use: a
    Generate's prompt is still tokenized, in the gateway's other threads."""
    generated = threading.Event()
    encode = Tokenizer.encode

    def slow_encode(self, text, add_special_tokens=True):
        if len(text) > 100_000:
            generated.wait(20)
        return encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", slow_encode)

    async def body(h):
        big = gateway_pb2.TokenizeRequest(text="the fox " * 13_000)
        tokenizing = [asyncio.ensure_future(h.generation.Tokenize(big, timeout=30))
                      for _ in range(3)]
        await asyncio.sleep(0.2)
        small = await collect(h.generation.GenerateStream(request(max_tokens=3), timeout=30))
        were_tokenizing = not any(t.done() for t in tokenizing)
        generated.set()
        return small, were_tokenizing, await asyncio.gather(*tokenizing)

    small, were_tokenizing, tokenized = run(model_dir, body, max_model_len=1_000_000)
    assert small[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert were_tokenizing
    assert all(len(t.token_ids) > 13_000 for t in tokenized)


# --- slow consumers ---------------------------------------------------------------------------


def test_stalled_streams_are_aborted_and_do_not_hold_back_other_clients(model_dir):
    """20 clients that never read (their receive windows fill up) and one that does: the normal
    client completes, every stalled request is cancelled in the scheduler after the timeout and
    its handler ends without the client's help; a client that reads again learns why."""
    num_stalled = 20

    async def body(h):
        h.fake.hang = True
        h.fake.num_reply_tokens = 4_000
        h.fake.tokens_per_event = 20  # 200 events: past the buffer's bound, so they coalesce
        # a receive window of ~1 KB: the first responses fill it (gRPC's default grows to MBs)
        small_window = grpc.aio.insecure_channel(f"127.0.0.1:{h.gateway.port}", options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
        stalled = [gateway_pb2_grpc.GenerationServiceStub(small_window).GenerateStream(
            gateway_pb2.GenerateStreamRequest(request_id=f"stalled-{i}", text="the fox",
                                        sampling=common_pb2.SamplingParams(max_tokens=50_000)),
            timeout=60) for i in range(num_stalled)]
        while len(h.fake.submits) < num_stalled:
            await asyncio.sleep(0.05)
        h.fake.hang = False
        h.fake.num_reply_tokens = None
        h.fake.tokens_per_event = 1
        normal = await collect(h.generation.GenerateStream(request(max_tokens=40), timeout=30))
        while len(h.fake.cancelled) < num_stalled:
            await asyncio.wait_for(h.fake.any_cancelled.wait(), 30)
            h.fake.any_cancelled.clear()
        await asyncio.wait_for(h.gateway.admission.wait_idle(), 30)  # every handler ended
        ends = []
        for call in stalled:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_rest(call)
            ends.append(err.value)
        await small_window.close()
        return normal, set(h.fake.cancelled), ends

    normal, cancelled, ends = run(model_dir, body, max_model_len=100_000, max_concurrent_requests=32,
                                  limits=RequestLimitsConfig(stalled_stream_timeout_s=1.0))
    assert "".join(r.text for r in normal).startswith("hello")
    assert normal[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert cancelled == {f"stalled-{i}" for i in range(num_stalled)}
    for err in ends:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stalled_stream_timeout_s=1" in err.details()
