"""bench.penalties on CPU: a small case times both ways and checks their logits equal."""

from bench import common, penalties


def test_smoke_run_records_both_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    out = penalties.main(["--cases", "3x40x64", "--steps", "2", "--tag", "test"])
    (result,) = out["results"]
    assert result["num_rows"] == 3 and result["kept_rows"] == 8
    assert all(result[k][way] > 0 for k in ("host_ms", "step_ms") for way in ("scratch", "kept"))
    assert (tmp_path / "penalties-test.json").exists()
