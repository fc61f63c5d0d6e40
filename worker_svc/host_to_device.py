"""Host values to the device without waiting for it. A copy from pageable memory
(`torch.tensor(values, device=cuda)`, `tensor.to(cuda)`) synchronizes the stream: the host would
wait there for every kernel queued before, so a step launched while the one before runs on the
device (worker_svc/launch_window.py) would start only once that one is done. A pinned staging
copy (torch caches pinned blocks and keeps each until its copy is done) is queued instead."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    if device.type not in ("cpu", "cuda"):  # the simulator's trace: meta
        return torch.as_tensor(values, dtype=dtype, device=device)
    if isinstance(values, np.ndarray):
        tensor = torch.from_numpy(values)
        tensor = tensor if tensor.dtype == dtype else tensor.to(dtype)
    else:
        tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
