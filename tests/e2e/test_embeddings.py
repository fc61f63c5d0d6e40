"""/v1/embeddings with the official `openai` client, and the gRPC Embed, on the tiny stack (real
worker, scheduler and gateway): the vectors equal Hugging Face's last hidden state of the last
token, L2-normalized, and every block is free after."""

import base64

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.stack import assert_idle

MODEL = "tiny-llama"
PROMPTS = [[5, 80, 200, 31], list(range(3, 60)), [7]]


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def hf_last(tiny_served_model_dir):
    import transformers

    hf = transformers.AutoModel.from_pretrained(tiny_served_model_dir, dtype=torch.float32).eval()

    def embed(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hidden = hf(torch.tensor([token_ids])).last_hidden_state[0]
        return F.normalize(hidden[-1], dim=0)

    return embed


def close(got, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=2e-5,
                               rtol=1e-4)


def test_token_id_lists_equal_hf(stack, client, hf_last):
    response = client.embeddings.create(model=MODEL, input=PROMPTS, encoding_format="float")
    assert [d.index for d in response.data] == [0, 1, 2]
    for data, prompt in zip(response.data, PROMPTS, strict=True):
        close(data.embedding, hf_last(prompt))
    assert response.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert response.usage.total_tokens == response.usage.prompt_tokens
    assert response.model == MODEL and response.object == "list"
    named = client.embeddings.create(model=MODEL, input=[5], encoding_format="float",
                                     extra_body={"request_id": "mine", "normalize": True})
    assert named.id == "mine"
    assert_idle(stack)


def test_text_token_ids_and_base64(stack, client, hf_last):
    text = "the quick brown fox"
    token_ids = httpx.post(f"{stack.http_url}/tokenize", json={"prompt": text}).json()["tokens"]
    by_text = client.embeddings.create(model=MODEL, input=text)  # the client asks for base64
    by_ids = client.embeddings.create(model=MODEL, input=token_ids, encoding_format="float")
    close(by_text.data[0].embedding, hf_last(token_ids))
    close(by_ids.data[0].embedding, hf_last(token_ids))
    raw = httpx.post(f"{stack.http_url}/v1/embeddings",
                     json={"input": [text, text], "encoding_format": "base64"}).json()
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    close(vectors[1].tolist(), hf_last(token_ids))
    assert raw["usage"]["prompt_tokens"] == 2 * len(token_ids)
    bare_ids = httpx.post(f"{stack.http_url}/tokenize", json={
        "prompt": text, "add_special_tokens": False}).json()["tokens"]
    bare = client.embeddings.create(model=MODEL, input=text, encoding_format="float",
                                    extra_body={"add_special_tokens": False})
    close(bare.data[0].embedding, hf_last(bare_ids))
    assert bare.usage.prompt_tokens == len(bare_ids)


def test_unsupported_and_bad_fields_are_refused(client):
    for kwargs, param in (({"dimensions": 8}, "dimensions"), ({"input": []}, "input"),
                          ({"input": [[1, 2], "x"]}, "input"),
                          ({"extra_body": {"truncate_prompt_tokens": 3}},
                           "truncate_prompt_tokens"),
                          ({"extra_body": {"normalize": False}}, "normalize"),
                          ({"extra_body": {"embed_dtype": "float16"}}, "embed_dtype")):
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=MODEL, **{"input": "hi", **kwargs})
        assert info.value.body["param"] == param
        assert param in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


def test_grpc_embed_equals_http(stack, client, hf_last):
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        response = stub.Embed(gateway_pb2.EmbedRequest(
            request_id="emb-1", token_ids=common_pb2.TokenIds(token_ids=PROMPTS[1])), timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            stub.Embed(gateway_pb2.EmbedRequest(text=""), timeout=60)
    assert response.request_id == "emb-1" and response.num_prompt_tokens == len(PROMPTS[1])
    close(list(response.embedding), hf_last(PROMPTS[1]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_idle(stack)


def test_the_python_clients_embed(stack, hf_last):
    from pagedserve.client import Client

    with Client(stack.gateway_address) as client:
        embedding = client.embed(PROMPTS[0], request_id="py-embed")
    assert embedding.request_id == "py-embed"
    assert embedding.num_prompt_tokens == len(PROMPTS[0])
    close(embedding.embedding, hf_last(PROMPTS[0]))
