"""Fairness between requests: a long prompt's prefill shares each step's token budget, so a short
request next to it waits a few steps, not the whole prefill (scheduler core, hand-built worker)."""

from __future__ import annotations

from pagedserve.scheduler_svc.step_window import SentStep, StepWindow
from pagedserve.services.common.sampling_params import SamplingParams

from tests.unit.test_scheduler import Harness, scheduled_ids

SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _harness(**kw) -> Harness:
    return Harness(**{"num_gpu_blocks": 1200, "num_cpu_blocks": 0, "block_size": 16,
                      "max_model_len": 16384, "max_num_batched_tokens": 512, **kw})


def _steps_until_finished(h: Harness, request_id: str, max_steps: int = 100) -> int:
    for num_steps in range(1, max_steps + 1):
        _, reports = h.step()
        if any(r.request_id == request_id and r.finished for r in reports):
            return num_steps
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def test_a_short_request_next_to_an_8k_prefill_waits_a_few_steps():
    h = _harness()
    h.add("long", 8150, LONG)
    h.step()  # the long prefill is under way
    h.add("short", 8, SHORT)
    # one step for its prompt (and first token), three more decodes; the prefill alone takes 16
    assert _steps_until_finished(h, "short") <= 5
    assert not h.groups["long"].is_finished


def test_the_long_prefill_takes_the_budget_the_others_leave_except_beside_a_prompt():
    """Work-conserving outside the steps that prefill another prompt: there the long prefill
    keeps its cap, so the prompt's step is short; it costs the long one at most a step."""
    h = _harness()
    h.add("long", 8150, LONG)
    out, _ = h.step()
    assert out.plan.num_scheduled_tokens == 512  # alone: capped, then topped up
    h.add("short", 8, SHORT)
    out, _ = h.step()
    assert sorted(scheduled_ids(out)) == ["long", "short"]
    assert out.plan.num_scheduled_tokens == 256 + 8  # the cap and the short prompt
    out, _ = h.step()
    assert out.plan.num_scheduled_tokens == 512  # beside the short one's decode: topped up
    alone = _harness()
    alone.add("long", 8150, LONG)
    assert _steps_until_finished(h, "long") + 3 <= _steps_until_finished(alone, "long") + 1


def test_long_prompts_take_turns_and_short_ones_pass_them():
    h = _harness(max_long_partial_prefills=1)
    h.add("long_a", 4000, LONG)
    h.add("long_b", 4000, LONG)
    h.add("short", 8, SHORT)
    out, _ = h.step()
    assert sorted(scheduled_ids(out)) == ["long_a", "short"]  # long_b waits for the slot
    assert [g.request_id for g in h.scheduler.waiting] == ["long_b"]
    h.run_to_end()
    assert h.all_free()


def test_the_threshold_defaults_to_four_percent_of_max_model_len_within_half_the_budget():
    def threshold(max_model_len: int, **kw) -> int:
        return Harness(max_model_len=max_model_len, **kw).scheduler.long_prefill_token_threshold

    assert threshold(16384) == 16384 * 4 // 100
    assert threshold(256) == 64
    assert threshold(16384, max_num_batched_tokens=512) == 256
    assert threshold(16384, long_prefill_token_threshold=100) == 100


def test_prompts_over_the_threshold_arriving_together_share_one_step_when_the_budget_allows():
    """The long-prefill limit orders who is served first; it never leaves budget unused: once
    everything else is scheduled, deferred long prompts take what is left, in order."""
    h = _harness(max_num_batched_tokens=2048)  # threshold 655: these six prompts are long
    for i in range(6):
        h.add(f"p{i}", 700, LONG)
    out, _ = h.step()
    assert sorted(scheduled_ids(out)) == [f"p{i}" for i in range(3)]
    assert out.plan.num_scheduled_tokens == 2048
    h.run_to_end()
    assert h.all_free()


def test_a_short_request_arriving_mid_7k_prefill_runs_in_the_next_step_planned():
    """Async scheduling as EngineCore runs it: step n+1 is planned while step n runs, and the
    request arrives between the two plans. The step planned next has its whole prompt, samples
    its first token and is short: the long prefill keeps its cap there."""
    h = _harness(max_model_len=8192, max_num_batched_tokens=2048)
    window = StepWindow(is_async=True)

    def send() -> SentStep:
        return SentStep(h.scheduler.schedule(), [])

    h.add("long", 7000, LONG)
    window.fill(send)  # a step running, one sent behind it
    h.add("short", 8, SHORT)
    running = window.pop_oldest()
    h.take_in(running)
    window.send_behind(send)  # the first plan after the arrival
    sent, planned = window.pop_oldest(), window.pop_oldest()
    short, = [item for item in planned.scheduled.scheduled
              if item.group.request_id == "short"]
    assert short.num_scheduled_tokens == 8 and short.is_sampling
    assert planned.scheduled.plan.num_scheduled_tokens == (
        h.scheduler.long_prefill_token_threshold + 8)
    h.take_in(sent)
    report, = [r for r in h.processor.report(h.take_in(planned)) if r.request_id == "short"]
    assert report.outputs[0].token_ids  # its first token, two steps after it arrived
    assert [s.scheduled.plan.num_scheduled_tokens for s in (running, sent)] == [2048, 2048]


def test_a_running_long_prefill_the_limit_defers_takes_what_the_step_leaves():
    """The second pass also serves running long prefills the limit deferred, with no waiting
    prompt to send the scheduler there."""
    h = _harness(max_num_batched_tokens=2048, max_long_partial_prefills=2)  # threshold 655
    h.add("a", 3000, LONG)
    h.add("b", 3000, LONG)
    out, _ = h.step()
    assert sorted(scheduled_ids(out)) == ["a", "b"]
    h.scheduler.config.max_long_partial_prefills = 1  # now b is deferred behind a
    out, _ = h.step()
    assert not h.scheduler.waiting
    assert h.groups["a"].is_finished  # capped, then topped up to the end of its prompt
    assert sorted(scheduled_ids(out)) == ["a", "b"]
    assert out.plan.num_scheduled_tokens == 2048
