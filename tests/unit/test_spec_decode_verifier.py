"""The worker's verification of draft tokens: greedy is exact, seeded sampling draws what
speculation off draws, and the emitted tokens follow the target distribution."""

from __future__ import annotations

import pytest
import torch
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.sampler import Sampler
from pagedserve.worker_svc.sequence_mirrors import CachedSequence
from pagedserve.worker_svc.spec_decode import launch_samples, sampling_state
from pagedserve.worker_svc.token_bitmask import TokenBitmask

from tests.unit.test_sampler import CHI2_BOUND, chi_square

CPU = torch.device("cpu")


def cached(seq_id: int, drafts: list[int], seed: int | None = None,
           **sampling) -> CachedSequence:
    return CachedSequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=[1, 2, 3],
                          prompt_len=2, block_table=[0], num_computed_tokens=2,
                          sampling=SamplingParams(**sampling), seed=seed, num_samples=1,
                          num_scheduled_tokens=1 + len(drafts), draft_token_ids=list(drafts))


def verify(logits: torch.Tensor, seqs: list[CachedSequence], vocab: int):
    return launch_samples(Sampler(vocab, [vocab - 1], CPU), logits, seqs).result()


def test_greedy_keeps_the_drafts_the_target_would_have_chosen_and_its_next_token():
    torch.manual_seed(0)
    logits = torch.randn(7, 10)  # seq 0: 4 rows (3 drafts), seq 1: 1 row, seq 2: 2 rows
    best = logits.argmax(dim=-1).tolist()
    wrong = (best[1] + 1) % 10
    seqs = [cached(0, [best[0], wrong, best[2]], temperature=0.0), cached(1, [], temperature=0.0),
            cached(2, [best[5]], temperature=0.0, logprobs=2)]
    first, plain, all_kept = verify(logits, seqs, 10)
    assert first.token_ids == [best[0], best[1]]  # draft 0 kept, then the target's correction
    assert plain.token_ids == [best[4]]
    assert all_kept.token_ids == [best[5], best[6]]  # the draft, then the bonus token
    logprobs = torch.log_softmax(logits, dim=-1)
    assert first.logprobs == pytest.approx([logprobs[0, best[0]].item(),
                                            logprobs[1, best[1]].item()], abs=1e-6)
    assert [top[0].token_id for top in all_kept.top_logprobs] == [best[5], best[6]]


def test_seeded_sampling_emits_what_speculation_off_draws_position_by_position():
    torch.manual_seed(1)
    logits = torch.randn(3, 6)
    sampler = Sampler(6, [5], CPU)
    for seed in range(200):
        drafts = [seed % 5, (seed // 5) % 5]
        seq = cached(0, drafts, seed=seed, temperature=0.9, top_p=0.95)
        got = verify(logits, [seq], 6)[0].token_ids
        expected, history = [], []
        for row in range(3):  # speculation off: one draw per step, the history growing
            plain = cached(0, [], seed=seed, temperature=0.9, top_p=0.95)
            plain.token_ids = plain.token_ids + history
            token = sampler(logits[row:row + 1], [sampling_state(plain)])[0].token_ids[0]
            expected.append(token)
            if row == 2 or token != drafts[row]:
                break
            history.append(token)
        assert got == expected, seed


def test_rejection_sampling_keeps_the_target_distribution():
    """The first token follows p whatever the draft; a draft d is kept with probability p(d)."""
    p0 = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    p1 = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    logits = torch.stack([p0.log(), p1.log()])
    num_seqs = 4000
    seqs = [cached(i, [1], seed=i) for i in range(num_seqs)]
    out = verify(logits.repeat(num_seqs, 1), seqs, 5)
    first = torch.tensor([o.token_ids[0] for o in out])
    assert chi_square(torch.bincount(first, minlength=5).float(), p0) < CHI2_BOUND
    accepted = [o for o in out if len(o.token_ids) == 2]
    assert len(accepted) / num_seqs == pytest.approx(0.3, abs=0.03)
    second = torch.tensor([o.token_ids[1] for o in accepted])
    assert chi_square(torch.bincount(second, minlength=5).float(), p1) < CHI2_BOUND


def test_a_constrained_sequence_keeps_its_mask_beside_verified_drafts():
    """Sequence 1 is constrained (no drafts); sequence 0's three verified rows come first, so its
    one mask row moves from 1 to 3 and the drafts' rows stay unmasked."""
    torch.manual_seed(2)
    logits = torch.randn(5, 64)
    best = logits.argmax(dim=-1).tolist()
    seqs = [cached(0, [best[0], best[1]], temperature=0.0), cached(1, [], temperature=0.0)]
    allowed = (best[3] + 1) % 64  # the grammar forbids the target's own choice
    bits = torch.zeros(1, 2, dtype=torch.int32)
    bits[0, allowed // 32] = 1 << (allowed % 32)
    mask = TokenBitmask(rows=[1], bits=bits)
    drafted, constrained = launch_samples(Sampler(64, [63], CPU), logits, seqs, mask).result()
    assert drafted.token_ids == best[:3]  # both drafts kept, then the bonus token
    assert constrained.token_ids == [allowed]
