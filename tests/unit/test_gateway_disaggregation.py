"""The gateway's part of prefill/decode disaggregation, over scripted replicas: the prompt runs
on a prefill replica, its blocks are pinned and handed to the decode replica's submission, the
pin is released once; a prefill replica that fails leaves the request to the decode replica."""

from __future__ import annotations

import asyncio
import contextlib

from pagedserve.services.common.engine_api import ROLE_DECODE, ROLE_PREFILL, KVTransferParams
from pagedserve.services.common.errors import Unavailable
from pagedserve.services.common.outputs import RequestOutput, SequenceDelta
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.config import RoutingConfig
from pagedserve.services.gateway.disaggregation import PREFILL_SUFFIX, prefill_remotely
from pagedserve.services.gateway.failover import ResumableSubmission
from pagedserve.services.gateway.replica_set import Replica
from pagedserve.services.gateway.routing import Decision
from pagedserve.services.gateway.validation import PreparedRequest

PARAMS = KVTransferParams(["10.0.0.1:50053"], [4, 5])


class Client:
    """A scheduler: `dies_after` events of a request, then UNAVAILABLE (None: it answers)."""

    def __init__(self, dies_after: int | None = None) -> None:
        self.dies_after = dies_after
        self.submitted: list[tuple[str, KVTransferParams | None]] = []
        self.released: list[str] = []

    async def submit(self, request, on_output, owner, resumed=None, kv_transfer=None):
        self.submitted.append((request.request_id, kv_transfer))
        for i in range(request.sampling.max_tokens):
            if self.dies_after is not None and i >= self.dies_after:
                raise Unavailable("connection reset")
            if on_output(RequestOutput(request.request_id, [SequenceDelta(0, [i])],
                                       finished=i + 1 == request.sampling.max_tokens,
                                       num_prompt_tokens=len(request.prompt_token_ids),
                                       num_cached_tokens=0)):
                return
            await asyncio.sleep(0)

    async def export_kv_blocks(self, prompt_token_ids):
        return "lease-1", PARAMS

    async def release_kv_blocks(self, lease_id: str) -> None:
        self.released.append(lease_id)


class Replicas:
    """The part of a ReplicaSet a submission uses: one prefill and one decode replica."""

    retry_after_s = 1.0
    block_size = 4
    config = RoutingConfig(max_local_prefill_tokens=6)

    def __init__(self, prefill: Client | None, decode: Client) -> None:
        self.prefill = None if prefill is None else Replica("p", prefill, role=ROLE_PREFILL)
        self.decode = Replica("d", decode, role=ROLE_DECODE)
        self.failed: list[str] = []

    def choose_prefill(self, prompt_token_ids):
        return self.prefill

    async def choose(self, prompt_token_ids, avoid, timeout_s, num_failovers=0):
        return self.decode, Decision("d", "test")

    @contextlib.contextmanager
    def holding(self, replica):
        yield

    def mark_failed(self, replica) -> None:
        self.failed.append(replica.address)


def _request(num_prompt_tokens: int = 9, **sampling) -> PreparedRequest:
    return PreparedRequest("r", list(range(1, num_prompt_tokens + 1)),
                           SamplingParams(max_tokens=3, **sampling), 0)


def _run(replicas: Replicas, request: PreparedRequest) -> list[int]:
    async def body() -> list[int]:
        submission = ResumableSubmission(replicas, request, "o", 5.0, lambda index: False)
        tokens = [t async for output in submission.outputs() for t in output.outputs[0].token_ids]
        await asyncio.sleep(0)  # the release runs
        return tokens

    return asyncio.run(body())


def test_the_prompt_runs_on_the_prefill_replica_and_the_decode_replica_gets_its_blocks():
    prefill, decode = Client(), Client()
    assert _run(Replicas(prefill, decode), _request()) == [0, 1, 2]
    assert prefill.submitted == [("r" + PREFILL_SUFFIX, None)]
    assert decode.submitted == [("r", PARAMS)]
    assert prefill.released == ["lease-1"]


def test_a_prefill_replica_that_dies_leaves_the_prompt_to_the_decode_replica():
    prefill, decode = Client(dies_after=0), Client()
    replicas = Replicas(prefill, decode)
    assert _run(replicas, _request()) == [0, 1, 2]
    assert decode.submitted == [("r", None)]
    assert replicas.failed == ["p"] and prefill.released == []


def test_no_prefill_replica_short_prompts_and_prompt_logprobs_go_straight_to_decode():
    for replicas, request in [(Replicas(None, Client()), _request()),
                              (Replicas(Client(), Client()), _request(num_prompt_tokens=6)),
                              (Replicas(Client(), Client()), _request(prompt_logprobs=1))]:
        assert _run(replicas, request) == [0, 1, 2]
        assert replicas.decode.client.submitted == [("r", None)]
        assert replicas.prefill is None or replicas.prefill.client.submitted == []


def test_a_decode_replica_that_fails_over_resubmits_without_the_transfer():
    prefill, decode = Client(), Client(dies_after=1)

    class FailingOver(Replicas):
        async def choose(self, prompt_token_ids, avoid, timeout_s, num_failovers=0):
            if avoid:
                self.decode = Replica("d2", Client(), role=ROLE_DECODE)
            return self.decode, Decision(self.decode.address, "test")

    replicas = FailingOver(prefill, decode)
    _run(replicas, _request())
    assert decode.submitted == [("r", PARAMS)]
    assert replicas.decode.client.submitted == [("r", None)]
    assert prefill.released == ["lease-1"]


def test_prefill_remotely_is_none_when_nothing_was_exported():
    class Empty(Client):
        async def export_kv_blocks(self, prompt_token_ids):
            return "", KVTransferParams(["10.0.0.1:50053"], [])

    async def body():
        return await prefill_remotely(Replicas(Empty(), Client()), _request(), "o", 5.0)

    assert asyncio.run(body()) is None
