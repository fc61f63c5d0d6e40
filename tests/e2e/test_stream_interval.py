"""A gateway with --stream-interval 4: streams carry four tokens a message (the first token and
the end at once), the same tokens and text as the unary call, through both front doors. A
scheduler ahead of the gateway may merge steps: an event then carries more tokens, never fewer."""

import json

import httpx
import pytest
from pagedserve.services.gateway.config import RequestLimitsConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2

INTERVAL = 4


@pytest.fixture(scope="module")
def stack_options() -> dict:
    return {"limits": RequestLimitsConfig(stream_interval=INTERVAL)}


def request(max_tokens: int, n: int = 1) -> gateway_pb2.GenerateRequest:
    """Greedy, or seeded sampling for n > 1."""
    return gateway_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7, 8, 9]),
        sampling=common_pb2.SamplingParams(temperature=0.0 if n == 1 else 1.0, seed=7,
                                           max_tokens=max_tokens, n=n, ignore_eos=True))


def test_grpc_streams_carry_stream_interval_tokens_a_message(generation):
    unary = generation.Generate(request(14), timeout=60).outputs[0]
    deltas = list(generation.GenerateStream(request(14), timeout=60))
    sizes = [len(d.token_ids) for d in deltas]
    # the first event goes at once, not held for the interval: one token, or the few a
    # scheduler ahead of the gateway merged into it
    assert sizes[0] < INTERVAL and sum(sizes) == 14
    assert all(size >= INTERVAL for size in sizes[1:-1]), sizes
    assert len(deltas) <= 1 + -(-13 // INTERVAL)
    assert [t for d in deltas for t in d.token_ids] == list(unary.token_ids)
    assert "".join(d.text for d in deltas) == unary.text
    assert deltas[-1].finish_reason == unary.finish_reason != 0


def test_each_output_of_n_starts_at_once_and_ends_complete(generation):
    unary = generation.Generate(request(9, n=2), timeout=60)
    deltas = list(generation.GenerateStream(request(9, n=2), timeout=60))
    for output in unary.outputs:
        own = [d for d in deltas if d.index == output.index]
        assert len(own[0].token_ids) < INTERVAL
        assert [t for d in own for t in d.token_ids] == list(output.token_ids)


def test_openai_streams_carry_stream_interval_tokens_an_event(stack):
    body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8, 9], "max_tokens": 14,
            "temperature": 0.0, "ignore_eos": True}
    url = f"{stack.http_url}/v1/completions"
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [choice["text"] for event in events for choice in json.loads(event)["choices"]]
    assert "".join(texts) == whole
    assert len([t for t in texts if t]) <= 1 + -(-13 // INTERVAL)
