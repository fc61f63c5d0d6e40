"""Builds a C++ kernel for CPU with torch's cpp_extension, cached per machine
(TORCH_EXTENSIONS_DIR); None where nothing can build it, so callers keep a torch fallback."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)


def _cpu_features() -> str | None:
    """A digest of the host's CPU flags, or None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return hashlib.sha1(flags.encode()).hexdigest()[:10] if flags else None


def build(name: str, source: Path) -> ModuleType | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or shutil.which("ninja") is None:
        logger.info("no %s or ninja: %s is not built, torch ops stand in", compiler, name)
        return None
    # -march=native doubles the kernels' speed; the build is named by the CPU's flags, so a
    # cache shared with another kind of CPU never loads a binary built for this one, and by the
    # source, so checkouts of different versions sharing the cache do not rebuild in turn.
    features = _cpu_features()
    headers = sorted(source.parent.glob("*.h"))  # the sources' shared helpers
    digest = hashlib.sha1(source.read_bytes())
    for header in headers:
        digest.update(header.read_bytes())
    name = f"{name}_{digest.hexdigest()[:10]}"
    cflags = ["-O3", "-fopenmp"]
    if features is not None:
        name, cflags = f"{name}_{features}", [*cflags, "-march=native"]
    import torch
    from torch.utils import cpp_extension
    build_directory = Path(build_root()) / _torch_build_key(torch.__version__, cpp_extension) / name
    try:
        build_directory.mkdir(parents=True, exist_ok=True)
        with _only_builder(build_directory):
            # built from copies, so that checkouts elsewhere with the same sources give ninja
            # the same commands and reuse the build instead of redoing it in turn; copied once
            # (the directory is named by their digest), as a new copy's time makes ninja rebuild
            for path in (source, *headers):
                if not (build_directory / path.name).exists():
                    shutil.copyfile(path, build_directory / path.name)
            source = build_directory / source.name
            return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags,
                                      extra_ldflags=["-fopenmp"],
                                      build_directory=str(build_directory))
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        logger.warning("building %s failed (%s): torch ops stand in", name, exc)
        return None


def build_root() -> str:
    """Where the kernels are built and cached: TORCH_EXTENSIONS_DIR, else torch's default
    under the user's cache folder."""
    from torch.utils import cpp_extension

    return os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()


def _torch_build_key(torch_version: str, cpp_extension: ModuleType) -> str:
    """Python and torch versions, and where this torch lies: its include and library paths are
    in ninja's commands, so two virtual environments sharing one build (CI's clone beside a
    checkout, worktrees with their own .venv path) would each see the other's command as new and
    compile again, in turn, every time either loaded the kernel."""
    paths = "\n".join([*cpp_extension.include_paths(), *cpp_extension.library_paths()])
    where = hashlib.sha1(paths.encode()).hexdigest()[:8]
    return f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch_version}_{where}"


@contextlib.contextmanager
def _only_builder(build_directory: Path) -> Iterator[None]:
    """Holds the build directory alone. torch marks a build in progress with a `lock` file
    that a killed build leaves behind, and every later load then waits on it forever (a CI run
    hung in `make install` so); a flock dies with its process, so whoever holds it knows that
    any `lock` file there is stale."""
    with open(build_directory / "pagedserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_directory / "lock").unlink(missing_ok=True)
        yield
