"""Seeded noise on CUDA: the same integer ops as on CPU, so the same bits, and the same draws
for the same logits. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from pagedserve.worker_svc.sampler import Sampler
from pagedserve.worker_svc.seeded_noise import SeededNoise, draw_keys

from tests.unit.test_seeded_noise import PROBS, seq

pytestmark = pytest.mark.gpu


def test_bits_and_draws_equal_the_cpu_ones():
    keys = draw_keys(list(range(64)), [17] * 64, [2] * 64)
    bits = {device: SeededNoise(49152, torch.device(device)).uniform_bits(
        torch.tensor(keys, device=device)).cpu() for device in ("cpu", "cuda")}
    assert torch.equal(bits["cpu"], bits["cuda"])
    rows = [seq(i, seed=i, top_k=4, temperature=0.7) for i in range(512)]
    logits = PROBS.log().expand(len(rows), len(PROBS))
    draws = {device: [o.token_ids for o in Sampler(len(PROBS), [], torch.device(device))(
        logits.to(device), rows)] for device in ("cpu", "cuda")}
    assert draws["cpu"] == draws["cuda"]
