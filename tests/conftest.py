import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import ARCHITECTURES, make_tiny_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """arch → folder of a tiny random-weight HF model, built once per session."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, root / arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session", params=ARCHITECTURES)
def tiny_arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model (`make model`); tests that need it skip without it."""
    from pagedserve.services.common.config import default_model_dir

    path = Path(os.environ.get("PAGEDSERVE_TEST_MODEL") or default_model_dir())
    if not (path / "config.json").exists():
        pytest.skip(f"default model not prepared at {path} (run `make model`)")
    return path
