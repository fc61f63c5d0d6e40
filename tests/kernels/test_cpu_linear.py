"""The CPU linear kernel for decode batch sizes against F.linear: row counts off its 4-row tile,
output sizes off its 4-column tile, input sizes off its 16-lane stride, with and without bias;
and the inputs it hands to F.linear. Kernel cases skip where it cannot be built (no compiler or
no AVX-512): `linear` then is F.linear, which the fallback test covers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu_linear

from tests.kernels.gil import python_runs_during

KERNEL = cpu_linear.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain or AVX-512 here")


@needs_kernel
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 7, 16, cpu_linear.MAX_ROWS])
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 1536), (13, 40), (3, 576)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_matches_f_linear(num_rows, out_features, in_features, has_bias):
    gen = torch.Generator().manual_seed(num_rows * 7 + out_features + in_features)
    x = torch.randn(num_rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if has_bias else None
    with torch.inference_mode():
        out = cpu_linear.linear(x, weight, bias)
    assert out.shape == (num_rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


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
@pytest.mark.parametrize("num_rows", [1, cpu_linear.MAX_ROWS])
def test_decode_rows_take_the_kernel(num_rows, monkeypatch):
    monkeypatch.setattr(cpu_linear.F, "linear", None)  # any call fails
    with torch.inference_mode():
        assert cpu_linear.linear(torch.randn(num_rows, 48), torch.randn(10, 48)).shape == (
            num_rows, 10)


@pytest.mark.parametrize("case", ["no_rows", "many_rows", "bf16", "grad", "no_kernel"])
def test_other_inputs_take_f_linear(case, monkeypatch):
    num_rows = {"no_rows": 0, "many_rows": cpu_linear.MAX_ROWS + 1}.get(case, 4)
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    x = torch.randn(num_rows, 48, dtype=dtype)
    weight = torch.randn(10, 48, dtype=dtype)
    if case == "no_kernel":
        monkeypatch.setattr(cpu_linear, "load", lambda: None)
    calls, f_linear = [], F.linear
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: calls.append(a) or f_linear(*a))
    with torch.inference_mode(case != "grad"):
        out = cpu_linear.linear(x, weight)
    assert len(calls) == 1 and torch.equal(out, f_linear(x, weight))
