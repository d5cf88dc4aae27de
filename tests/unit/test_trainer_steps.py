"""The pure parts of the RL step (megatron_arpo.trainer.steps / runtime): batches, prompts, step counts."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from megatron_arpo.config import build_config
from megatron_arpo.data.sampler import EpochSampler
from megatron_arpo.rollout.scheduler import RolloutResult
from megatron_arpo.rollout.trajectory import ToolCall, Trajectory
from megatron_arpo.trainer import runtime, steps


def config(**sections):
    raw = {"model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 64}, "data": {"max_prompt_tokens": 64},
           "tools": {"search": {"enabled": False}}, "launcher": {"gpus_per_node": 0},
           "trainer": {"train_batch_size": 4}, "actor": {"mini_batch_size": 2}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return build_config(raw)


def traj(prompt_index, k, reward, response, mask):
    t = Trajectory(prompt_id=f"p{prompt_index}", prompt_index=prompt_index, traj_id=f"p{prompt_index}/{k}", index=k,
                   origin="initial", parent_id=None, branch_offset=None, prompt_token_ids=[1, 2, 3])
    t.response_ids, t.loss_mask, t.response_logprobs = list(response), list(mask), [-0.5] * len(response)
    t.reward = reward
    return t


def test_make_train_batch_is_grpo_over_prompt_groups_with_prompt_and_tool_tokens_masked():
    rt = SimpleNamespace(cfg=config(algorithm={"norm_by_std": True}))
    groups = [[traj(0, 0, 1.0, [7, 8], [1, 1]), traj(0, 1, 0.0, [7, 9, 9, 5], [1, 0, 0, 1])],
              [traj(1, 0, 0.5, [4], [1]), traj(1, 1, 0.5, [6], [1])]]
    batch = steps.make_train_batch(rt, RolloutResult(groups=groups, prompt_info=[{}, {}], stats={}))
    assert batch["input_ids"][1] == [1, 2, 3, 7, 9, 9, 5]
    assert batch["loss_mask"][1] == [0, 0, 0, 1, 0, 0, 1]
    assert batch["group_ids"] == [0, 0, 1, 1]
    # By hand (docs/design/arpo_reference.md §11.2 convention): group 0 = [1, 0]: mean 0.5, unbiased std sqrt(0.5), eps 1e-6; group 1: std 0.
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert batch["advantages"] == pytest.approx([a, -a, 0.0, 0.0], abs=1e-6)  # float32 advantages
    assert batch["advantages"][0] > 0 > batch["advantages"][1] and batch["advantages"][2] == 0.0


def test_a_step_without_learning_signal_is_warned_with_a_running_count(tmp_path, caplog):
    """Every group's rewards equal: all advantages 0, a warning and train/zero_signal_steps; a resumed run
    continues the count from metrics.jsonl."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/zero_signal_steps": 2}\n'
                                            '{"step": 5, "train/zero_signal_steps": 9}\n')  # after the resume point
    rt = SimpleNamespace(cfg=config(), run_dir=tmp_path)
    flat = [[traj(0, 0, 1.0, [7], [1]), traj(0, 1, 1.0, [8], [1])], [traj(1, 0, 0.0, [4], [1]), traj(1, 1, 0.0, [6], [1])]]
    batch = steps.make_train_batch(rt, RolloutResult(groups=flat, prompt_info=[{}, {}], stats={}))
    assert batch["groups_with_signal"] == 0 and batch["advantages"] == [0.0] * 4
    with caplog.at_level("WARNING"):
        assert steps.signal_metrics(rt, batch, 2) == {"train/zero_signal": 1.0, "train/zero_signal_steps": 3.0}
        assert steps.signal_metrics(rt, batch, 3)["train/zero_signal_steps"] == 4.0
    assert "step 3: no learning signal" in caplog.text and "(4 such step(s) so far)" in caplog.text
    mixed = [[traj(0, 0, 1.0, [7], [1]), traj(0, 1, 0.0, [8], [1])]]
    batch = steps.make_train_batch(rt, RolloutResult(groups=mixed, prompt_info=[{}], stats={}))
    assert steps.signal_metrics(rt, batch, 4) == {"train/zero_signal": 0.0, "train/zero_signal_steps": 4.0}


def test_make_train_batch_rejects_a_broken_record():
    rt = SimpleNamespace(cfg=config())
    bad = traj(0, 0, 1.0, [7, 8], [1])  # mask shorter than the response
    with pytest.raises(ValueError, match="mask"):
        steps.make_train_batch(rt, RolloutResult(groups=[[bad]], prompt_info=[{}], stats={}))


def _call(tool, error, owner):
    return ToolCall(tool=tool, query="q", result_text="", latency_s=0.0, cached=False, error=error, truncated=False,
                    call_offset=0, result_offset=0, num_result_tokens=0, owner=owner)


def test_a_tool_backend_failing_every_call_of_a_step_stops_training():
    ok = traj(0, 0, 0.0, [1], [1])
    ok.tool_calls = [_call("search", "transport", "p0/0"), _call("python", None, "p0/0")]
    steps.check_tool_backends([ok], step=3)  # a single failure is a result the model reads, not a stop
    ok.tool_calls += [_call("search", "transport", "p0/0"), _call("search", None, "p0/0")]
    steps.check_tool_backends([ok], step=3)  # the backend answered once: not down
    down = traj(0, 1, 0.0, [1], [1])
    down.tool_calls = [_call("search", "transport", "p0/1")] * 2
    inherited = traj(0, 2, 0.0, [1], [1])
    inherited.tool_calls = [_call("search", "transport", "p0/1"), _call("search", "transport", "p0/2")]
    with pytest.raises(RuntimeError, match="tool 'search' failed to reach its backend"):
        steps.check_tool_backends([down, inherited], step=3)  # 3 executed calls (the copied one not counted)


def test_prompt_ids_stay_unique_when_a_batch_repeats_a_prompt_across_epochs():
    records = [SimpleNamespace(uid=f"src-{i}") for i in range(3)]
    rt = SimpleNamespace(train=runtime.PromptSet(records, [[i + 1] for i in range(3)]),
                         sampler=EpochSampler(3, 4, seed=0))
    prompts, indices = steps.next_prompts(rt)
    assert len(indices) == 4 and len(set(indices)) == 3  # the fourth comes from the next epoch
    assert len({p.prompt_id for p in prompts}) == 4
    assert [p.prompt_id.split(":", 1)[1] for p in prompts] == [records[i].uid for i in indices]
    assert [p.token_ids for p in prompts] == [[i + 1] for i in indices]


def test_count_steps():
    assert runtime.count_steps(config(trainer={"total_steps": 7}), 100) == 7
    assert runtime.count_steps(config(trainer={"total_epochs": 2}), 10) == 4  # 10 // 4 per epoch, drop_last
    assert runtime.count_steps(config(trainer={"total_epochs": 2}, data={"drop_last": False}), 10) == 6
    with pytest.raises(ValueError, match="train_batch_size"):
        runtime.count_steps(config(), 3)


def test_load_prompt_set_renders_and_filters(tmp_path):
    from transformers import AutoTokenizer

    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    from megatron_arpo.data.chat import load_chat_format

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint("tiny-qwen3")))
    rows = [{"question": "short?", "answer": "a"}, {"question": "long " * 80, "answer": "b"}]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = config(data={"system_prompt": "Be brief.", "max_prompt_tokens": 64})
    prompts = runtime.load_prompt_set([str(path)], cfg.data, load_chat_format(tokenizer, tiny_checkpoint("tiny-qwen3")))
    assert len(prompts) == 1 and prompts.num_dropped == 1
    assert "Be brief." in tokenizer.decode(prompts.token_ids[0]) and prompts.records[0].ground_truth == "a"


def test_config_paths_become_absolute_for_ray_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = runtime.with_absolute_paths(config(model={"hf_checkpoint": "ckpt"}, trainer={"run_dir": "runs/x"}))
    assert cfg.model.hf_checkpoint == str(tmp_path / "ckpt") and cfg.run_dir == tmp_path / "runs" / "x"


def test_the_config_names_the_three_weight_transports():
    assert config(rollout={"sync_transport": "ipc"}).rollout.sync_transport == "ipc"
    with pytest.raises(Exception, match="sync_transport") as err:
        config(rollout={"sync_transport": "object_store"})  # the driver no longer carries the weights
    assert "gloo" in str(err.value) and "nccl" in str(err.value)


def test_a_sync_that_fails_verification_stops_before_the_next_rollout():
    """The WeightSyncError leaves the phase switch (and so the train loop: nothing is saved or rolled out on
    the half-loaded weights); the weights stay stale. Whether to verify is the group's (rollout.verify_sync)."""
    from megatron_arpo.trainer import phases
    from megatron_arpo.trainer.state import PhaseState
    from megatron_arpo.weight_sync.protocol import WeightSyncError

    asked = []

    class FailingActor:
        def sync_weights(self, group, **kwargs):
            asked.append(kwargs)
            raise WeightSyncError("weight sync: engine 0: verify_sync: model.norm.weight differs ...")

    rt = SimpleNamespace(cfg=config(), actor=FailingActor(), group=object(), engines=[], policy_version=3,
                         phases=PhaseState(sleep_level=None, offload=False, phase="train", weights_stale=True))
    with pytest.raises(WeightSyncError, match="verify_sync"):
        phases.switch_phase(rt, "rollout")
    # the engines are told the trainer's policy version, the label of every token they sample next
    assert rt.phases.weights_stale and rt.phases.phase == "train" and asked == [{"version": 3}]
