"""The OpenAI door's cost check, in process (the FastAPI app over a Frontend with no replica
behind it: every request here is refused, or answered, before one would be needed): a request's
cost is bounded by the gRPC door's limits before anything per output, per prompt or per token is
built, and refusals are 400s or 429s naming the field and the value."""

import asyncio
import threading
import tracemalloc

import httpx
import pytest
from pagedserve.services.gateway.config import RequestLimitsConfig
from pagedserve.services.gateway.frontend import Admission, Frontend
from pagedserve.services.gateway.openai.routes import build_app
from pagedserve.services.gateway.openai.serving import OpenAIServing
from pagedserve.services.gateway.validation import ServedModel

from tests.unit.tiny_tokenizers import byte_level_bpe

TOKENIZER = byte_level_bpe()
INFO = ServedModel("tiny", "LlamaForCausalLM", 256, TOKENIZER.vocab_size, (2,), True)
CHAR_LIMIT = 2 * INFO.max_model_len * TOKENIZER.max_token_chars


class CountingTokenizer:
    """The test tokenizer, counting decodes."""

    def __init__(self) -> None:
        self.num_decodes = 0

    def __getattr__(self, name):
        return getattr(TOKENIZER, name)

    def decode(self, token_ids, skip_special_tokens=True):
        self.num_decodes += 1
        return TOKENIZER.decode(token_ids, skip_special_tokens)


def post(path, body, max_concurrent_requests=8, limits=None, frontend=None):
    frontend = frontend or Frontend(TOKENIZER, None, INFO, Admission(max_concurrent_requests),
                                    limits=limits)
    app = build_app(OpenAIServing(frontend, "tiny"))

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.post(path, json=body, timeout=30)

    return asyncio.run(main())


def refused(response, status, param, *words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_huge_n_is_refused_before_anything_is_built_per_output(path, body):
    tracemalloc.start()
    try:
        response = post(path, {**body, "n": 10**6, "temperature": 1.0})
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    refused(response, 400, "n", "n must be at most max_num_seqs_per_request=64, got 1000000")
    assert peak_bytes < 4 << 20  # main built a choice per output first: 8 bytes and up each


def test_a_prompt_list_counts_every_prompts_sequences_against_the_per_request_limit():
    response = post("/v1/completions", {"prompt": ["hi"] * 1024, "n": 64, "temperature": 1.0})
    refused(response, 400, "prompt", "1024 prompts x best_of=64", "max_num_seqs_per_request=64",
            "got 65536")
    refused(post("/v1/completions", {"prompt": [[5, 6]] * 65}), 400, "prompt", "got 65")


def test_a_prompt_list_is_admitted_as_that_many_requests_or_not_at_all():
    response = post("/v1/completions", {"prompt": ["a", "b", "c"]}, max_concurrent_requests=2)
    error = refused(response, 429, None, "3 asked", "max_concurrent_requests) is 2")
    assert error["code"] == "RATE_LIMITED"


def test_the_prompts_of_a_list_share_one_request_byte_limit():
    limits = RequestLimitsConfig(max_request_bytes=1000)
    assert post("/tokenize", {"prompt": "x" * 600}, limits=limits).status_code == 200
    refused(post("/v1/completions", {"prompt": ["x" * 600, "y" * 600]}, limits=limits), 400,
            "prompt", "max_request_bytes=1000", "got 1200")


def test_token_id_lists_count_against_the_byte_limit_before_their_ids_are_scanned():
    limits = RequestLimitsConfig(max_request_bytes=1000)
    prompt = [[5] * 200, [6] * 200, ["not an id"] * 200]  # 600 ids: 2400 bytes
    refused(post("/v1/completions", {"prompt": prompt}, limits=limits), 400, "prompt",
            "max_request_bytes=1000", "got 2400")


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_stop_token_ids_are_counted_before_they_are_scanned(path, extra):
    response = post(path, {**extra, "stop_token_ids": [5] * 1025})
    refused(response, 400, "stop_token_ids", "max_stop_token_ids=1024", "got 1025")


def test_token_ids_to_echo_are_bounded_and_checked_before_they_are_decoded():
    tokenizer = CountingTokenizer()
    frontend = Frontend(tokenizer, None, INFO, Admission(8))
    too_many = list(range(3, 3 + INFO.max_model_len)) * 20
    refused(post("/v1/completions", {"prompt": too_many, "echo": True}, frontend=frontend),
            400, "prompt", "max_model_len=256", f"got {len(too_many)}")
    refused(post("/v1/completions", {"prompt": [5, 10**20], "echo": True}, frontend=frontend),
            400, "prompt[1]", "vocab_size", str(10**20))
    assert tokenizer.num_decodes == 0


def test_a_priority_out_of_the_int32_range_is_a_400_naming_it():
    response = post("/v1/completions", {"prompt": "hi", "priority": 2**40})
    error = refused(response, 400, "priority", str(2**40))
    assert "ValueError" not in error["message"]


def test_tokenize_without_special_tokens_keeps_the_prompt_limits():
    body = {"prompt": "a" * (CHAR_LIMIT + 1), "add_special_tokens": False}
    refused(post("/tokenize", body), 400, "prompt", f"got {CHAR_LIMIT + 1}")
    small = post("/tokenize", {"prompt": "the fox", "add_special_tokens": False})
    assert small.json()["tokens"] == TOKENIZER.encode("the fox", add_special_tokens=False)


def test_tokenize_and_detokenize_go_through_admission():
    frontend = Frontend(TOKENIZER, None, INFO, Admission(1))
    with frontend.admission.admit():
        for path, body in (("/tokenize", {"prompt": "the fox"}), ("/detokenize", {"tokens": [5]})):
            refused(post(path, body, frontend=frontend), 429, None, "max_concurrent_requests")


def test_detokenize_is_bounded_by_max_model_len_before_it_decodes():
    tokenizer = CountingTokenizer()
    frontend = Frontend(tokenizer, None, INFO, Admission(8))
    tokens = [5] * (10 * INFO.max_model_len)
    refused(post("/detokenize", {"tokens": tokens}, frontend=frontend), 400, "tokens",
            "max_model_len=256", f"got {len(tokens)}")
    refused(post("/detokenize", {"tokens": [5, 10**20]}, frontend=frontend), 400, "tokens[1]",
            str(10**20))
    assert tokenizer.num_decodes == 0
    ok = post("/detokenize", {"tokens": TOKENIZER.encode("the fox", add_special_tokens=False)},
              frontend=frontend)
    assert ok.json()["prompt"] == "the fox" and tokenizer.num_decodes == 1


def test_tokenize_work_never_queues_ahead_of_a_generation_prompt():
    """The tokenize endpoints' thread busy (a big prompt, say) and calls queued behind it: a
    generation's prompt is still tokenized, in its own threads."""
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()
    tokenize_pool = ThreadPoolExecutor(1)
    generate_pool = ThreadPoolExecutor(1)
    frontend = Frontend(TOKENIZER, None, INFO, Admission(16), executor=generate_pool,
                        tokenize_executor=tokenize_pool)
    tokenize_pool.submit(release.wait)

    async def main():
        from pagedserve.services.gateway.validation import GenerateInput

        queued = [asyncio.create_task(frontend.tokenize(GenerateInput(text="the fox")))
                  for _ in range(8)]
        prepared = await asyncio.wait_for(frontend.prepare(GenerateInput(text="the fox")), 10)
        assert not any(t.done() for t in queued)
        release.set()
        return prepared, await asyncio.gather(*queued)

    try:
        prepared, tokenized = asyncio.run(main())
    finally:
        release.set()
        tokenize_pool.shutdown()
        generate_pool.shutdown()
    assert prepared.prompt_token_ids == tokenized[0]


def test_an_unexpected_error_answers_500_without_naming_internals():
    frontend = Frontend(TOKENIZER, None, INFO, Admission(8))

    async def broken(request, add_special_tokens=True):
        raise OverflowError("int too big to convert")

    frontend.tokenize = broken
    response = post("/tokenize", {"prompt": "the fox"}, frontend=frontend)
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert "OverflowError" not in message and "int too big" not in message


def test_a_body_of_millions_of_stop_token_ids_is_refused_before_it_is_parsed():
    """16 MB of stop_token_ids once stalled the event loop 1.28 s in the JSON parser: the default
    body limit (the gRPC door's 4 MiB) refuses it by its length."""
    ids = ",".join(["12345"] * (16_000_000 // 6))
    body = f'{{"prompt": "hi", "stop_token_ids": [{ids}]}}'.encode()
    frontend = Frontend(TOKENIZER, None, INFO, Admission(8))
    app = build_app(OpenAIServing(frontend, "tiny"))

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.post("/v1/completions", content=body, timeout=30,
                                     headers={"content-type": "application/json"})

    response = asyncio.run(main())
    assert response.status_code == 413, response.text
    assert "at most 4194304 bytes, got 16000033" in response.json()["error"]["message"]
