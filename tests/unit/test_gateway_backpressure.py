"""Backpressure at the gateway over real gRPC (fake scheduler behind it): a client that stops
reading gets its request paused in the scheduler once it has more than max_unread_stream_tokens
unread, and resumed when it reads again, losing or repeating no token; a client that reads is
never paused."""

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
from pagedserve.services.common.engine_api import PauseRequest
from pagedserve.services.common.errors import Unavailable
from pagedserve.services.common.outputs import RequestOutput, SequenceDelta
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.config import RequestLimitsConfig, RoutingConfig
from pagedserve.services.gateway.failover import ResumableSubmission
from pagedserve.services.gateway.replica_set import Replica
from pagedserve.services.gateway.routing import Decision
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.unit.test_gateway_hostile_clients import model_dir, run  # noqa: F401 (fixture)
from tests.unit.test_gateway_servicer import collect, read_rest, request

NUM_TOKENS = 3_000
MAX_UNREAD = 32


def stalled_request(request_id: str) -> gateway_pb2.GenerateStreamRequest:
    return gateway_pb2.GenerateStreamRequest(
        request_id=request_id, token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5))


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


def test_an_unread_stream_is_paused_and_resumes_without_losing_a_token(model_dir):  # noqa: F811
    async def body(h):
        h.fake.num_reply_tokens = NUM_TOKENS
        # a receive window of ~1 KB: the first responses fill it, the rest wait in the gateway
        small_window = grpc.aio.insecure_channel(f"127.0.0.1:{h.gateway.port}", options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
        stalled = gateway_pb2_grpc.GenerationServiceStub(small_window).GenerateStream(
            stalled_request("stalled"), timeout=60)
        await wait_until(lambda: ("stalled", True) in h.fake.pauses)
        num_sent_at_pause = h.fake.num_tokens_sent["stalled"]
        normal = await collect(h.generation.GenerateStream(request(max_tokens=40), timeout=30))
        await asyncio.sleep(0.2)  # time the scheduler would have used to run ahead
        num_sent_paused = h.fake.num_tokens_sent["stalled"]
        responses = await read_rest(stalled)
        await small_window.close()
        expected = [h.fake.reply_ids[i % len(h.fake.reply_ids)] for i in range(NUM_TOKENS)]
        return normal, num_sent_at_pause, num_sent_paused, responses, list(h.fake.pauses), expected

    normal, at_pause, paused, responses, pauses, expected = run(
        model_dir, body, max_model_len=100_000, limits=RequestLimitsConfig(max_unread_stream_tokens=MAX_UNREAD,
                                                    stalled_stream_timeout_s=30.0))
    assert normal[-1].usage.completion_tokens == 40
    assert all(request_id == "stalled" for request_id, _ in pauses)  # the reader never paused
    assert pauses[0] == ("stalled", True) and pauses[-1] == ("stalled", False)
    assert [p for _, p in pauses] == [True, False] * (len(pauses) // 2)
    assert paused == at_pause and paused < NUM_TOKENS // 4
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


class ScriptedClient:
    """A replica's scheduler client: `num_events` one-token events, then UNAVAILABLE (a replica
    that dies, once it was paused: its events come whether the consumer reads or not) or the
    end; records Pause/Resume, refusing the first `num_unavailable`."""

    def __init__(self, num_events: int, dies: bool, num_unavailable: int = 0) -> None:
        self.num_events = num_events
        self.dies = dies
        self.num_unavailable = num_unavailable
        self.pauses: list[bool] = []
        self.is_paused = asyncio.Event()

    async def submit(self, request, on_output, owner, resumed, kv_transfer=None):
        for i in range(self.num_events):
            if on_output(RequestOutput(request.request_id, [SequenceDelta(0, [i])],
                                       finished=False, num_prompt_tokens=3,
                                       num_cached_tokens=0)):
                return
            await asyncio.sleep(0)
        if self.dies:
            await self.is_paused.wait()
            raise Unavailable("connection reset")

    async def set_paused(self, request: PauseRequest) -> None:
        if self.num_unavailable:
            self.num_unavailable -= 1
            raise Unavailable("deadline exceeded")
        self.pauses.append(request.is_paused)
        self.is_paused.set()


class TwoReplicas:
    """The part of a ReplicaSet a submission uses: `first` until it fails, then `second`."""

    retry_after_s = 2.0
    block_size = 0  # no prefix: no prefill replica is asked
    config = RoutingConfig()

    def __init__(self, first: ScriptedClient, second: ScriptedClient) -> None:
        self.replicas = [Replica("a", first), Replica("b", second)]

    async def choose(self, prompt_token_ids, avoid, timeout_s, num_failovers=0):
        replica = self.replicas[1] if "a" in avoid else self.replicas[0]
        return replica, Decision(replica.address, "test")

    @contextlib.contextmanager
    def holding(self, replica):
        yield

    def mark_failed(self, replica) -> None:
        pass


def test_a_paused_request_is_paused_again_on_the_replica_it_fails_over_to():
    async def body():
        first = ScriptedClient(num_events=3, dies=True, num_unavailable=2)
        second = ScriptedClient(num_events=2, dies=False)
        request = SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3],
                                  sampling=SamplingParams(max_tokens=10))
        submission = ResumableSubmission(TwoReplicas(first, second), request, "o", 5.0,
                                         lambda index: False)
        tokens = []
        async for output in submission.outputs():
            tokens += output.outputs[0].token_ids
            if len(tokens) == 1:
                await submission.set_paused(True)  # asked again past 2 UNAVAILABLE answers
        return first.pauses, second.pauses, tokens

    first, second, tokens = asyncio.run(body())
    assert first == [True] and second == [True]
    assert tokens == [0, 1, 2, 0, 1]
