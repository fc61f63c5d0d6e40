import json

import bench.common
from bench import scheduler_host


def test_scheduler_host_records_each_phase(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    scheduler_host.main(["--batch-sizes", "1", "3", "--prompt-len", "5", "--num-steps", "4",
                         "--repeats", "2", "--tag", "smoke"])
    record = json.loads((tmp_path / "scheduler_host-smoke.json").read_text())
    assert [r["batch_size"] for r in record["results"]] == [1, 3]
    for r in record["results"]:
        assert len(r["ms_per_repeat"]) == 2
        assert r["ms"]["schedule"] == min(run["schedule"] for run in r["ms_per_repeat"]) > 0
        assert r["ms"]["total"] == sum(r["ms"][p] for p in scheduler_host.PHASES)
