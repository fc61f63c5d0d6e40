"""The scheduler's own request checks (it trusts no caller, the gateway included)."""

import pytest
from pagedserve.scheduler_svc.request_checks import RequestLimits, check_request
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, block_size=16, num_usable_blocks=8,
                       max_best_of=4, max_num_seqs=8, max_waiting_requests=8)


@pytest.mark.parametrize("request_id", ["r1\nINFO forged line", "r1\r", "r\x00", "r\u2028"])
def test_a_request_id_that_could_forge_a_log_line_is_refused(request_id):
    with pytest.raises(InvalidRequest, match="request_id must hold printable characters") as err:
        check_request(request_id, [1, 2], SamplingParams(), 0, LIMITS)
    assert err.value.violations[0].field == "request_id"


def test_a_printable_request_id_passes():
    check_request("chat-42 (retry 1)", [1, 2], SamplingParams(), 0, LIMITS)
