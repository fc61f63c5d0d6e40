"""Swap out / swap in and block copies through the worker keep the KV cache exact, and
generation continues as if nothing happened."""

from __future__ import annotations

import torch
from pagedserve.services.common.step_plan import NewSequence, StepPlan

from tests.integration.worker_driver import GREEDY, Driver, make_worker

PROMPT = [7, 31, 5, 99, 12, 200, 41, 8, 77, 3, 150]


def _blocks(worker, block_ids: list[int], num_tokens: int | None = None) -> list[torch.Tensor]:
    """Every layer's K and V of these device blocks' first num_tokens slots:
    [2, num_tokens, kv_heads, head]."""
    index = torch.tensor(block_ids)
    return [layer.index_select(1, index).flatten(1, 2)[:, :num_tokens].clone()
            for layer in worker.cache_engine.gpu_cache]


def test_swap_out_then_in_restores_kv_and_generation(llama_dir):
    reference = Driver(make_worker(llama_dir))
    reference.add(0, PROMPT)
    reference.run_to_length([0], len(PROMPT) + 24)

    driver = Driver(make_worker(llama_dir))
    seq = driver.add(0, PROMPT)
    driver.run_to_length([0], len(PROMPT) + 10)
    old_blocks = list(seq.block_ids)
    num_cached = seq.num_computed_tokens  # every token but the last sampled one
    saved = _blocks(driver.worker, old_blocks, num_cached)
    cpu_blocks = list(range(3, 3 + len(old_blocks)))
    driver.run(driver.plan({}, preempted_seq_ids=[0],
                           blocks_to_swap_out=list(zip(old_blocks, cpu_blocks, strict=True))))
    # another sequence overwrites the freed device blocks
    other = driver.add(1, list(range(40, 40 + 8 * len(old_blocks))))
    other.block_ids = list(old_blocks)
    driver.step({1: len(other.token_ids)})
    overwritten = _blocks(driver.worker, old_blocks, num_cached)
    assert not any(torch.equal(a, b) for a, b in zip(saved, overwritten, strict=True))
    # swap in to different device blocks and resend the sequence whole
    new_blocks = [driver.free_blocks.pop() for _ in old_blocks]
    seq.block_ids, seq.is_known = new_blocks, False
    seq.num_sent_blocks = 0
    plan = driver.plan({0: 1}, blocks_to_swap_in=list(zip(cpu_blocks, new_blocks, strict=True)))
    driver.run(plan)
    for before, after in zip(saved, _blocks(driver.worker, new_blocks, num_cached), strict=True):
        torch.testing.assert_close(after, before, atol=0, rtol=0)
    driver.run_to_length([0], len(PROMPT) + 24)
    assert seq.token_ids == reference.seqs[0].token_ids


def _cache_ops_step(step_id: int, **cache_ops: list[tuple[int, int]]) -> StepPlan:
    """A step of cache operations only (make_worker's epoch 1)."""
    return StepPlan(scheduler_epoch=1, step_id=step_id, previous_step_id=step_id - 1, **cache_ops)


def test_copy_blocks_copies_exactly(llama_dir):
    worker = make_worker(llama_dir, num_gpu_blocks=8)
    for layer in worker.cache_engine.gpu_cache:
        layer.copy_(torch.randn_like(layer))
    before = [layer.clone() for layer in worker.cache_engine.gpu_cache]
    worker.execute_step(_cache_ops_step(1, blocks_to_copy=[(1, 5), (2, 6)]))
    for old, new in zip(before, worker.cache_engine.gpu_cache, strict=True):
        assert torch.equal(new[:, 5], old[:, 1]) and torch.equal(new[:, 6], old[:, 2])
        untouched = [0, 1, 2, 3, 4, 7]
        assert torch.equal(new[:, untouched], old[:, untouched])


def test_swap_blocks_round_trip(llama_dir):
    worker = make_worker(llama_dir, num_gpu_blocks=8, num_cpu_blocks=4)
    for layer in worker.cache_engine.gpu_cache:
        layer.copy_(torch.randn_like(layer))
    before = [layer.clone() for layer in worker.cache_engine.gpu_cache]
    worker.execute_step(_cache_ops_step(1, blocks_to_swap_out=[(3, 0), (6, 2)]))
    worker.execute_step(_cache_ops_step(2, blocks_to_swap_in=[(0, 1), (2, 7)]))
    for old, new in zip(before, worker.cache_engine.gpu_cache, strict=True):
        assert torch.equal(new[:, 1], old[:, 3]) and torch.equal(new[:, 7], old[:, 6])


def test_forked_sequence_with_copied_block_decodes_like_its_parent(llama_dir):
    """n > 1 style: a child shares the parent's full blocks and gets a copy of the last one."""
    driver = Driver(make_worker(llama_dir))
    parent = driver.add(0, PROMPT)
    driver.step({0: len(PROMPT)})  # samples the first output token
    child_blocks = parent.block_ids[:-1] + [driver.free_blocks.pop()]
    child = driver.add(1, list(parent.token_ids))
    child.block_ids, child.num_computed_tokens, child.is_known = child_blocks, len(PROMPT), True
    child.num_sent_tokens, child.num_sent_blocks = len(child.token_ids), len(child_blocks)
    plan = driver.plan({0: 1}, blocks_to_copy=[(parent.block_ids[-1], child_blocks[-1])])
    plan.new_seqs.append(NewSequence(
        seq_id=1, request_id="r0", token_ids=list(child.token_ids), prompt_len=len(PROMPT),
        block_ids=child_blocks, num_computed_tokens=len(PROMPT), num_scheduled_tokens=1,
        sampling=GREEDY))
    output = driver.worker.execute_step(plan)
    tokens = {o.seq_id: o.token_ids for o in output.sampled_by_seq().values()}
    assert tokens[0] == tokens[1]
