"""Without a compiler the CPU kernels are not built (their callers then keep the torch ops:
test_cpu_linear and test_torch_ops cover those paths)."""

from __future__ import annotations

import os
from pathlib import Path

from pagedserve.kernels import cpu_decode, cpu_extension, cpu_linear


def test_no_compiler_builds_nothing(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-pagedserve")
    assert cpu_extension.build(cpu_linear.EXTENSION_NAME, cpu_linear.SOURCE) is None
    assert cpu_extension.build(cpu_decode.EXTENSION_NAME, cpu_decode.SOURCE) is None


def test_a_killed_builds_lock_does_not_hang_the_next(monkeypatch, tmp_path):
    """torch's `lock` file, left by a build killed halfway, is cleared by the next builder:
    torch would otherwise wait on it forever."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    loads = []

    def load(name, sources, build_directory, **kwargs):
        loads.append(name)
        assert not (Path(build_directory) / "lock").exists()
        # built from copies there, so that another checkout's build commands are the same
        assert [Path(source).parent for source in sources] == [Path(build_directory)]
        assert (Path(build_directory) / "avx512_lanes.h").exists()
        return name

    monkeypatch.setattr(cpp_extension, "load", load)
    for _ in range(2):  # the first leaves a stale lock behind, as a SIGKILL would
        built = cpu_extension.build(cpu_linear.EXTENSION_NAME, cpu_linear.SOURCE)
        (build_directory,) = tmp_path.glob(f"*/{built}")
        (build_directory / "lock").touch()
    assert loads == [built, built]


def test_a_built_kernel_is_loaded_without_a_rebuild(monkeypatch, tmp_path):
    """The sources are copied into the build directory once: a fresh copy's time would make
    ninja compile again in every process."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    times = []

    def load(name, sources, build_directory, **kwargs):
        times.append([Path(source).stat().st_mtime_ns for source in sources])
        return name

    monkeypatch.setattr(cpp_extension, "load", load)
    cpu_extension.build(cpu_decode.EXTENSION_NAME, cpu_decode.SOURCE)
    (copied,) = tmp_path.glob("*/*/paged_decode_cpu.cpp")
    os.utime(copied, ns=(1, 1))
    cpu_extension.build(cpu_decode.EXTENSION_NAME, cpu_decode.SOURCE)
    assert times[1] == [1]


def test_each_torch_install_builds_in_its_own_directory(monkeypatch, tmp_path):
    """ninja's commands name torch's include and library paths: two environments sharing one
    build directory made each rebuild the kernel every time the other had loaded it."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, build_directory, **kw:
                        Path(build_directory))
    directories = []
    for venv in ("/a/.venv", "/b/.venv", "/a/.venv"):
        monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, v=venv: [f"{v}/include"])
        monkeypatch.setattr(cpp_extension, "library_paths", lambda *a, v=venv: [f"{v}/lib"])
        directories.append(cpu_extension.build(cpu_decode.EXTENSION_NAME, cpu_decode.SOURCE))
    assert directories[0] == directories[2] != directories[1]
    assert directories[0].name == directories[1].name  # the same sources, another torch
