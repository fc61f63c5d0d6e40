"""The scheduler's side of a KV transfer over scripted workers: an export pins blocks under a
lease that a release or its expiry gives back; a pull adopts the blocks only when every rank
copied them and no worker was rebuilt meanwhile; every failure gives the reserved blocks back
and the request then computes its prompt."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.kv_transfer import KvTransfers
from pagedserve.services.common.engine_api import KVTransferParams
from pagedserve.services.common.errors import Unavailable

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks and one token


class Engine:
    """The part of AsyncEngine a transfer uses: the core's block manager, between steps."""

    def __init__(self) -> None:
        self.num_worker_rebuilds = 0
        block_manager = BlockManager(BS, 8, 2, watermark=0.0, enable_prefix_caching=True)
        self.core = SimpleNamespace(
            block_manager=block_manager, scheduler_epoch=42,
            get_load=lambda: SimpleNamespace(num_worker_rebuilds=self.num_worker_rebuilds))

    def call(self, fn):
        future = asyncio.get_running_loop().create_future()
        future.set_result(fn())
        return future

    def queue(self, fn) -> None:
        fn()


class Puller:
    def __init__(self, engine: Engine, fails: bool = False, rebuilds: bool = False) -> None:
        self.engine, self.fails, self.rebuilds = engine, fails, rebuilds
        self.pulls: list[tuple[str, list[int], list[int]]] = []

    def pull_kv_blocks(self, source_address, src_block_ids, dst_block_ids, scheduler_epoch,
                       timeout_s) -> int:
        assert scheduler_epoch == 42
        self.pulls.append((source_address, src_block_ids, dst_block_ids))
        if self.rebuilds:
            self.engine.num_worker_rebuilds += 1
        if self.fails:
            raise Unavailable("worker 10.0.0.1:50053 is unreachable")
        return 100 * len(dst_block_ids)


def _pull(engine: Engine, workers: list[Puller], params: KVTransferParams) -> int:
    async def body():
        transfers = KvTransfers(engine, ["me:1"], 5.0, workers)
        stats = []
        transfers.on_transfer.append(stats.append)
        num_blocks = await transfers.pull(PROMPT, params)
        await asyncio.sleep(0)  # the adoption queued by the pulls' end
        return num_blocks, stats

    num_blocks, stats = asyncio.run(body())
    assert len(stats) == (1 if any(w.pulls for w in workers) else 0)
    return num_blocks


PARAMS = KVTransferParams(["p0:1", "p1:1"], [7, 8, 9])


def test_every_rank_pulls_from_its_peer_and_the_blocks_are_adopted():
    engine = Engine()
    workers = [Puller(engine), Puller(engine)]
    assert _pull(engine, workers, PARAMS) == 3
    [(source, src, dst)] = workers[1].pulls
    assert source == "p1:1" and src == [7, 8, 9] and workers[0].pulls[0][2] == dst
    bm = engine.core.block_manager
    assert bm.allocate(1, PROMPT) == 3 * BS and bm.block_table(1)[:3] == dst


def test_a_failed_rank_or_a_rebuilt_worker_leaves_nothing_cached_and_every_block_free():
    for workers in ([Puller(None), Puller(None, fails=True)], [Puller(None, rebuilds=True)] * 2):
        engine = Engine()
        for worker in workers:
            worker.engine = engine
        assert _pull(engine, workers, PARAMS) == (3 if workers[0].rebuilds else 0)
        bm = engine.core.block_manager
        assert bm.gpu_pool.num_free_blocks == 8
        assert bm.allocate(1, PROMPT) == 0


def test_no_pull_for_another_rank_count_nothing_offered_or_a_cached_prompt():
    engine = Engine()
    worker = Puller(engine)
    assert _pull(engine, [worker], PARAMS) == 0
    assert _pull(engine, [worker, worker], KVTransferParams(["p0:1", "p1:1"], [])) == 0
    assert worker.pulls == []
    assert _pull(engine, [Puller(engine), Puller(engine)], PARAMS) == 3
    assert _pull(engine, [worker, worker], PARAMS) == 0 and worker.pulls == []


def test_an_export_is_pinned_until_released_or_expired():
    async def body():
        engine = Engine()
        bm = engine.core.block_manager
        num_cached = bm.allocate(1, PROMPT)
        bm.mark_computed(1, PROMPT, len(PROMPT))
        bm.free(1)
        transfers = KvTransfers(engine, ["me:1"], 5.0, [])
        lease_id, params = await transfers.export(PROMPT)
        assert num_cached == 0 and params.worker_addresses == ["me:1"]
        assert len(params.block_ids) == 3 and bm.gpu_pool.num_free_blocks == 5
        assert bm.num_free_gpu_blocks == 5  # pinned: not evictable
        transfers.release(lease_id)
        transfers.release(lease_id)  # twice: ignored
        assert bm.num_free_gpu_blocks == 8
        await transfers.export(PROMPT, lease_ttl_s=0.05)
        assert bm.num_free_gpu_blocks == 5
        await asyncio.sleep(0.2)
        assert bm.num_free_gpu_blocks == 8 and transfers.num_leases == 0
        assert await transfers.export(list(range(500, 513))) == ("", KVTransferParams(["me:1"], []))

    asyncio.run(body())
