"""Worker-to-worker KV block transfer (prefill/decode disaggregation): a decode replica's worker
pulls the blocks a prefill replica's worker computed into blocks its scheduler reserved.

`KvTransport` is the seam: this module's `GrpcKvTransport` streams the blocks through the
source worker's ReadKvBlocks (host memory on both ends, any network); a GPU path (NIXL over
UCX: an RDMA read from the source's registered device memory into this one's) would implement
the same `pull` without the host copies."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import grpc
from pagedserve.services.common.config import TlsConfig
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from pagedserve.services.rpc.status import error_from_rpc
from pagedserve.services.rpc.tls import internal_aio_channel

MAX_MESSAGE_BYTES = 32 << 20  # a ReadKvBlocks message holds whole blocks up to this
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + (1 << 20))]

ReadBlocks = Callable[[list[int]], Awaitable[bytes]]
WriteBlocks = Callable[[list[int], bytes], Awaitable[None]]


class KvTransport(Protocol):
    async def pull(self, source_address: str, src_block_ids: list[int],
                   dst_block_ids: list[int], timeout_s: float) -> int:
        """Copies the source worker's blocks into this worker's; returns the bytes moved."""
        ...


async def read_block_messages(block_ids: list[int], bytes_per_block: int, read: ReadBlocks
                              ) -> AsyncIterator[worker_pb2.ReadKvBlocksResponse]:
    """ReadKvBlocks' answer: whole blocks, at most MAX_MESSAGE_BYTES a message (one block at
    least). They are read at once: one wait between two of the model thread's steps, not one
    per message."""
    data = await read(block_ids)
    per_message = max(1, MAX_MESSAGE_BYTES // max(bytes_per_block, 1))
    for i in range(0, len(block_ids), per_message):
        num_blocks = min(per_message, len(block_ids) - i)
        yield worker_pb2.ReadKvBlocksResponse(
            data=data[i * bytes_per_block:(i + num_blocks) * bytes_per_block] if data else b"",
            num_blocks=num_blocks, bytes_per_block=bytes_per_block)


class GrpcKvTransport:
    def __init__(self, bytes_per_block: Callable[[], int], write: WriteBlocks,
                 tls: TlsConfig | None = None) -> None:
        """`write`: into this worker's cache, between its steps. `tls`: this worker's own
        certificate, which names the worker role the source requires."""
        self._bytes_per_block = bytes_per_block
        self._write = write
        self._tls = tls
        # one channel per source worker, kept: no connection (nor TLS handshake) per transfer
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = internal_aio_channel(address, self._tls,
                                                                     _CHANNEL_OPTIONS)
        return channel

    async def pull(self, source_address: str, src_block_ids: list[int],
                   dst_block_ids: list[int], timeout_s: float) -> int:
        if len(src_block_ids) != len(dst_block_ids):
            raise InvalidRequest(f"src_block_ids has {len(src_block_ids)} blocks, dst_block_ids "
                                 f"{len(dst_block_ids)}; they pair up", field="dst_block_ids")
        own_bytes = self._bytes_per_block()
        num_done = 0
        chunks: list[bytes] = []
        call = worker_pb2_grpc.WorkerServiceStub(self._channel(source_address)).ReadKvBlocks(
            worker_pb2.ReadKvBlocksRequest(block_ids=src_block_ids), timeout=timeout_s)
        try:
            async for msg in call:
                if msg.bytes_per_block != own_bytes:
                    raise InvalidRequest(
                        f"worker {source_address} has KV blocks of {msg.bytes_per_block} "
                        f"bytes, this worker of {own_bytes}: another model, dtype, block size "
                        "or tensor-parallel split", field="source_address")
                chunks.append(msg.data)
                num_done += msg.num_blocks
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"worker {source_address}") from exc
        finally:
            call.cancel()
        if num_done != len(dst_block_ids):
            raise InvalidRequest(f"worker {source_address} sent {num_done} KV blocks of the "
                                 f"{len(dst_block_ids)} asked", field="source_address")
        # one write: one wait between two of the model thread's steps
        await self._write(dst_block_ids, b"".join(chunks))
        return num_done * own_bytes
