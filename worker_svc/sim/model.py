"""The simulated model: in place of the nn.Module, so ModelRunner's bookkeeping runs unchanged;
the forward is the modelled time of the step, queued on the GpuTimeline like its launches, and
the host's share of an eager step (launching its kernels) held on the calling thread."""

from __future__ import annotations

import torch
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.worker_svc.sim.roofline import Roofline
from pagedserve.worker_svc.sim.step_model import StepModel
from pagedserve.worker_svc.sim.timeline import GpuTimeline
from torch import nn


class SimModel(nn.Module):
    """`step_model` None: the step takes the roofline's time (sim_step_model=roofline)."""

    def __init__(self, step_model: StepModel | None, roofline: Roofline, timeline: GpuTimeline,
                 vocab_size: int) -> None:
        super().__init__()
        self.step_model = step_model
        self.roofline = roofline
        self.timeline = timeline
        self.vocab_size = vocab_size
        self._query_lens: list[int] = []
        self._context_lens: list[int] = []
        self._logits_row = torch.zeros(1, vocab_size)  # [1, vocab]: a uniform distribution

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Notes the step's shape; the hidden states are empty rows: [num_tokens, 0]."""
        self._query_lens = meta.query_lens_cpu
        self._context_lens = [s - q for s, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu,
                                                    strict=True)]
        return input_ids.new_empty((input_ids.shape[0], 0), dtype=torch.float32)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Queues the whole step's time, like a launch: the sampler's result waits for it. The
        logits [num_rows, vocab] are a view of one row."""
        num_rows = hidden_states.shape[0]
        if self.step_model is None:
            self.timeline.enqueue(
                self.roofline.step(self._query_lens, self._context_lens, num_rows).time_s)
        else:
            cost = self.step_model.step(self._query_lens, self._context_lens, num_rows)
            self.timeline.enqueue(cost.device_s, busy_s=cost.kernel_s)
            self.timeline.hold_host(cost.host_s)
        return self._logits_row.expand(num_rows, self.vocab_size)
