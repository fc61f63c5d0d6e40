"""bench.host_tier's workload: the prefixes overflow the device, the requests in flight do not."""

from bench.host_tier import parse_args


def test_the_default_workload_overflows_the_cache_but_fits_the_requests_in_flight():
    args = parse_args([])
    prefix_blocks = args.num_prefixes * args.prefix_len / args.block_size
    assert prefix_blocks == args.cache_multiple * args.num_gpu_blocks
    assert args.in_flight_device_share < 0.6  # about half: no arrival waits for blocks


def test_the_share_in_flight_counts_whole_blocks_of_prompt_and_output():
    args = parse_args(["--num-gpu-blocks", "256", "--num-prefixes", "12", "--concurrency", "4"])
    assert args.prefix_len == 1024
    assert args.in_flight_device_share == 4 * 66 / 256  # 1024 + 16 + 8 tokens: 66 blocks
