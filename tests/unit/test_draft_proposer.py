"""The draft model's KV bookkeeping in the worker: which tokens it computes at which positions and
slots (each known token once; prompt chunks, each step's new tokens, the last accepted draft,
a rejected draft's position again), its greedy drafts, lookahead slots refused where no draft model
runs, and its cache layers moving with the target's blocks."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels.backend import get_backend
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import (
    NewSequence,
    RunningSequence,
    SampledSequence,
    StepPlan,
)
from pagedserve.worker_svc.cache_engine import CacheEngine, KVCacheSpec
from pagedserve.worker_svc.draft_proposer import DraftProposer
from pagedserve.worker_svc.sampler import Sampler
from pagedserve.worker_svc.sequence_mirrors import SequenceMirrors
from torch import nn

VOCAB = 64
BLOCK_SIZE = 4


class NextTokenModel(nn.Module):
    """Proposes token + 1 after each token; records what each forward computed."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[tuple[int, int, int]]] = []  # (token, position, slot) per forward

    def forward(self, input_ids, positions, kv_caches, meta):
        self.calls.append(list(zip(input_ids.tolist(), positions.tolist(),
                                   meta.slot_mapping.tolist(), strict=True)))
        return input_ids.float().unsqueeze(-1)  # [num_tokens, 1]

    def compute_logits(self, hidden_states):
        return nn.functional.one_hot((hidden_states[:, 0].long() + 1) % VOCAB, VOCAB).float()


class Harness:
    def __init__(self, sampler: Sampler | None = None) -> None:
        self.mirrors = SequenceMirrors(BLOCK_SIZE, max_model_len=64)
        self.model = NextTokenModel()
        self.proposer = DraftProposer(self.model, BLOCK_SIZE, torch.device("cpu"), sampler)
        self.mirrors.draft_blocks = self.proposer.blocks
        self.step_id = 0

    def step(self, new=(), running=(), sampled: list[int] | None = None):
        """One step; returns what the draft model computed and the sequence's drafts."""
        self.step_id += 1
        plan = StepPlan(scheduler_epoch=1, step_id=self.step_id, new_seqs=list(new),
                        running_seqs=list(running), previous_step_id=self.step_id - 1)
        self.mirrors.check(plan, num_gpu_blocks=16, vocab_size=VOCAB)
        scheduled = self.mirrors.apply(plan, is_checked=True)
        self.model.calls.clear()
        self.proposer.blocks.target_writes(scheduled)
        self.behind = self.proposer.catch_up(scheduled, [])
        self.proposer.propose(scheduled, [])
        drafts = list(scheduled[0].draft_token_ids)
        self.mirrors.mark_computed(scheduled)
        if sampled is not None:
            self.mirrors.append_drawn(scheduled, [SampledSequence(
                1, sampled, [0.0] * len(sampled))])
        return self.model.calls, drafts


def new_seq(**fields) -> NewSequence:
    seq = dict(seq_id=1, request_id="r", token_ids=[10, 11, 12, 13, 14], prompt_len=5,
               block_ids=[3, 7, 9], num_computed_tokens=0, num_scheduled_tokens=3,
               sampling=SamplingParams(temperature=0.0))
    seq.update(fields)
    return NewSequence(**seq)


def decode(num_lookahead_slots: int) -> RunningSequence:
    return RunningSequence(seq_id=1, new_token_ids=[], block_ids_start=3, block_ids=[],
                           num_scheduled_tokens=1 + num_lookahead_slots,
                           num_lookahead_slots=num_lookahead_slots)


def test_the_draft_model_computes_each_known_token_once_then_proposes_greedily():
    """Prompt chunks cost the draft model nothing until the sequence first proposes."""
    h = Harness()
    calls, drafts = h.step(new=[new_seq()])  # a prompt chunk: no proposal
    assert calls == [] and drafts == []
    calls, _ = h.step(running=[RunningSequence(1, [], 3, [], num_scheduled_tokens=2)],
                      sampled=[20])
    assert calls == []
    # the prompt and the sampled token, then one forward per further draft at the reserved slots
    calls, drafts = h.step(running=[decode(3)], sampled=[21, 30])
    assert calls == [[(10, 0, 12), (11, 1, 13), (12, 2, 14), (13, 3, 15), (14, 4, 28),
                      (20, 5, 29)], [(21, 6, 30)], [(22, 7, 31)]]
    assert drafts == [21, 22, 23]
    # one draft kept: the position of the rejected 22 is computed again, with the token kept
    calls, drafts = h.step(running=[decode(2)], sampled=[31, 32, 33])
    assert calls == [[(30, 7, 31)], [(31, 8, 36)]] and drafts == [31, 32]
    # all kept: the last draft (32), which the draft model never computed, comes first
    calls, drafts = h.step(running=[decode(1)], sampled=[34])
    assert calls == [[(32, 9, 37), (33, 10, 38)]] and drafts == [34]


def test_a_sequence_that_does_not_propose_runs_no_draft_forward_and_catches_up_when_it_does():
    """A step whose drafts the scheduler cut costs no draft forward; the tokens it decoded reach
    the draft model's KV in the first forward of the next step that proposes."""
    h = Harness()
    h.step(new=[new_seq(num_scheduled_tokens=5)], sampled=[20])  # the whole prompt
    calls, drafts = h.step(running=[decode(0)], sampled=[21])
    assert calls == [] and drafts == []
    calls, drafts = h.step(running=[decode(2)])
    prompt = [(10, 0, 12), (11, 1, 13), (12, 2, 14), (13, 3, 15), (14, 4, 28)]
    assert calls == [prompt + [(20, 5, 29), (21, 6, 30)], [(22, 7, 31)]] and drafts == [22, 23]


def sampled_drafts(sampling: SamplingParams, seed: int | None) -> tuple[list[int], object]:
    h = Harness(Sampler(VOCAB, [], torch.device("cpu")))
    plan = StepPlan(scheduler_epoch=1, step_id=1, new_seqs=[new_seq(
        num_computed_tokens=4, num_scheduled_tokens=4, num_lookahead_slots=3, sampling=sampling,
        seed=seed)])
    h.mirrors.check(plan, num_gpu_blocks=16, vocab_size=VOCAB)
    scheduled = h.mirrors.apply(plan, is_checked=True)
    h.proposer.propose(scheduled, [])
    return scheduled[0].draft_token_ids, scheduled[0].draft_probs


def test_a_sampled_request_draws_its_drafts_with_the_distributions_they_came_from():
    """The stand-in's logits are one-hot: at temperature 0.5 the next token has ~10% of the mass,
    so the draws vary with the seed and repeat with it; a greedy request keeps argmax drafts."""
    sampling = SamplingParams(temperature=0.5)
    drafts, probs = sampled_drafts(sampling, seed=7)
    assert probs.shape == (3, VOCAB)
    assert probs.sum(dim=-1).tolist() == pytest.approx([1.0] * 3)
    assert sampled_drafts(sampling, seed=7)[0] == drafts
    assert len({tuple(sampled_drafts(sampling, seed)[0]) for seed in range(8)}) > 1
    greedy, greedy_probs = sampled_drafts(SamplingParams(temperature=0.0), seed=7)
    assert greedy == [15, 16, 17] and greedy_probs is None


def test_a_sequence_sent_whole_catches_up_from_where_its_blocks_hold_the_draft_kv():
    """After a swap-in or a prefix hit the full blocks that hold the draft model's KV keep it;
    the tokens past them may have passed the draft model by."""
    h = Harness()
    h.proposer.blocks.mark([3, 7, 9], 0, 4)  # block 3: tokens 0-3
    calls, drafts = h.step(new=[new_seq(num_computed_tokens=4, num_scheduled_tokens=3,
                                        num_lookahead_slots=2)])
    assert calls == [[(14, 4, 28)], [(15, 5, 29)]] and drafts == [15, 16]


def test_lookahead_slots_are_refused_without_a_draft_model():
    h = Harness()
    h.mirrors.draft_blocks = None
    plan = StepPlan(scheduler_epoch=1, step_id=1, new_seqs=[
        new_seq(num_scheduled_tokens=7, num_lookahead_slots=2)])
    with pytest.raises(InvalidRequest, match="num_lookahead_slots=2 needs a worker with a draft"):
        h.mirrors.check(plan)


@pytest.mark.parametrize("backend", ["ref", "torch"])
def test_the_draft_models_kv_moves_with_its_blocks(backend):
    """Copy-on-write and swaps carry the draft model's layers, of their own KV shape, with the
    target's."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_size=4, block_size=BLOCK_SIZE,
                       dtype=torch.float32, num_draft_layers=1, draft_num_kv_heads=2,
                       draft_head_size=2)
    cpu = torch.device("cpu")
    engine = CacheEngine(spec, num_gpu_blocks=4, num_cpu_blocks=2, device=cpu,
                         backend=get_backend(backend, cpu))
    assert (len(engine.gpu_cache), len(engine.draft_gpu_cache)) == (2, 1)
    assert engine.draft_gpu_cache[0].shape == (2, 4, BLOCK_SIZE, 2, 2)
    assert engine.cpu_cache[2].shape == (2, 2, BLOCK_SIZE, 2, 2)
    assert spec.num_cache_layers == 3
    assert spec.bytes_per_block == 2 * BLOCK_SIZE * 4 * (2 * 1 * 4 + 1 * 2 * 2)
    engine.draft_gpu_cache[0][:, 0] = 7.0
    engine.copy([(0, 1)])
    engine.swap_out([(1, 0)])
    engine.swap_in([(0, 3)])
    assert (engine.draft_gpu_cache[0][:, 3] == 7.0).all()
    assert not engine.gpu_cache[1][:, 3].any()


class MixingModel(NextTokenModel):
    """Proposes (7 * token + position + 1) % VOCAB: a wrong row or position shows."""

    def forward(self, input_ids, positions, kv_caches, meta):
        super().forward(input_ids, positions, kv_caches, meta)
        return (input_ids * 7 + positions).float().unsqueeze(-1)


def _drafts(by_position: bool) -> tuple[list[list[int]], list]:
    h = Harness()
    h.model = h.proposer.model = MixingModel()
    if by_position:
        proposer = h.proposer
        proposer._propose_greedy = lambda catch_up, proposing, drafts, kv: (
            proposer._propose_by_position(catch_up, proposing, drafts,
                                          {s.seq_id: [] for s in proposing}, kv))
    plan = StepPlan(scheduler_epoch=1, step_id=1, new_seqs=[
        new_seq(seq_id=i, request_id=f"r{i}", token_ids=[10 * i + t for t in range(5)],
                block_ids=[3 * i, 3 * i + 1], num_computed_tokens=4,
                num_scheduled_tokens=1 + num_slots, num_lookahead_slots=num_slots)
        for i, num_slots in ((1, 3), (2, 2), (3, 3))])
    h.mirrors.check(plan, num_gpu_blocks=16, vocab_size=VOCAB)
    scheduled = h.mirrors.apply(plan, is_checked=True)
    h.proposer.propose(scheduled, [])
    return [seq.draft_token_ids for seq in scheduled], h.model.calls


def test_greedy_drafts_read_once_per_step_are_those_read_position_by_position():
    """Three sequences of 3, 2 and 3 lookahead slots (the second stops a position early): the
    drafts that stay on the device between positions feed the same tokens at the same positions
    and slots as drafts read on the host after each, and come out token for token the same."""
    on_device, calls = _drafts(by_position=False)
    assert (on_device, calls) == _drafts(by_position=True)
    assert [len(drafts) for drafts in on_device] == [3, 2, 3]
    assert [len(forward) for forward in calls] == [15, 3, 2]  # no block held their draft KV
