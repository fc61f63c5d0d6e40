"""`serve --api-server-count`: a count, or 0 / auto for one gateway per CPU left beside the
schedulers; anything else is refused naming the flag."""

import os

import pytest

from pagedserve.cli import build_parser
from pagedserve.supervisor import resolve_api_server_count


@pytest.mark.parametrize(("given", "parsed"), [("3", 3), ("auto", 0), ("0", 0)])
def test_the_flag_takes_a_count_or_auto(given, parsed):
    assert build_parser().parse_args(["serve", "--api-server-count", given]).api_server_count \
        == parsed


@pytest.mark.parametrize("given", ["-1", "many"])
def test_a_bad_count_is_refused_naming_the_flag(given, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--api-server-count", given])
    assert "--api-server-count" in capsys.readouterr().err


def test_auto_leaves_a_cpu_to_each_scheduler_and_starts_at_least_one():
    num_cpus = len(os.sched_getaffinity(0))
    assert resolve_api_server_count(0, 1) == max(1, num_cpus - 1)
    assert resolve_api_server_count(0, num_cpus + 4) == 1
    assert resolve_api_server_count(5, 1) == 5
    with pytest.raises(ValueError, match="api_server_count must be >= 0, got -2"):
        resolve_api_server_count(-2, 1)
