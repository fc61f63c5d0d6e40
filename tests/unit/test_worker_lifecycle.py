"""Worker lifecycle and its errors: unknown architectures, stale epochs, calls and steps out of order,
dummy weights, what WorkerInfo reports."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import pytest
import torch
from pagedserve.services.common.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from pagedserve.services.common.errors import (
    ConfigError,
    InvalidRequest,
    NotFound,
    StaleEpoch,
    StepOutOfOrder,
    Unavailable,
)
from pagedserve.services.common.step_plan import RunningSequence, StepPlan
from pagedserve.worker_svc.worker import MAX_EPOCH_LEAD_S, Worker

from tests.integration.worker_driver import Driver, make_worker


def _config(path, **model_kw) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(path), **model_kw),
                        cache=CacheConfig(num_gpu_blocks_override=16, num_cpu_blocks_override=4),
                        device=DeviceConfig(device="cpu", attention_backend="ref"))


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["MambaForCausalLM"], "model_type": "llama", "vocab_size": 8}))
    with pytest.raises(ConfigError) as err:
        Worker(_config(tmp_path)).load_model()
    message = str(err.value)
    assert "MambaForCausalLM" in message
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "OPTForCausalLM"):
        assert arch in message


def test_missing_model_folder_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        Worker(_config(tmp_path / "nope")).load_model()


def test_worker_info_reports_model_shape(tiny_model_dir, tmp_path):
    path = tmp_path / "qwen3"
    shutil.copytree(tiny_model_dir("qwen3"), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    info = Worker(_config(path)).load_model()
    assert (info.architecture, info.vocab_size, info.max_model_len) == ("Qwen3ForCausalLM", 256, 512)
    assert (info.num_layers, info.num_kv_heads, info.head_size) == (2, 2, 32)
    assert info.eos_token_ids == [2, 7]
    assert (info.device, info.dtype, info.attention_backend) == ("cpu", "float32", "ref")
    assert Worker(_config(path, max_model_len=100)).load_model().max_model_len == 100
    with pytest.raises(ConfigError, match="max_model_len=1000"):
        Worker(_config(path, max_model_len=1000)).load_model()


def test_calls_out_of_order_are_unavailable(tiny_model_dir):
    worker = Worker(_config(tiny_model_dir("llama")))
    with pytest.raises(Unavailable):
        worker.get_info()
    worker.load_model()
    with pytest.raises(Unavailable, match="init_cache"):
        worker.execute_step(StepPlan(scheduler_epoch=0, step_id=1))
    with pytest.raises(Unavailable, match="init_cache"):  # a restarted worker: rebuild it
        worker.clear_state(scheduler_epoch=1)
    with pytest.raises(InvalidRequest, match="num_gpu_blocks"):
        worker.init_cache(0, 0, scheduler_epoch=1)


def test_only_the_handshake_epoch_is_served(tiny_model_dir):
    """Steps and ClearState must carry the epoch of the scheduler's handshake: an older one (a
    predecessor) or a newer one (2**64 - 1 included: no caller locks the scheduler out) is
    refused without telling the worker's epoch, and the worker keeps serving its scheduler."""
    epoch = 1_700_000_000_000_003  # the clock's, as EngineCore makes them
    driver = Driver(make_worker(tiny_model_dir("llama"), epoch=epoch), epoch=epoch)
    driver.add(0, [5, 6, 7])
    driver.step({0: 3})
    for other in (epoch - 1, epoch + 1, 2**64 - 1):
        with pytest.raises(StaleEpoch, match=f"scheduler_epoch={other}") as refused:
            driver.worker.execute_step(StepPlan(scheduler_epoch=other, step_id=9))
        assert str(epoch) not in str(refused.value)
        with pytest.raises(StaleEpoch) as refused:
            driver.worker.clear_state(other)
        assert str(epoch) not in str(refused.value)
    driver.step({0: 1})  # still serving, its sequence intact
    driver.worker.clear_state(epoch)
    delta = RunningSequence(seq_id=0, new_token_ids=[1], block_ids_start=1, block_ids=[],
                            num_scheduled_tokens=1)
    with pytest.raises(NotFound, match="seq_id 0"):  # forgotten
        driver.worker.execute_step(StepPlan(scheduler_epoch=epoch, step_id=10,
                                            running_seqs=[delta]))


def test_a_newer_scheduler_takes_over_by_the_handshake(tiny_model_dir):
    epoch = 1_700_000_000_000_003
    driver = Driver(make_worker(tiny_model_dir("llama"), epoch=epoch), epoch=epoch)
    cache = driver.worker.cache_engine
    num_gpu_blocks, num_cpu_blocks = cache.num_gpu_blocks, cache.num_cpu_blocks
    with pytest.raises(StaleEpoch):  # an earlier scheduler cannot take it back
        driver.worker.init_cache(num_gpu_blocks, num_cpu_blocks, epoch - 1)
    driver.worker.init_cache(num_gpu_blocks, num_cpu_blocks, epoch + 1)
    with pytest.raises(StaleEpoch):  # the old scheduler's steps no longer run
        driver.step({})
    driver.epoch, driver.step_id = epoch + 1, 0
    driver.add(0, [5, 6, 7])
    assert len(driver.step({0: 3}).sampled_by_seq()[0].token_ids) == 1


def test_an_epoch_ahead_of_the_clock_cannot_lock_the_worker_away(tiny_model_dir):
    """InitCache(scheduler_epoch=2**64 - 1) once took a worker from its scheduler for good: no
    scheduler started later could take it back. Now such a handshake is refused, the scheduler
    keeps the worker, and the next scheduler to start takes it over."""
    epoch = time.time_ns() // 1000
    driver = Driver(make_worker(tiny_model_dir("llama"), epoch=epoch), epoch=epoch)
    cache = driver.worker.cache_engine
    sizes = cache.num_gpu_blocks, cache.num_cpu_blocks
    driver.add(0, [5, 6, 7])
    driver.step({0: 3})
    ahead = (time.time_ns() // 1000) + int((MAX_EPOCH_LEAD_S + 60) * 1e6)
    for bogus in (2**64 - 1, ahead):
        with pytest.raises(InvalidRequest, match=f"scheduler_epoch={bogus} lies .* ahead"):
            driver.worker.init_cache(*sizes, bogus)
    driver.step({0: 1})  # its scheduler still drives it
    restarted = time.time_ns() // 1000
    assert driver.worker.init_cache(*sizes, restarted)  # kept its cache
    driver.epoch, driver.step_id = restarted, 0
    driver.add(0, [5, 6, 7])
    assert len(driver.step({0: 3}).sampled_by_seq()[0].token_ids) == 1


def test_steps_run_only_in_their_previous_step_id_order(tiny_model_dir):
    driver = Driver(make_worker(tiny_model_dir("llama")))
    driver.add(0, [5, 6, 7])
    driver.step({0: 3})
    ahead = driver.plan({0: 1})
    with pytest.raises(StepOutOfOrder, match="must follow step 5, but the worker's last step is 1"):
        driver.worker.execute_step(dataclasses.replace(ahead, previous_step_id=5))
    with pytest.raises(NotFound):  # a step refused before it runs ...
        driver.worker.execute_step(dataclasses.replace(ahead, running_seqs=[
            dataclasses.replace(ahead.running_seqs[0], seq_id=99)]))
    with pytest.raises(StepOutOfOrder, match="last step is 1"):  # ... is not a step that ran
        driver.worker.execute_step(dataclasses.replace(ahead, step_id=3, previous_step_id=2))
    driver.worker.steps.has_failed = True  # as after a step that raised while running
    with pytest.raises(StepOutOfOrder, match="which failed"):
        driver.worker.execute_step(ahead)
    driver.worker.clear_state(driver.epoch)
    assert driver.worker.steps.last_step_id == 0 and not driver.worker.steps.has_failed


def test_dummy_weights_need_no_checkpoint_and_are_seeded(tiny_model_dir, tmp_path):
    path = tmp_path / "config_only"
    path.mkdir()
    shutil.copy(tiny_model_dir("llama") / "config.json", path / "config.json")
    params = []
    for seed in (0, 0, 1):
        worker = Worker(_config(path, load_format="dummy", seed=seed))
        worker.load_model()
        params.append(dict(worker.runner.model.named_parameters()))
    real = Worker(_config(tiny_model_dir("llama")))
    real.load_model()
    for name, param in real.runner.model.named_parameters():
        assert params[0][name].shape == param.shape
        assert torch.equal(params[0][name], params[1][name])
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(params[0][qkv], params[2][qkv])
    # a dummy model still runs a step
    driver = Driver(make_worker(path, load_format="dummy"))
    driver.add(0, [1, 2, 3])
    assert len(driver.step({0: 3}).sampled_by_seq()[0].token_ids) == 1


@pytest.mark.parametrize("cache_ops", [{"blocks_to_swap_out": [(0, 5)]},
                                       {"blocks_to_swap_in": [(5, 0)]},
                                       {"blocks_to_copy": [(9, 1)]}])
def test_a_step_with_block_ids_out_of_range_fails(tiny_model_dir, cache_ops):
    worker = make_worker(tiny_model_dir("llama"), num_gpu_blocks=8, num_cpu_blocks=2)
    with pytest.raises(InvalidRequest, match="out of range"):
        worker.execute_step(StepPlan(scheduler_epoch=1, step_id=1, **cache_ops))
