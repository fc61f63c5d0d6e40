"""The CPU linear kernel for decode batch sizes against F.linear: row counts off its 4-row tile,
output sizes off its 4-column tile, input sizes off its 16-lane (fp32) or 32-lane (bf16) stride,
with and without bias; and the inputs it hands to F.linear. Kernel cases skip where it cannot be
built (no compiler or no AVX-512), bf16 ones where the CPU has no AVX512-BF16: `linear` then is
F.linear, which the fallback test covers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu_linear

from tests.kernels.gil import python_runs_during

KERNEL = cpu_linear.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain or AVX-512 here")
FP32_ROWS = cpu_linear.MAX_ROWS[torch.float32]
BF16_ROWS = cpu_linear.MAX_ROWS[torch.bfloat16]
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    torch.bfloat16 not in cpu_linear.max_rows(), reason="no AVX512-BF16 here"))]
# bf16: with a bias, the kernel rounds the product before adding it, oneDNN after
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-4},
              torch.bfloat16: {"rtol": 1.6e-2, "atol": 0.1}}


@needs_kernel
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 7, 16, FP32_ROWS])
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 1536), (13, 40), (3, 576),
                                                           (5, 70)])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_f_linear(num_rows, out_features, in_features, has_bias, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(num_rows * 7 + out_features + in_features)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if has_bias else None
    monkeypatch.setitem(cpu_linear.max_rows(), dtype, FP32_ROWS)  # every row count on the kernel
    with torch.inference_mode():
        out = cpu_linear.linear(x, weight, bias)
    assert out.shape == (num_rows, out_features) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, weight, bias), **TOLERANCES[dtype])


@needs_kernel
def test_non_contiguous_input():
    x = torch.randn(8, 2 * 64)[:, ::2]  # [8, 64], strided rows
    weight = torch.randn(20, 64)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear.linear(x, weight), F.linear(x, weight),
                                   rtol=1e-5, atol=1e-4)


@needs_kernel
def test_other_threads_run_while_it_computes():
    x, weight = torch.randn(8, 4096), torch.randn(4096, 4096)  # 64 MB: milliseconds a call
    out = torch.empty(8, 4096)
    assert python_runs_during(lambda: KERNEL.skinny_linear(out, x, weight))


@needs_kernel
def test_kernel_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="shapes"):
        KERNEL.skinny_linear(torch.empty(2, 3), torch.randn(2, 5), torch.randn(3, 4))


@needs_kernel
@pytest.mark.parametrize(("dtype", "num_rows"), [(torch.float32, 1), (torch.float32, FP32_ROWS),
                                                 *((torch.bfloat16, n) for n in (1, BF16_ROWS))])
def test_decode_rows_take_the_kernel(dtype, num_rows, monkeypatch):
    if dtype not in cpu_linear.max_rows():
        pytest.skip("no AVX512-BF16 here")
    monkeypatch.setattr(cpu_linear.F, "linear", None)  # any call fails
    with torch.inference_mode():
        assert cpu_linear.linear(torch.randn(num_rows, 48, dtype=dtype),
                                 torch.randn(10, 48, dtype=dtype)).shape == (num_rows, 10)


@pytest.mark.parametrize("case", ["no_rows", "many_rows", "many_bf16_rows", "fp16",
                                  "grad", "no_kernel"])
def test_other_inputs_take_f_linear(case, monkeypatch):
    num_rows = {"no_rows": 0, "many_rows": FP32_ROWS + 1,
                "many_bf16_rows": BF16_ROWS + 1}.get(case, 4)
    dtype = {"fp16": torch.float16, "many_bf16_rows": torch.bfloat16}.get(case, torch.float32)
    x = torch.randn(num_rows, 48, dtype=dtype)
    weight = torch.randn(10, 48, dtype=dtype)
    if case == "no_kernel":
        monkeypatch.setattr(cpu_linear, "load", lambda: None)
    calls, f_linear = [], F.linear
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: calls.append(a) or f_linear(*a))
    with torch.inference_mode(case != "grad"):
        out = cpu_linear.linear(x, weight)
    assert len(calls) == 1 and torch.equal(out, f_linear(x, weight))
