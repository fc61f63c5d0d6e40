"""bench.cpu_layer_ops on CPU: a small run on a tiny model times decode steps both ways, with
the same outputs, toggling the layer ops or the linear kernel (which it gives back after)."""

import pytest
from pagedserve.kernels import cpu_layer_ops, cpu_linear

from bench import common
from bench import cpu_layer_ops as bench_cpu_layer_ops


@pytest.mark.skipif(cpu_layer_ops.load() is None or cpu_linear.load() is None,
                    reason="no C++ toolchain or AVX-512 here")
@pytest.mark.parametrize("toggle", ["layer_ops", "linears"])
def test_smoke_run_records_both_ways(toggle, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    max_rows = dict(cpu_linear.max_rows())
    out = bench_cpu_layer_ops.main([
        "--model", str(tiny_model_dir("llama")), "--toggle", toggle, "--batch-sizes", "1", "3",
        "--prompt-len", "8", "--max-tokens", "6", "--skip-steps", "1", "--repeats", "2",
        "--tag", "test"])
    assert [r["batch_size"] for r in out["results"]] == [1, 3]
    for r in out["results"]:
        # the layer ops round as the torch code; BLAS sums in an order of its own
        assert r["outputs_equal"] or toggle == "linears"
        for way in bench_cpu_layer_ops.WAYS:
            # 6 tokens: 1 from the prefill, 5 decode steps, 1 untimed; 2 rounds
            assert r[f"{way}_forward_ms"]["num_steps"] == 8
            assert 0 < r[f"{way}_forward_ms"]["min"] <= r[f"{way}_step_ms_median"]
    assert (tmp_path / "cpu_layer_ops-test.json").exists()
    assert cpu_linear.max_rows() == max_rows
