"""bench.worker_decode on CPU: a short run decodes every step and takes the forward out."""

from bench import common, worker_decode


def test_smoke_run_records_the_host_work_outside_the_forward(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    out = worker_decode.main(["--batch-size", "3", "--steps", "4", "--repeats", "1",
                              "--tag", "test"])
    result = out["results"][0]
    (host_us,), (forward_us,), (cpu_us,) = (result["host_us_per_step"],
                                            result["forward_us_per_step"],
                                            result["cpu_us_per_step"])
    assert 0 < forward_us < cpu_us and host_us == cpu_us - forward_us
    assert (tmp_path / "worker_decode-test.json").exists()
