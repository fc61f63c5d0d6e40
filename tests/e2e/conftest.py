from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pagedserve.services.common.config import EngineConfig
from pagedserve.services.rpc.internal.v1 import scheduler_pb2_grpc
from pagedserve.services.rpc.v1 import gateway_pb2_grpc

from tests import tiny_models
from tests.e2e.stack import Stack, start_stack, tiny_config


@pytest.fixture(scope="session")
def tiny_served_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama with a real (tiny, byte-level BPE) tokenizer and a chat
    template, so the gateway can serve it: vocab 512 covers the tokenizer's 400 ids."""
    return tiny_models.make_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_odd_vocab_model_dir(tmp_path_factory) -> Path:
    """The same with 510 embedding rows: split over 4 tensor-parallel ranks, the last one holds
    126 rows and 2 of padding."""
    path = tmp_path_factory.mktemp("served") / "tiny-llama-510"
    return tiny_models.make_served_model(path, vocab_size=510)


@pytest.fixture(scope="module")
def stack_config(tiny_served_model_dir) -> EngineConfig:
    """The engine config of the module's `stack`; a test module overrides this fixture (asking
    for `stack_config` to start from this one) to serve with other limits."""
    return tiny_config(tiny_served_model_dir)


@pytest.fixture(scope="module")
def stack_options() -> dict:
    """More `start_stack` arguments for the module's `stack` (gateway fields, metrics, TLS); a
    test module overrides this fixture, which may ask for fixtures that must be set up first."""
    return {}


@pytest.fixture(scope="module")
def stack(stack_config, stack_options) -> Iterator[Stack]:
    """Worker, scheduler and gateway over loopback, shared by the tests of one module."""
    with start_stack(stack_config, **stack_options) as stack:
        yield stack


@pytest.fixture()
def generation(stack):
    with grpc.insecure_channel(stack.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture()
def scheduler(stack):
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        yield scheduler_pb2_grpc.SchedulerServiceStub(channel)
