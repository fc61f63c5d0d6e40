"""The gateway's failover against a scheduler whose Submit streams break: resubmissions carry
the tokens streamed so far, a request that keeps breaking ends with UNAVAILABLE after 3
failovers, and beam search cannot resume once its outputs were sent."""

from __future__ import annotations

import grpc
import pytest
from pagedserve.services.gateway.failover import MAX_FAILOVERS

from tests.unit.test_gateway_servicer import collect, model_dir, request, run  # noqa: F401


def test_each_resubmission_carries_the_tokens_streamed_so_far(model_dir):  # noqa: F811
    async def body(h):
        h.fake.break_after = 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(request(max_tokens=10, temperature=0.0),
                                                      timeout=30))
        return err.value, h.fake.submits

    err, submits = run(model_dir, body)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert f"failed over {MAX_FAILOVERS} times" in err.details()
    assert len(submits) == MAX_FAILOVERS + 1
    assert {s.request_id for s in submits} == {"r1"}
    assert list(submits[0].resumed_outputs) == []
    # the fake replays its reply from the start each time: one more token gathered per attempt
    resumed = [[(o.index, len(o.token_ids)) for o in s.resumed_outputs] for s in submits[1:]]
    assert resumed == [[(0, 1)], [(0, 2)], [(0, 3)]]


def test_beam_search_cannot_resume_after_its_outputs_were_sent(model_dir):  # noqa: F811
    async def body(h):
        h.fake.break_after = 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(
                request(max_tokens=10, n=1, best_of=2, use_beam_search=True, temperature=0.0),
                timeout=30))
        return err.value, h.fake.submits

    err, submits = run(model_dir, body)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot be resumed" in err.details()
    assert len(submits) == 1
