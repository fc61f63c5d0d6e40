"""The decode fast path (`Scheduler._add_decode`, taken while the pool holds a block for every
decoding sequence) plans what the general path (`assign_decode`, the room check, `_add`) plans."""

from __future__ import annotations

import itertools

import pytest
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.step_window import SentStep, StepWindow
from pagedserve.services.common.sampling_params import SamplingParams

from tests.unit.test_scheduler import Harness

SAMPLINGS = [
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    SamplingParams(n=2, best_of=3, temperature=1.0, seed=1, max_tokens=7, ignore_eos=True),
    SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=6,
                   ignore_eos=True),
]


def _steps(is_fast_path_on: bool, is_async: bool, monkeypatch: pytest.MonkeyPatch,
           **kw) -> tuple[list, int]:
    """Every step's plan and scheduled items over a mix of plain decodes, forks sharing blocks
    (copy-on-write) and beams, prompts arriving while others decode; and the fast path's calls.
    Async: each plan is made while the step before it runs (its samples still placeholders)."""
    h = Harness(num_gpu_blocks=256, num_cpu_blocks=0, block_size=4, **kw)
    if not is_fast_path_on:
        monkeypatch.setattr(h.bm, "can_append_decodes", lambda num_seqs: False)
    num_calls = 0
    add_decode = Scheduler._add_decode

    def counted(*args):
        nonlocal num_calls
        num_calls += 1
        return add_decode(*args)

    monkeypatch.setattr(Scheduler, "_add_decode", counted)
    steps = []

    def send() -> SentStep | None:
        out = h.scheduler.schedule()
        steps.append(out)
        return SentStep(out, []) if out.plan is not None else None

    window = StepWindow(is_async)
    for i in itertools.count():
        if i < 9:
            h.add(f"r{i}", 3 + 2 * i, SAMPLINGS[i % len(SAMPLINGS)])
        window.fill(send)
        sent = window.pop_oldest()
        if sent is None:
            break
        h.processor.report(h.take_in(sent))
    assert h.all_free()
    return [(out.plan, [(item.seq.seq_id, item.num_scheduled_tokens, item.num_samples,
                         item.is_sampling, item.draft_token_ids) for item in out.scheduled])
            for out in steps], num_calls


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("kw", [{}, {"enable_prefix_caching": True},
                                {"max_num_batched_tokens": 12, "max_num_seqs": 4}])
def test_the_decode_fast_path_plans_what_the_general_path_plans(monkeypatch, is_async, kw):
    fast, num_fast_calls = _steps(True, is_async, monkeypatch, **kw)
    general, num_general_calls = _steps(False, is_async, monkeypatch, **kw)
    assert num_fast_calls > 50 and num_general_calls == 0
    assert fast == general
