"""Host values to the device without waiting for it. A copy from pageable memory
(`torch.tensor(values, device=cuda)`, `tensor.to(cuda)`) synchronizes the stream: the host would
wait there for every kernel queued before, so a step launched while the one before runs on the
device (worker_svc/launch_window.py) would start only once that one is done. A pinned staging
copy (torch caches pinned blocks and keeps each until its copy is done) is queued instead.

Each copy costs the host tens of microseconds on CUDA (a pinned block from the caching host
allocator, which polls the events of the blocks in use; a device block; the copy; an event), so
a step's arrays travel together: `to_device_many` packs them into one pinned buffer, copies it
once and hands out views of the one device buffer."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch

HostValues: TypeAlias = np.ndarray | Sequence

# bytes: where each view starts; Triton specializes a kernel on its pointers' 16-byte
# alignment, which separate allocations always had
_ALIGN = 16


def to_device(values: HostValues, dtype: torch.dtype,
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


def to_device_many(arrays: Sequence[tuple[HostValues, torch.dtype]],
                   device: torch.device) -> list[torch.Tensor]:
    """Each (values, dtype) as a tensor of its shape on the device, all through one copy: views of
    one buffer, each starting at a multiple of 16 bytes, so they must not be resized."""
    if device.type not in ("cpu", "cuda"):
        return [to_device(values, dtype, device) for values, dtype in arrays]
    host_arrays = [np.asarray(values, dtype=_numpy_dtype(dtype)) for values, dtype in arrays]
    offsets, total = [], 0
    for array in host_arrays:
        offsets.append(total)
        total += -(-array.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    host_bytes = host.numpy()
    for array, start in zip(host_arrays, offsets, strict=True):
        host_bytes[start:start + array.nbytes] = array.reshape(-1).view(np.uint8)
    buffer = host if device.type == "cpu" else host.to(device, non_blocking=True)
    # one typed view of the whole buffer per dtype, sliced: a view op costs the host microseconds
    # on CUDA, and three per array were most of this function's time
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for array, (_, dtype), start in zip(host_arrays, arrays, offsets, strict=True):
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer.view(dtype)
        first = start // array.itemsize
        view = whole[first:first + array.size]
        out.append(view if array.ndim == 1 else view.view(array.shape))
    return out


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype
