"""The worker's window of steps in flight (worker_svc/launch_window.py), its rules one by one:
the order steps run in, what may be launched ahead, and when a step is finished at once."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
from pagedserve.services.common.errors import StepOutOfOrder
from pagedserve.services.common.step_plan import RunningSequence, StepPlan
from pagedserve.worker_svc.launch_window import LaunchWindow

from tests.integration.worker_driver import make_worker
from tests.unit.test_worker_overlap import BLOCK_SIZE, _plans, _sim_worker


def test_a_step_runs_only_after_the_step_it_names_and_none_after_a_failure():
    window = LaunchWindow()
    with pytest.raises(StepOutOfOrder, match="must follow step 1, but the worker's last step is 0"):
        window.check_order(StepPlan(1, 2, previous_step_id=1))
    window.check_order(StepPlan(1, 1))
    window.last_step_id = 1
    window.check_order(StepPlan(1, 2, previous_step_id=1))
    with pytest.raises(RuntimeError), window.failing():
        raise RuntimeError("the forward failed")
    with pytest.raises(StepOutOfOrder, match="which failed; ClearState first"):
        window.check_order(StepPlan(1, 2, previous_step_id=1))
    window.reset()
    window.check_order(StepPlan(1, 1))


def test_a_step_is_handed_over_once_the_step_it_names_was():
    window = LaunchWindow()
    assert window.may_submit(StepPlan(1, 1))
    assert not window.may_submit(StepPlan(1, 2, previous_step_id=1))
    window.submitted_step_id = 1
    assert window.may_submit(StepPlan(1, 2, previous_step_id=1))
    window.reset()
    assert not window.may_submit(StepPlan(1, 2, previous_step_id=1))


def _launch(worker, plan: StepPlan) -> Future:
    future = Future()
    worker.steps.launch(worker, plan, future)
    return future


def test_a_plan_that_adds_a_token_after_one_being_drawn_waits_for_the_draw(tiny_model_dir):
    """As the scheduler's chosen tokens after a fork or a beam step would."""
    worker = _sim_worker(tiny_model_dir)
    first, decode = _plans()[:2]
    num_blocks = decode.running_seqs[0].block_ids_start
    chosen = StepPlan(1, 2, previous_step_id=1, running_seqs=[
        RunningSequence(0, [42], num_blocks, [], 2), decode.running_seqs[1]])
    futures = [_launch(worker, first)]
    assert worker.steps.has_step_in_flight  # the simulated device runs apart from the host
    futures.append(_launch(worker, chosen))
    assert futures[0].done() and worker.steps.num_launched_ahead == 0
    worker.steps.finish()
    assert all(len(f.result(timeout=0).outputs) == 2 for f in futures)
    assert worker.runner.mirrors.seqs[0].token_ids[-2] == 42


def test_a_plan_that_adds_nothing_is_launched_ahead_of_the_step_in_flight(tiny_model_dir):
    worker = _sim_worker(tiny_model_dir)
    first, decode = _plans()[:2]
    futures = [_launch(worker, first), _launch(worker, decode)]
    assert worker.steps.num_launched_ahead == 1 and worker.steps.has_step_in_flight
    worker.steps.finish()
    assert all(len(f.result(timeout=0).outputs) == 2 for f in futures)


def test_a_step_done_on_the_device_is_finished_before_the_next_launch(tiny_model_dir):
    """Its draws reach the host first (and the next grammar masks start from them): the launch
    has nothing of it left to overlap."""
    worker = _sim_worker(tiny_model_dir)
    first, decode = _plans()[:2]
    futures = [_launch(worker, first)]
    while (left_s := worker.steps.seconds_left()) != 0:
        time.sleep(left_s)
    futures.append(_launch(worker, decode))
    assert futures[0].done() and worker.steps.num_launched_ahead == 0
    worker.steps.finish()
    assert all(len(f.result(timeout=0).outputs) == 2 for f in futures)


def test_where_the_host_is_the_device_every_step_finishes_at_once(tiny_model_dir):
    worker = make_worker(tiny_model_dir("llama"), block_size=BLOCK_SIZE)
    for plan in _plans()[:3]:
        future = _launch(worker, plan)
        assert future.done() and not worker.steps.has_step_in_flight
    assert worker.steps.num_launched_ahead == 0
