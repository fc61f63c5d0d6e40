"""Penalty counts kept on CUDA give, step by step, the logits of counting every history from
scratch there (the CPU test's steps: arrivals, finishes, a sequence sent whole again, a draft's
rows). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_penalty_counts import check_kept_counts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(3))
def test_kept_counts_on_cuda_give_the_logits_of_counting_from_scratch(seed):
    check_kept_counts(seed, torch.device("cuda"))
