"""A step launched while the one before is in flight, and its sampling, never copy host values to
the device in a way that waits for the device: on CUDA such a copy (`torch.tensor(values,
device=...)`, `tensor.to(device)` from pageable memory) synchronizes the stream, so the launch
would start only once the step in flight is done and the device would idle through the host's
work (bench.offline_gpu on an H100: ~1.6 ms a Llama-3-8B decode step). On CPU the calls are seen
by a torch function mode, whatever the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.host_to_device import to_device, to_device_many
from torch.overrides import TorchFunctionMode

from tests.integration.worker_driver import make_worker, prefill_then_decodes

BLOCK_SIZE = 8
NUM_DECODE_STEPS = 6
SAMPLINGS = [
    SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=32, ignore_eos=True, logprobs=2),
    # every logits processor: penalties, min_tokens, logit bias, bad words, top-k/top-p, min-p
    SamplingParams(temperature=0.8, seed=3, max_tokens=32, min_tokens=4, top_k=20, top_p=0.9,
                   min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.5,
                   presence_penalty=0.3, logit_bias={40: 2.0}, bad_words_token_ids=((41,),),
                   stop_token_ids=[42]),
    SamplingParams(temperature=0.0, max_tokens=32, allowed_token_ids=[50, 51, 52]),
]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27, 28, 29], [31, 32]]


class BlockingCopies(TorchFunctionMode):
    """Records each call that copies host values to a device without non_blocking=True."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.calls.append(f"torch.{name}(..., device={kwargs['device']})")
        elif name in ("to", "cuda") and not kwargs.get("non_blocking") and (
                "device" in kwargs or any(isinstance(a, str | torch.device) for a in args[1:])):
            self.calls.append(f"Tensor.{name}{tuple(map(str, args[1:]))}")
        return func(*args, **kwargs)


def test_steps_launched_ahead_and_their_sampling_never_wait_for_the_device(tiny_model_dir):
    worker = make_worker(tiny_model_dir("llama"), block_size=BLOCK_SIZE)
    plans = prefill_then_decodes(PROMPTS, SAMPLINGS, NUM_DECODE_STEPS, BLOCK_SIZE)
    in_flight = worker.launch_step(plans[0])
    worker.sample_step(in_flight)
    outputs = []
    with BlockingCopies() as copies:
        for plan in plans[1:]:
            ahead = worker.launch_step(plan, ahead_of=in_flight)
            assert ahead.model_input.drawn_rows  # its inputs read the draws on the device
            outputs.append(worker.finish_step(in_flight))
            worker.sample_step(ahead)
            in_flight = ahead
    outputs.append(worker.finish_step(in_flight))
    assert copies.calls == []
    assert [sorted(out.sampled_by_seq()) for out in outputs] == [[0, 1, 2, 3]] * len(outputs)
    assert all(t in (50, 51, 52) for out in outputs for t in out.sampled_by_seq()[3].token_ids)


@pytest.mark.parametrize("values, dtype", [([3, 1, 2], torch.int64), ([0.5, 2.0], torch.float32),
                                           (np.arange(4, dtype=np.int64), torch.int32)])
def test_to_device_keeps_the_values_in_the_dtype_asked(values, dtype):
    tensor = to_device(values, dtype, torch.device("cpu"))
    assert tensor.dtype == dtype and tensor.tolist() == list(values)


def test_to_device_many_gives_each_array_its_dtype_shape_and_values_through_one_buffer():
    arrays = [([3, 1, 2], torch.int64), (np.arange(6, dtype=np.int64).reshape(2, 3), torch.int32),
              ([], torch.int64), (np.array([7], np.int32), torch.int64), ([0.5, 2.0], torch.float32)]
    tensors = to_device_many(arrays, torch.device("cpu"))
    assert [(t.dtype, tuple(t.shape), t.tolist()) for t in tensors] == [
        (torch.int64, (3,), [3, 1, 2]), (torch.int32, (2, 3), [[0, 1, 2], [3, 4, 5]]),
        (torch.int64, (0,), []), (torch.int64, (1,), [7]), (torch.float32, (2,), [0.5, 2.0])]
    storage = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in tensors)
    # every view starts on a 16-byte boundary (Triton's pointer specialization), none overlaps
    tensors = [t for t in tensors if t.numel()]  # an empty one has no data pointer
    starts = [t.data_ptr() - storage for t in tensors]
    assert all(start % 16 == 0 for start in starts)
    ends = [start + t.numel() * t.element_size() for start, t in zip(starts, tensors, strict=True)]
    assert all(end <= later for end, later in zip(ends, starts[1:], strict=False))
    tensors[0][1] = 9  # a write to one view leaves the others as they were
    assert tensors[1].tolist() == [[0, 1, 2], [3, 4, 5]]
