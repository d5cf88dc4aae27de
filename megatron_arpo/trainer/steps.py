"""The phases of one RL step, each a function of the ``Runtime`` (megatron_arpo/train.py calls them in order).

- ``next_prompts``: the sampler's next ``trainer.train_batch_size`` prompts. Prompt ids are
  ``<k>:<dataset uid>`` (k = position in the batch), unique within a call even when a batch straddles
  an epoch boundary and repeats a prompt.
- ``rollout``: one ARPO/AEPO scheduler call (``call_key = "train-<step>"``, so every random draw of the
  step is a function of the seed and the step), bounded by ``trainer.timeouts.rollout_s`` and cancelled
  by a stop request (a repeated step draws the same). A dead
  engine, or a tool whose every call of the step (at least ``OUTAGE_MIN_CALLS``) failed to reach its
  backend, stops training with that cause.
- ``score``: the configured reward per trajectory (``score_trajectories``, the scorer evaluation uses),
  per prompt group so each gets its own ground truth and data source.
- ``make_train_batch``: GRPO advantages over each prompt's group and the actor's batch format (one
  entry per trajectory: prompt + response ids, loss mask 0 on prompt and tool-result tokens).
  ``signal_metrics`` warns about a step whose every group has zero advantage, with a running count.
- ``add_log_probs``: old log-probs (and per-token entropy, for metrics) from the policy group; reference
  log-probs from the reference group when ``algorithm.use_reference`` is on.
- ``update``: the PPO update; counts ``rt.policy_version``.
- ``sync_weights``: the actor ranks stream their weights into every engine (``ActorGroup.sync_weights``:
  each pipeline stage's sender its own layers, no weight byte through the driver), prefix caches
  dropped; bounded by ``trainer.timeouts.sync_s``. With tied embeddings ``lm_head.weight`` is sent as
  well (``megatron_arpo.actor.sync_sender``). The engines then hold ``rt.policy_version``, the version
  their tokens record (``Trajectory.token_versions``).
- ``validate``: greedy, n = 1, no branching on ``data.val_files``; mean reward per data source.

When replaying recorded rollouts (``rt.replay``, ``megatron_arpo.trainer.replay``) ``rollout`` reads the
step's records, ``score`` keeps their recorded rewards, and ``sync_weights`` has no engine to send to.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from megatron_arpo.config import resolved_model
from megatron_arpo.trainer.metrics import sync_metrics, validation_metrics
from megatron_arpo.trainer.replay import data_sources
from megatron_arpo.trainer.state import Runtime

logger = logging.getLogger(__name__)


def next_prompts(rt: Runtime) -> tuple[list, list[int]]:
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.rollout.scheduler import RolloutPrompt

    indices = rt.sampler.next_batch()
    return [RolloutPrompt(f"{k}:{rt.train.records[i].uid}", list(rt.train.token_ids[i]))
            for k, i in enumerate(indices)], indices


def _run_scheduler(rt: Runtime, prompts: list, call_key: str, options: Any, what: str, cancel_when: Any = None) -> Any:
    return rt.run_async(rt.scheduler.run(prompts, call_key=call_key, options=options),
                        rt.cfg.trainer.timeouts.rollout_s, what, "trainer.timeouts.rollout_s", cancel_when)


def rollout(rt: Runtime, prompts: list, step: int, cancel_when: Any = None) -> tuple[list, Any]:
    """The step's prompts and ``RolloutResult``; ``cancel_when()`` (a stop request) cancels the rollout:
    ``StepAborted`` (see trainer.signals). A replay returns the recorded prompts and trajectories."""
    if rt.replay is not None:
        return rt.replay.load(step)
    result = _run_scheduler(rt, prompts, f"train-{step}", None, f"the rollout of step {step}", cancel_when)
    check_tool_backends(result.trajectories(), step)
    return prompts, result


OUTAGE_MIN_CALLS = 3  # fewer failures may be a blip the model can live with (it reads the error result)


def check_tool_backends(trajectories: list, step: int) -> None:
    """Raise when a tool was called at least OUTAGE_MIN_CALLS times this step and every call it executed
    failed to reach its backend (after the executor's retries): the backend is down."""
    calls: dict[str, list[str | None]] = {}
    for t in trajectories:
        for c in t.tool_calls:
            if c.owner == t.traj_id:
                calls.setdefault(c.tool, []).append(c.error)
    for tool, errors in calls.items():
        if len(errors) >= OUTAGE_MIN_CALLS and all(e == "transport" for e in errors):
            raise RuntimeError(f"step {step}: all {len(errors)} calls of tool {tool!r} failed to reach its backend "
                               f"(after tools.retries retries each); the backend is down — check tools.{tool}")


def score(rt: Runtime, result: Any, prompts: list, prompt_set: Any, indices: list[int]) -> dict[str, str]:
    """Set ``reward`` on every trajectory; returns prompt id -> data source (for per-source metrics)."""
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.rollout.trajectory import score_trajectories

    if rt.replay is not None:
        return data_sources(prompts, prompt_set)  # the recorded rewards are the step's rewards

    sources = {}
    for prompt, index, group in zip(prompts, indices, result.groups):
        record = prompt_set.records[index]
        score_trajectories(group, rt.reward_fn, rt.protocol, {prompt.prompt_id: record.ground_truth},
                           data_source=record.data_source)
        sources[prompt.prompt_id] = record.data_source
    return sources


def make_train_batch(rt: Runtime, result: Any) -> dict[str, Any]:
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.algo.advantages import grpo_advantages

    alg = rt.cfg.algorithm
    trajs = result.trajectories()
    for t in trajs:
        t.check()
    group_ids = [t.prompt_index for t in trajs]
    advantages = grpo_advantages([t.reward for t in trajs], group_ids, norm_by_std=alg.norm_by_std,
                                 eps=alg.advantage_eps)
    rewards: dict[int, set] = {}
    for t in trajs:
        rewards.setdefault(t.prompt_index, set()).add(t.reward)
    batch = {"input_ids": [t.prompt_token_ids + t.response_ids for t in trajs],
             "loss_mask": [[0] * len(t.prompt_token_ids) + list(t.loss_mask) for t in trajs],
             "advantages": advantages.tolist(), "group_ids": group_ids,
             # a group whose rewards are all equal has zero advantage: it teaches nothing
             "groups_with_signal": sum(len(r) > 1 for r in rewards.values())}
    if rt.cfg.actor.moe_routing_replay:  # each token's experts as the engine routed it (docs/moe.md)
        model = resolved_model(rt.cfg)
        batch["routed_experts"] = [t.routing_rows(model.num_hidden_layers, model.num_experts_per_tok) for t in trajs]
    return batch


def signal_metrics(rt: Any, batch: dict[str, Any], step: int) -> dict[str, float]:
    """``train/zero_signal_steps``: steps so far in which every group had zero advantage (warned each time).

    The count continues a resumed run's from its ``metrics.jsonl``; such a step still runs the update (the
    KL and entropy terms may move the policy), but its policy-gradient is zero."""
    if "groups_with_signal" not in batch:
        return {}
    if not hasattr(rt, "zero_signal_steps"):
        rt.zero_signal_steps = _logged_zero_signal_steps(Path(rt.run_dir) / "metrics.jsonl", step)
    zero = batch["groups_with_signal"] == 0
    if zero:
        rt.zero_signal_steps += 1
        logger.warning("step %d: no learning signal: every group's trajectories got the same reward, so every "
                       "advantage is 0 (%d such step(s) so far); too easy or too hard prompts, or a broken reward",
                       step, rt.zero_signal_steps)
    return {"train/zero_signal": float(zero), "train/zero_signal_steps": float(rt.zero_signal_steps)}


def _logged_zero_signal_steps(path: Path, step: int) -> int:
    """The running count in the last row before ``step`` of a resumed run's metrics.jsonl (0 if none)."""
    count = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step", step) < step and "train/zero_signal_steps" in row:
            count = int(row["train/zero_signal_steps"])
    return count


def add_log_probs(rt: Runtime, batch: dict[str, Any], timer: Any) -> dict[str, float]:
    """Adds ``old_logprobs``, ``entropy`` and (with a reference) ``ref_logprobs`` to the batch; with
    ``actor.moe_replay_diagnostics`` also ``unreplayed_logprobs``, the same pass on the actor's own routing."""
    lp_batch = {k: batch[k] for k in ("input_ids", "group_ids", "routed_experts") if k in batch}
    with timer("logprob"):
        out = rt.actor.compute_log_probs(lp_batch, with_entropy=True)
    batch["old_logprobs"], batch["entropy"] = out["logprobs"], out["entropy"]
    if rt.cfg.actor.moe_replay_diagnostics:  # rows of -1 (not recorded): every router picks its own experts
        model = resolved_model(rt.cfg)
        missing = [[-1] * model.num_experts_per_tok] * model.num_hidden_layers
        unreplayed = {**lp_batch, "routed_experts": [[missing] * len(rows) for rows in batch["routed_experts"]]}
        with timer("logprob"):
            batch["unreplayed_logprobs"] = rt.actor.compute_log_probs(unreplayed)["logprobs"]
    if rt.reference is not None:
        with timer("ref_logprob"):
            batch["ref_logprobs"] = rt.reference.compute_log_probs(lp_batch)["logprobs"]
    return {"padding_fraction": out["padding_fraction"]}


def tool_stats(rt: Runtime) -> dict[str, Any]:
    """The tool executor's counters (none when replaying records: no tool runs)."""
    return rt.tools.stats() if rt.tools is not None else {}


def tool_tags(rt: Runtime, trajectories: list) -> list[str]:
    if rt.tools is not None:
        return list(rt.tools.tags)
    return sorted({c.tool for t in trajectories for c in t.tool_calls})


def update(rt: Runtime, batch: dict[str, Any]) -> dict[str, float]:
    train_keys = ("input_ids", "loss_mask", "advantages", "group_ids", "old_logprobs", "ref_logprobs",
                  "behav_weights",  # behav_weights: trainer.mode off_policy only (megatron_arpo/trainer/off_policy.py)
                  "routed_experts")  # actor.moe_routing_replay only
    metrics = rt.actor.update({k: batch[k] for k in train_keys if k in batch})
    rt.policy_version += 1
    return metrics


def sync_weights(rt: Runtime) -> dict[str, float]:
    """Actor ranks -> engines (``ActorGroup.sync_weights``); returns the sync metrics."""
    if rt.group is None:  # replaying records: no engine to send to
        return {}
    # verify: rollout.verify_sync (first sync by default). The engines label every token they sample from
    # now on with the trainer's version (a resumed run's first sync included), not a count of their syncs.
    # rollout.in_flight_updates: batch calls run through the sync. The engines pause with their requests, drop
    # the prefix cache and those requests' KV (recomputed on the new weights), load, resume.
    offp = getattr(rt, "off_policy", None)
    in_flight = ({"keep_in_flight": True, "clear_cache": True} if offp is not None and offp.in_flight_updates
                 else {})
    report = rt.actor.sync_weights(rt.group, version=rt.policy_version, **in_flight)
    rt.group.set_version(rt.policy_version)
    return sync_metrics(report)


def validate(rt: Runtime, step: int) -> dict[str, float]:
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.rollout.scheduler import RolloutPrompt

    if rt.val is None:
        return {}
    prompts = [RolloutPrompt(f"{k}:{r.uid}", list(ids)) for k, (r, ids) in enumerate(zip(rt.val.records,
                                                                                          rt.val.token_ids))]
    start = time.perf_counter()
    result = _run_scheduler(rt, prompts, f"val-{step}", rt.options.for_validation(), f"the validation at step {step}")
    sources = score(rt, result, prompts, rt.val, list(range(len(prompts))))
    metrics = validation_metrics(result.trajectories(), sources)
    logger.info("validation at step %d: reward %.3f, accuracy %.3f on %d prompts (%.1f s)", step,
                metrics["val/reward"], metrics["val/accuracy"], len(prompts), time.perf_counter() - start)
    return metrics
