import math
import random

import pytest
import torch
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState
from pagedserve.worker_svc.seeded_noise import SeededNoise, draw_keys
from torch.utils._python_dispatch import TorchDispatchMode

CPU = torch.device("cpu")
PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


def reference_bits(key: int, token_id: int) -> int:
    """lowbias32(lowbias32(token_id ^ salt) ^ key) on plain unsigned 32-bit integers."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x735A2D97) & 0xFFFFFFFF
        return x ^ (x >> 15)
    return mix(mix(token_id ^ 0x85EBCA6B) ^ key)


def seq(seq_id: int, seed: int | None, position: int = 3, num_samples: int = 1,
        **sampling) -> SeqSamplingState:
    return SeqSamplingState(seq_id=seq_id, sampling=SamplingParams(**sampling),
                            token_ids=list(range(position)), prompt_len=position, seed=seed,
                            num_samples=num_samples)


def draws(rows: list[SeqSamplingState], probs: torch.Tensor = PROBS) -> list[list[int]]:
    logits = probs.log().expand(len(rows), len(probs))
    return [o.token_ids for o in Sampler(len(probs), [], CPU)(logits.clone(), rows)]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_bits_equal_the_plain_integer_reference_at_the_extremes():
    rng = random.Random(0)
    keys = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF] + [rng.getrandbits(32) for _ in range(5)]
    token_ids = [0, 1, 2, 1000, 49151]
    bits = SeededNoise(49152, CPU).uniform_bits(torch.tensor(keys))[:, token_ids]
    assert bits.tolist() == [[reference_bits(k, t) for t in token_ids] for k in keys]
    assert all(0 <= k < 2 ** 32 for k in draw_keys([-1, 2 ** 70, 5], [0, 7, 10 ** 9], [1, 1, 3]))


def test_noise_is_exponential():
    keys = torch.tensor(draw_keys(list(range(16)), [10] * 16, [1] * 16))
    noise = SeededNoise(8192, CPU).exponential(keys).flatten().double()
    n = noise.numel()
    for x in (1e-4, 0.01, 0.5, 1.0, 3.0):  # the CDF 1 - exp(-x), within 5 standard deviations
        p = 1 - math.exp(-x)
        assert abs(float((noise <= x).double().mean()) - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert float(noise.mean()) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize(("sampling", "kept"), [
    ({}, [0, 1, 2, 3, 4]),
    ({"top_k": 3}, [0, 1, 2]),
    ({"top_p": 0.8}, [0, 1, 2]),  # .4 + .3 < .8: the third token completes the mass
    ({"min_p": 0.3}, [0, 1, 2]),  # .15 >= .3 * .4
    ({"temperature": 0.5, "top_k": 4}, [0, 1, 2, 3]),
])
def test_draws_over_many_seeds_and_positions_follow_the_processed_distribution(sampling, kept):
    rows = [seq(i, seed=i // 4, position=3 + i % 4, **sampling) for i in range(6000)]
    counts = torch.bincount(torch.tensor([d[0] for d in draws(rows)]), minlength=5).float()
    assert counts[[t for t in range(5) if t not in kept]].sum() == 0
    target = PROBS[kept] ** (1 / sampling.get("temperature", 1.0))
    # 4 degrees of freedom at most: P(chi2 > 30) ≈ 5e-6; a wrong distribution lands in the hundreds
    assert chi_square(counts[kept], target / target.sum()) < 30.0


NEIGHBOURS = {
    "seeds one apart": lambda i: (seq(0, seed=i), seq(1, seed=i + 1)),
    "positions one apart": lambda i: (seq(0, seed=i, position=5), seq(1, seed=i, position=6)),
    "sample indexes": lambda i: (seq(0, seed=i, num_samples=2),),
}


@pytest.mark.parametrize("neighbours", NEIGHBOURS)
def test_neighbouring_draws_are_independent(neighbours):
    rows = [row for i in range(4000) for row in NEIGHBOURS[neighbours](i)]
    flat = [t for d in draws(rows) for t in d]
    pairs = torch.tensor(flat).view(-1, 2)
    joint = torch.bincount(pairs[:, 0] * 5 + pairs[:, 1], minlength=25).float()
    # 24 degrees of freedom: P(chi2 > 70) ≈ 2e-6; a draw that repeats its neighbour's is far off
    assert chi_square(joint, torch.outer(PROBS, PROBS).flatten()) < 70.0


def test_noise_of_neighbouring_keys_shares_nothing():
    noise = SeededNoise(49152, CPU)
    # (seed, position, sample index): (7, 20, 0), (7, 20, 1), (8, 20, 0), (7, 21, 0)
    keys = draw_keys([7, 8, 7], [20, 20, 21], [2, 1, 1])
    values = noise.exponential(torch.tensor(keys))  # [4, 49152]
    for i in range(1, len(keys)):
        assert int((values[i] == values[0]).sum()) <= 2
        assert abs(float(torch.corrcoef(values[[0, i]])[0, 1])) < 0.03


class OpCounter(TorchDispatchMode):
    """Counts the ops that would launch work on a device (views launch none)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.num_ops += not func.is_view
        return func(*args, **(kwargs or {}))


def test_seeded_rows_cost_no_op_per_row():
    def num_ops(batch_size: int) -> int:
        rows = [seq(i, seed=i, temperature=0.7, top_k=3) for i in range(batch_size)]
        sampler = Sampler(len(PROBS), [], CPU)
        logits = PROBS.log().expand(batch_size, len(PROBS)).clone()
        with OpCounter() as counter:
            sampler(logits, rows)
        return counter.num_ops

    assert num_ops(32) == num_ops(2)
