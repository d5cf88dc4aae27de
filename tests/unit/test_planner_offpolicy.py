"""The planner's separate GPU pools and its off-policy rollout buffer (launchers/planner.py): the pools'
DP and engine count, the refusals, the buffer's host memory by hand, and its bytes per token against the
objects a real buffered trajectory holds."""

from __future__ import annotations

import dataclasses
import json
import random
import sys

import pytest

from launchers.planner import (BUFFER_BYTES_PER_PROMPT_TOKEN, BUFFER_BYTES_PER_RESPONSE_TOKEN, GiB, PlanInput,
                               format_plan, make_plan, plan_from_config)
from megatron_arpo.model_config import load_model_config
from megatron_arpo.rollout.buffer import BufferedGroup
from megatron_arpo.rollout.trajectory import Trajectory


def _qwq(**kw) -> PlanInput:
    args = dict(model=load_model_config("qwq-32b"), nodes=4, gpus_per_node=8, tp=8, pp=2, micro_batch_tokens=20480,
                recompute="full", sequence_parallel=True, engine_tp=4, max_model_len=10192, concurrency=64,
                gpu_memory_utilization=0.85)
    return PlanInput(**(args | kw))


def test_separate_pools_split_the_gpus_and_the_actor_shards_over_its_own_pool():
    colocated = make_plan(_qwq(gpu_memory_utilization=0.47, concurrency=32), suggest=False)
    separate = make_plan(_qwq(placement="separate", actor_devices=16, rollout_devices=16), suggest=False)
    assert (colocated.dp, colocated.actor_gpus, colocated.engine_gpus, colocated.num_engines) == (2, 32, 32, 8)
    assert (separate.dp, separate.actor_gpus, separate.engine_gpus, separate.num_engines) == (1, 16, 16, 4)
    n = separate.params_per_rank[separate.worst_stage]
    # DP 1: the distributed optimizer has nobody to shard with, 12 B per parameter on every rank
    assert separate.actor_gib["optimizer"] == pytest.approx(12 * n / GiB)
    assert colocated.actor_gib["optimizer"] == pytest.approx(12 * n / 2 / GiB)
    assert separate.weight_sync_gib_total == pytest.approx(4 * separate.weight_sync_gib_per_engine)
    text = format_plan(separate)
    assert "GPU pools (separate): actor 16 GPUs (TP 8 x PP 2 x DP 1), engines 16 GPUs (4 engines x TP 4)" \
        in text.splitlines()
    assert "GPU pools" not in format_plan(colocated)  # the colocated output is unchanged (docs/memory.md)
    # a pool smaller than the cluster says what is left unused
    spare = make_plan(_qwq(placement="separate", actor_devices=16, rollout_devices=8), suggest=False)
    assert spare.num_engines == 2 and "engines 8 GPUs (2 engines x TP 4), 8 GPUs unused" in format_plan(spare)
    # one pool given: the other takes the rest
    assert make_plan(_qwq(placement="separate", actor_devices=16), suggest=False).engine_gpus == 16


@pytest.mark.parametrize("kw,message", [
    (dict(actor_devices=24, rollout_devices=16), "both must fit in the 32 GPUs"),
    (dict(rollout_devices=32), "each pool needs a GPU"),
    (dict(actor_devices=8, rollout_devices=24), "the actor pool of 8 GPUs (trainer.actor_devices) is not a multiple "
                                                "of TP*PP = 16"),
    (dict(actor_devices=16, rollout_devices=16, num_engines=5), "= 20 exceeds the engine pool of 16 GPUs"),
])
def test_separate_pools_that_cannot_hold_the_layout_are_refused(kw, message):
    with pytest.raises(ValueError) as err:
        make_plan(_qwq(placement="separate", **kw), suggest=False)
    assert message in str(err.value)


def test_off_policy_buffer_host_memory_by_hand():
    tiny = load_model_config("tiny-qwen3")
    p = PlanInput(model=tiny, nodes=1, gpus_per_node=2, placement="separate", actor_devices=1, rollout_devices=1,
                  micro_batch_tokens=64, max_model_len=8, concurrency=1, mode="off_policy", n=2, prompt_tokens=3,
                  response_tokens=5, train_batch_size=4, max_staleness=1)
    # per trajectory 3 x 40 + 5 x 96 = 600 B; (1 + 1) x 4 = 8 groups x 2 = 16 trajectories; the batch 4 x 2
    plan = make_plan(p, suggest=False)
    b = plan.buffer_gib
    assert (b["groups"], b["trajectories"], b["bytes_per_trajectory"]) == (8, 16, 600)
    assert (b["buffer"] * GiB, b["batch"] * GiB, b["total"] * GiB) == pytest.approx((9600, 4800, 14400))
    assert plan.fits_host is None and plan.fits
    lines = format_plan(plan).splitlines()
    assert ("rollout buffer (off_policy, the driver's host memory on the head node): 8 groups ((1 + 1) x 4) x 2 "
            "trajectories x (3 prompt x 40 B + 5 response tokens x 96 B) = 0.0 GiB") in lines
    assert any(line.startswith("  with the batch being trained (4 groups") and line.endswith("not checked")
               for line in lines)
    explicit = make_plan(dataclasses.replace(p, buffer_groups=5), suggest=False)
    assert explicit.buffer_gib["buffer"] * GiB == pytest.approx(5 * 2 * 600)
    # a node of 14400 B / 0.9 holds it exactly (10% headroom); one byte less does not
    room = 14400 / 0.9 / GiB
    assert make_plan(dataclasses.replace(p, host_memory_gib=room * 1.0001), suggest=False).fits_host
    short = make_plan(dataclasses.replace(p, host_memory_gib=room * 0.999), suggest=False)
    assert short.fits_host is False and not short.fits
    held = [line for line in format_plan(short).splitlines() if line.startswith("  with the batch being trained")]
    assert held[0].endswith("(launcher.memory_per_node, 10% headroom) -> DOES NOT FIT")
    sync = make_plan(dataclasses.replace(p, mode="sync"), suggest=False)
    assert sync.buffer_gib == {} and "rollout buffer" not in format_plan(sync)


def _object_bytes(obj, seen: set) -> int:
    """CPython bytes of a list and its distinct non-cached items, in pymalloc's 16 B blocks."""
    total = sys.getsizeof(obj)
    for x in obj:
        if id(x) in seen or (isinstance(x, int) and -5 <= x <= 256):  # small ints are shared singletons
            continue
        seen.add(id(x))
        total += -(-sys.getsizeof(x) // 16) * 16
    return total


def test_buffer_bytes_per_token_match_a_resumed_buffers_trajectories():
    """The planner's bytes per token against the objects of real trajectories restored from a checkpoint
    (every token its own object: the planner's worst case)."""
    rng = random.Random(0)
    prompt_len, response_len, n = 300, 1200, 4
    trajectories = []
    for k in range(n):
        t = Trajectory(prompt_id="p0", prompt_index=0, traj_id=f"p0-{k}", index=k, origin="initial", parent_id=None,
                       branch_offset=None, prompt_token_ids=[rng.randrange(1000, 150000) for _ in range(prompt_len)])
        for start in range(0, response_len, 100):  # segments, then a tool result (not sampled: mask 0)
            tokens = [rng.randrange(1000, 150000) for _ in range(100)]
            if start % 300 == 200:
                t.append(tokens, [0.0] * 100, 0)
            else:
                t.append(tokens, [-rng.random() for _ in range(100)], 1, versions=start // 300)
        trajectories.append(t)
    group = BufferedGroup("p0", list(trajectories[0].prompt_token_ids), 7, trajectories)
    restored = BufferedGroup.from_dict(json.loads(json.dumps(group.to_dict())))  # the resume path
    seen: set = set()
    measured = sum(_object_bytes(getattr(t, name), seen) for t in restored.trajectories
                   for name in ("prompt_token_ids", "response_ids", "response_logprobs", "loss_mask", "token_versions"))
    planned = n * (prompt_len * BUFFER_BYTES_PER_PROMPT_TOKEN + response_len * BUFFER_BYTES_PER_RESPONSE_TOKEN)
    assert 0.95 <= measured / planned <= 1.1, (measured, planned)


def test_plan_from_config_reads_the_pools_the_mode_and_the_node_memory():
    raw = {"model": {"config": "qwq-32b"},
           "actor": {"tensor_parallel": 8, "pipeline_parallel": 2, "recompute": "full", "sequence_parallel": True,
                     "micro_batch_tokens": 20480},
           "rollout": {"tensor_parallel": 4, "num_engines": 4, "gpu_memory_utilization": 0.85, "n": 16,
                       "response_length": 8192, "max_num_seqs": 64, "max_staleness": 2},
           "data": {"max_prompt_tokens": 2000},
           "trainer": {"placement": "separate", "mode": "off_policy", "actor_devices": 16, "rollout_devices": 16,
                       "train_batch_size": 64},
           "launcher": {"nodes": 4, "gpus_per_node": 8, "memory_per_node": "480G"}}
    plan = plan_from_config(raw)
    assert (plan.dp, plan.num_engines, plan.inputs["host_memory_gib"]) == (1, 4, 480.0)
    per_trajectory = 2000 * 40 + 8192 * 96
    assert plan.buffer_gib["groups"] == 3 * 64
    assert plan.buffer_gib["total"] == pytest.approx((3 + 1) * 64 * 16 * per_trajectory / GiB)
    assert plan.fits_host and plan.fits
    assert "of the node's 480 GiB (launcher.memory_per_node, 10% headroom) -> fits" in format_plan(plan)
