import pytest


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir):
    """The tiny random-weight Llama most integration tests run on."""
    return tiny_model_dir("llama")
