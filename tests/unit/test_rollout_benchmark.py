"""The rollout benchmark's tool-call claim holds (deterministic with zero latencies), and the scheduler
options map from the config's rollout section."""

import asyncio

import pytest

from megatron_arpo.rollout.engine import EngineConfig
from megatron_arpo.rollout.scheduler import RolloutOptions
from support.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/rollout.py", "rollout_benchmark")


def test_arpo_needs_at_most_0_6x_the_tool_calls_of_grpo(bench):
    args = bench.argparse.Namespace(num_prompts=8, n=8, seed=0, tool_ms=0.0, slow_tool_ms=0.0, slow_fraction=0.2,
                                    engine_ms=0.0, token_ms=0.0)

    async def both():
        return (await bench.run_config(args, 4, "async"), await bench.run_config(args, 8, "async"),
                await bench.run_config(args, 4, "async", profile="flat"))

    arpo, grpo, flat = asyncio.run(both())
    assert arpo["branches"] > 0 and grpo["branches"] == 0
    assert arpo["tool_calls_per_prompt"] <= 0.6 * grpo["tool_calls_per_prompt"]
    # The saving comes from where the entropy is high: without the signal it shrinks.
    assert flat["tool_calls_per_prompt"] > arpo["tool_calls_per_prompt"]
    # Branches share their parent's prefix: fewer prefill tokens computed than GRPO.
    assert (arpo["engine_prefill_tokens"] - arpo["engine_cache_hit_tokens"]
            < grpo["engine_prefill_tokens"] - grpo["engine_cache_hit_tokens"])


def test_options_and_engine_config_map_from_the_rollout_section():
    from megatron_arpo.config import RolloutSection

    section = RolloutSection(n=6, initial_rollouts=3, branch_timing="reference", scheduler="barrier", seed=7,
                             tensor_parallel=2, cpu_kv_cache_gib=2.0)
    opts = RolloutOptions.from_config(section)
    assert (opts.n, opts.initial_rollouts, opts.branch_timing, opts.scheduler, opts.seed) == (6, 3, "reference", "barrier", 7)
    assert opts.call_limit == section.call_limit and opts.entropy_window == section.entropy_window
    cfg = EngineConfig.from_rollout_section("/models/x", section, dtype="bfloat16")
    assert (cfg.tensor_parallel_size, cfg.cpu_kv_cache_gib, cfg.seed, cfg.dtype) == (2, 2.0, 7, "bfloat16")
    with pytest.raises(ValueError, match="initial_rollouts=9 exceeds rollout.n=6"):
        RolloutOptions.from_config(section, initial_rollouts=9)
    with pytest.raises(ValueError, match="branch_timing"):
        RolloutOptions(branch_timing="later")
