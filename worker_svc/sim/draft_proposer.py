"""A draft model on the simulated GPU: the real proposer's bookkeeping (catch-up, one forward per
draft position, the draft KV's slots) with each forward's modelled time queued on the timeline,
and drafts that match the target at a given rate; the host waits for the device once a step
where the real proposer keeps greedy drafts on the device, once a position where it reads them.

Simulated tokens carry no meaning, so no model can guess them; what the target will draw is known
(the sim sampler's draw is a function of seed, position and context), so each draft is that draw
with probability `acceptance`, another token otherwise. The acceptance rate belongs to the
workload and the draft model, not to the GPU: it is an input (sim_draft_acceptance), as in
bench/spec_decode_model.py, and the simulation gives what the engine makes of it: the draft and
verification steps' modelled kernels, the scheduler's lookahead and budget, the host's work.
"""

from __future__ import annotations

import torch
from pagedserve.worker_svc.draft_proposer import DraftProposer
from pagedserve.worker_svc.model_input import build_model_input
from pagedserve.worker_svc.sampler import SeqSamplingState
from pagedserve.worker_svc.sequence_mirrors import CachedSequence
from pagedserve.worker_svc.sim.model import SimModel
from pagedserve.worker_svc.sim.sampler import SimSampler

_DRAFT_STREAM = 0x5D4AF7  # the draft's keep-or-miss choices, apart from the target's draws


class SimDraftProposer(DraftProposer):
    def __init__(self, model: SimModel, block_size: int, device: torch.device,
                 target_sampler: SimSampler, acceptance: float) -> None:
        super().__init__(model, block_size, device)
        self.target_sampler = target_sampler
        self.acceptance = acceptance
        self._reads_each_position = True

    def _propose_greedy(self, catch_up: list[CachedSequence], proposing: list[CachedSequence],
                        drafts: dict[int, list[int]], kv_caches: list[torch.Tensor]) -> None:
        """As the real proposer's: the positions' forwards queued back to back, their drafts
        read on the host once, after the last."""
        self._reads_each_position = False
        try:
            self._propose_by_position(catch_up, proposing, drafts,
                                      {s.seq_id: [] for s in proposing}, kv_caches)
        finally:
            self._reads_each_position = True
        self.model.timeline.synchronize()

    def _draw(self, seqs: list[CachedSequence], drafts: dict[int, list[int]],
              probs: dict[int, list[torch.Tensor]], kv_caches: list[torch.Tensor]) -> None:
        model_input = build_model_input(seqs, self.block_size, self.device)
        hidden_states = self.model(model_input.input_ids, model_input.positions, kv_caches,
                                   model_input.meta)  # [num_tokens, 0]
        proposing = [s for s in seqs if s.seq_id in drafts]
        self.model.compute_logits(hidden_states[:len(proposing)])  # queues the forward's time
        if not proposing:
            return
        if self._reads_each_position:  # as the real proposer does a sampled step's drafts
            self.model.timeline.synchronize()
        # the target's state at the draft's position: everything the draft model has computed
        states = [SeqSamplingState(
            seq_id=s.seq_id, sampling=s.sampling,
            token_ids=s.token_ids[:s.num_computed_tokens + s.num_scheduled_tokens],
            prompt_len=s.prompt_len, seed=s.seed, num_samples=s.num_samples) for s in proposing]
        sampler = self.target_sampler
        for state, drawn in zip(states, sampler(None, states), strict=True):
            token = drawn.token_ids[0]
            if sampler.uniform(state, _DRAFT_STREAM) >= self.acceptance:
                token = sampler.another_token(token)
            drafts[state.seq_id].append(token)
