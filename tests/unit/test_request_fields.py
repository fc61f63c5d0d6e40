"""vLLM's request fields through the gateway, at both doors, against a test double of the
scheduler: each one reaches the scheduler as the sampler applies it (bias, allowed ids, bad words
as token ids, the prompt truncated), or is refused naming it."""

import asyncio

import grpc
import pytest
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2

from tests.unit.test_gateway_rich_errors import rich
from tests.unit.test_gateway_servicer import collect, harness
from tests.unit.tiny_tokenizers import byte_level_bpe

TOKENIZER = byte_level_bpe()
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    TOKENIZER.hf_tokenizer.save_pretrained(path)
    return str(path)


def run(model_dir, body):
    async def main():
        async with harness(model_dir) as h:
            return await asyncio.wait_for(body(h), 20)

    return asyncio.run(main())


def grpc_request(**sampling):
    return gateway_pb2.GenerateStreamRequest(text=PROMPT, sampling=common_pb2.SamplingParams(
        max_tokens=4, **sampling))


def test_grpc_token_constraints_reach_the_scheduler_once_as_ids(model_dir):
    async def body(h):
        await collect(h.generation.GenerateStream(grpc_request(
            logit_bias={5: 3.5, 7: -100.0}, allowed_token_ids=[5, 7, 9], bad_words=["fox"],
            truncate_prompt_tokens=2), timeout=10))
        return h.fake.submits[0]

    submit = run(model_dir, body)
    sampling = submit.sampling
    assert dict(sampling.logit_bias) == {5: 3.5, 7: -100.0}
    assert list(sampling.allowed_token_ids) == [5, 7, 9]
    words = [list(w.token_ids) for w in sampling.bad_words_token_ids]
    assert TOKENIZER.encode("fox", add_special_tokens=False) in words
    assert TOKENIZER.encode(" fox", add_special_tokens=False) in words
    assert list(submit.prompt_token_ids) == TOKENIZER.encode(PROMPT)[-2:]


@pytest.mark.parametrize(("sampling", "field"), [
    ({"logit_bias": {99999: 1.0}}, "sampling.logit_bias[99999]"),
    ({"logit_bias": {5: 101.0}}, "sampling.logit_bias"),
    ({"allowed_token_ids": [5, 99999]}, "sampling.allowed_token_ids[1]"),
    ({"bad_words": ["ok", ""]}, "sampling.bad_words[1]"),
    ({"truncate_prompt_tokens": 0}, "sampling.truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10**6}, "sampling.truncate_prompt_tokens"),
])
def test_grpc_bad_token_constraints_are_invalid_argument_naming_the_field(model_dir, sampling,
                                                                          field):
    async def body(h):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(grpc_request(**sampling), timeout=5))
        return err.value, h.fake.submits

    err, submits = run(model_dir, body)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    _, bad_request, _ = rich(err)
    assert bad_request.field_violations[0].field == field, err.details()
    assert submits == []
