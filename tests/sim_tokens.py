"""What the simulated worker must produce: its greedy tokens, computed from sim_token alone."""

from __future__ import annotations

from pagedserve.worker_svc.sim.sampler import SimSampler, sim_token


def expected_greedy(prompt: list[int], num_tokens: int, vocab_size: int,
                    seed: int = 0) -> list[int]:
    """ignore_eos greedy continuation of `prompt` (seed: the model seed)."""
    token_range = SimSampler(vocab_size, [], 0.0).token_range
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(sim_token(seed, len(ids), ids, 0, token_range, None, 0.0)[0])
    return ids[len(prompt):]
