"""pagedserve: LLM serving with a paged KV cache, as gRPC microservices.

    from pagedserve import LLM, SamplingParams          # offline, in this process
    from pagedserve import StructuredOutputsParams      # SamplingParams(structured_outputs=...)
    from pagedserve import Client, AsyncClient          # a client of a running gateway

A wheel installs the layers (services, scheduler_svc, worker_svc, kernels) inside this package;
in a source checkout they are the folders beside it, found through __path__.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "services").is_dir():
    __path__.append(str(_checkout))

if TYPE_CHECKING:
    from pagedserve.client import AsyncClient, Client, ClientError, RetryPolicy
    from pagedserve.llm import LLM
    from pagedserve.services.common.sampling_params import SamplingParams
    from pagedserve.services.common.structured_outputs import StructuredOutputsParams

_CLIENT_NAMES = ("AsyncClient", "Client", "ClientError", "RetryPolicy")
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "AsyncClient", "Client", "ClientError", "RetryPolicy"]


def __getattr__(name: str) -> object:
    # lazy, so that a service importing pagedserve.services.* does not load the offline engine
    if name == "LLM":
        from pagedserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pagedserve.services.common.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from pagedserve.services.common.structured_outputs import StructuredOutputsParams
        return StructuredOutputsParams
    if name in _CLIENT_NAMES:
        import pagedserve.client

        return getattr(pagedserve.client, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
