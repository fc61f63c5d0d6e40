"""Without a compiler the CPU kernels are not built (their callers then keep the torch ops:
test_cpu_linear and test_torch_ops cover those paths)."""

from __future__ import annotations

from pagedserve.kernels import cpu_decode, cpu_extension, cpu_linear


def test_no_compiler_builds_nothing(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-pagedserve")
    assert cpu_extension.build(cpu_linear.EXTENSION_NAME, cpu_linear.SOURCE) is None
    assert cpu_extension.build(cpu_decode.EXTENSION_NAME, cpu_decode.SOURCE) is None
