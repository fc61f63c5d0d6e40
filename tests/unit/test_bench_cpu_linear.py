"""bench.cpu_linear on CPU: a small run times both ways at one and two rows."""

import pytest
from pagedserve.kernels import cpu_linear

from bench import common
from bench import cpu_linear as bench_cpu_linear


@pytest.mark.skipif(cpu_linear.load() is None, reason="no C++ toolchain or AVX-512 here")
def test_smoke_run_records_both_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setitem(bench_cpu_linear.SHAPES, "tiny", (64, 128, 2, 4, 2, 16, 500))
    out = bench_cpu_linear.main(["--shape", "tiny", "--rows", "1", "2", "--repeats", "2",
                                 "--tag", "test"])
    assert [r["rows"] for r in out["results"]] == [1, 2]
    assert all(len(r[f"{way}_ms"]["all"]) == 2 and r[f"{way}_ms"]["min"] > 0
               for r in out["results"] for way in ("blas", "skinny"))
    assert (tmp_path / "cpu_linear-test.json").exists()
