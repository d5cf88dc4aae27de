"""The ``trainer.mode: off_policy`` loop parts: the engines generate the next batches while the actor trains.

Batches are generated one scheduler call at a time, as in sync mode: ``train_batch_size`` prompts from the
sampler, ``call_key = "train-<j>"`` for the j-th batch, so every draw is a function of the seed and j. The
finished groups go into the ``RolloutBuffer`` (megatron_arpo/rollout/buffer.py). One step:

1. ``take_batch``: the oldest ``train_batch_size`` fit groups; while the buffer has too few, the engines
   generate (the actor waits: actor idle time).
2. score, advantages, log-probs as in sync mode; ``add_behaviour_weights`` adds decoupled PPO's weights
   (megatron_arpo/algo/off_policy.py) when a token of the batch was sampled by an older version.
3. ``update_while_generating``: the update runs in a worker thread while the engines generate batch j on
   the policy version they hold, for each j the staleness bound admits (``j - 1 - version <= max_staleness``:
   batch j is trained by the update that makes version j, if no group is dropped) and the buffer has room.
   No call starts after the update returns; the call running then finishes first.
4. the usual weight sync (train.py), engines idle between calls (the in-flight update of engflight's
   ``start_weight_update(keep_in_flight=True)`` is not used yet), then ``rt.group`` holds the new version.

With ``max_staleness: 0`` step 3 never admits a batch, so each batch is generated after the previous
update's sync, at the version it trains: the trajectories and the losses of sync mode, bit for bit.

A checkpoint (taken between steps, when no call runs) saves the buffer's finished groups and the next
batch number; the resumed run continues exactly. A call cancelled by a stop request loses its groups
(counted as dropped in flight) and gives its prompts back to the sampler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_arpo.algo.off_policy import sequence_weights, token_lags
from megatron_arpo.rollout.buffer import BufferedGroup, RolloutBuffer
from megatron_arpo.trainer import steps
from megatron_arpo.trainer.state import Runtime

logger = logging.getLogger(__name__)

BUFFER_FILE = "rollout_buffer.json"
_STAT_KEYS_MAX = ("barrier_rounds",)  # scheduler counters that are not summed over calls


class OffPolicyLoop:
    """The producer side (engines to buffer) and the off-policy parts of one step."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        r, t = rt.cfg.rollout, rt.cfg.trainer
        self.buffer = RolloutBuffer(r.buffer_groups, r.max_staleness)
        self.batch_size = t.train_batch_size
        self.next_batch = rt.step + 1     # the call_key number of the next batch the engines generate
        self.stats: dict[str, float] = {}  # scheduler counters of the calls finished since the last take
        self.busy_s = 0.0                  # engines generating, this step
        self.waited_s = 0.0                # actor waiting for a batch or for the last call before the sync
        self.step_start = time.perf_counter()
        self.take_info: dict[str, float] = {}
        self.taken: list[BufferedGroup] = []   # the step's batch, until its update starts
        self.lags: list[list[int]] = []         # the step's token lags (add_behaviour_weights)

    # ------------------------------------------------------------------ producer
    def _admissible(self, limit_batches: int) -> bool:
        version = self.rt.group.engines[0].version if self.rt.group is not None else self.rt.policy_version
        ahead = self.next_batch - 1 - version  # versions between the engines' and the one training batch j
        return (ahead <= self.buffer.max_staleness and self.buffer.room >= self.batch_size
                and self.next_batch <= limit_batches)

    async def _generate_one(self) -> None:
        rt = self.rt
        sampler_before = rt.sampler.state_dict()
        prompts, indices = steps.next_prompts(rt)
        number = self.next_batch
        self.buffer.reserve(len(prompts))
        start = time.perf_counter()
        try:
            result = await rt.scheduler.run(prompts, call_key=f"train-{number}", options=None)
        except BaseException:  # cancelled by a stop request (StepAborted), an engine died, a timeout
            self.buffer.lose_in_flight(len(prompts))
            rt.sampler.load_state_dict(sampler_before)  # its prompts are drawn again by the next call
            raise
        finally:
            self.busy_s += time.perf_counter() - start
        steps.check_tool_backends(result.trajectories(), number)
        self.buffer.put([BufferedGroup(p.prompt_id, list(p.token_ids), i, g)
                         for p, i, g in zip(prompts, indices, result.groups)])
        for key, value in result.stats.items():
            if isinstance(value, (int, float)):
                old = self.stats.get(key, 0.0)
                self.stats[key] = max(old, value) if key in _STAT_KEYS_MAX else old + value
        self.next_batch += 1
        logger.info("off-policy: batch %d generated on policy version %d (%d groups buffered)", number,
                    rt.group.engines[0].version, len(self.buffer))

    # ------------------------------------------------------------------ one step
    def take_batch(self, step: int, cancel_when: Optional[Callable[[], bool]] = None) -> tuple[list, list[int], Any]:
        """The step's prompts, dataset indices and a ``RolloutResult`` of whole groups, generating while
        the buffer holds too few fit groups. Group ids (``prompt_index``) are the positions in the batch."""
        # deferred: pulls in importlib.metadata, which this module's importers need not load
        from megatron_arpo.rollout.scheduler import RolloutPrompt, RolloutResult

        rt = self.rt
        self.step_start = time.perf_counter()
        self.busy_s = self.waited_s = 0.0
        version = rt.policy_version
        dropped_before = self.buffer.counters["dropped_stale"]

        async def fill() -> None:
            calls = 0
            while not self.buffer.ready(self.batch_size, version):
                self.buffer.drop_stale(version)
                if self.buffer.room < self.batch_size:
                    raise RuntimeError(f"the rollout buffer has no room for a batch ({len(self.buffer)} finished, "
                                       f"{self.buffer.in_flight} in flight, capacity {self.buffer.capacity}); "
                                       f"raise rollout.buffer_groups")
                if calls > self.buffer.max_staleness + 1:
                    # batches generated now, on the synced weights, cannot be stale unless the engines' tokens
                    # carry another version than the trainer's: without this check the step regenerates forever
                    raise RuntimeError(
                        f"step {step}: {calls} batches generated on the synced weights were all dropped as older "
                        f"than rollout.max_staleness={self.buffer.max_staleness} versions behind policy version "
                        f"{version}; the engines label their tokens with another version (engine versions: "
                        f"{[e.version for e in rt.group.engines] if rt.group is not None else None}). The weight "
                        "sync must pass the trainer's version to the engines (steps.sync_weights)")
                await self._generate_one()
                calls += 1

        wait_start = time.perf_counter()
        rt.run_async(fill(), rt.cfg.trainer.timeouts.rollout_s, f"the rollout for step {step}",
                     "trainer.timeouts.rollout_s", cancel_when)
        self.waited_s += time.perf_counter() - wait_start
        groups = self.buffer.take(self.batch_size, version)
        self.taken = groups
        for position, group in enumerate(groups):
            for traj in group.trajectories:
                traj.prompt_index = position
        stats, self.stats = self.stats, {}
        self.take_info = {"dropped": float(self.buffer.counters["dropped_stale"] - dropped_before)}
        result = RolloutResult(groups=[g.trajectories for g in groups],
                               prompt_info=[{"prompt_id": g.prompt_id} for g in groups], stats=stats)
        prompts = [RolloutPrompt(g.prompt_id, list(g.token_ids)) for g in groups]
        return prompts, [g.dataset_index for g in groups], result

    def put_back(self) -> None:
        """An abandoned step: its batch waits in the buffer for the resumed step."""
        self.buffer.put_back(self.taken)
        self.taken = []

    def add_behaviour_weights(self, batch: dict[str, Any], trajectories: list) -> dict[str, float]:
        """``behav_weights`` for the batch (only when a token is older than the trained version: at lag 0
        everywhere the batch stays sync's), and the importance-weight statistics."""
        version, cap = self.rt.policy_version, self.rt.cfg.algorithm.behaviour_weight_cap
        lags, behav = [], []
        for t in trajectories:
            p = len(t.prompt_token_ids)
            versions = t.token_versions or [version] * len(t.response_ids)  # an unversioned record: current
            lags.append([0] * p + token_lags(versions, version))
            behav.append([0.0] * p + list(t.response_logprobs))
        weights, stats = sequence_weights(batch["old_logprobs"], behav, lags, batch["loss_mask"], cap)
        if stats["lagged_tokens"] > 0:
            batch["behav_weights"] = weights
        self.lags = lags
        return stats

    def update_while_generating(self, batch: dict[str, Any], cancel_when: Optional[Callable[[], bool]] = None
                                ) -> dict[str, float]:
        """``steps.update`` in a worker thread while the engines generate the admissible batches."""
        rt = self.rt
        limit = rt.total_steps

        finished_at: list[float] = []

        def timed_update() -> dict[str, float]:
            out = steps.update(rt, batch)
            finished_at.append(time.perf_counter())
            return out

        async def both() -> dict[str, float]:
            loop = asyncio.get_running_loop()
            update = loop.run_in_executor(None, timed_update)
            while not update.done() and self._admissible(limit) and not (cancel_when and cancel_when()):
                await self._generate_one()  # a stop request is served after this call, at the step's end
            out = await update
            if finished_at:  # the actor waited from the update's end for the call that was still running
                self.waited_s += max(time.perf_counter() - finished_at[0], 0.0)
            return out

        timeout = rt.cfg.trainer.timeouts.update_s + rt.cfg.trainer.timeouts.rollout_s
        update_start = time.perf_counter()
        out = rt.run_async(both(), timeout, "the update (with the engines generating)",
                           "trainer.timeouts.update_s + rollout_s")
        self.update_wall_s = time.perf_counter() - update_start
        return out

    # ------------------------------------------------------------------ metrics, checkpoint
    def metrics(self, trajectories: list, weight_stats: dict[str, float]) -> dict[str, float]:
        """The step's ``offpolicy/*`` row entries (docs/metrics.md), over the wall time since ``take_batch``:
        the engines are idle when no call runs, the actor when it waits for a batch or for the call that
        runs on after its update (before the sync)."""
        wall = max(time.perf_counter() - self.step_start, 1e-9)
        out: dict[str, float] = {
            "offpolicy/policy_version": float(self.rt.policy_version),
            "offpolicy/buffer_depth": float(len(self.buffer)),
            "offpolicy/dropped_stale": float(self.take_info.get("dropped", 0.0)),
            "offpolicy/dropped_stale_total": float(self.buffer.counters["dropped_stale"]),
            "offpolicy/dropped_in_flight_total": float(self.buffer.counters["dropped_in_flight"]),
            "offpolicy/engine_idle_s": max(wall - self.busy_s, 0.0),
            "offpolicy/engine_idle_frac": max(wall - self.busy_s, 0.0) / wall,
            "offpolicy/actor_idle_s": self.waited_s,
            "offpolicy/actor_idle_frac": min(self.waited_s / wall, 1.0),
            **{f"offpolicy/{k}": v for k, v in weight_stats.items() if k != "lagged_tokens"},
        }
        trained_version = self.rt.policy_version - 1  # the update has run: the batch trained this version
        oldest: dict[int, int] = {}  # per group (prompt_index), its oldest sampled token's version
        for t in trajectories:
            v = t.oldest_version()
            if v is not None:
                oldest[t.prompt_index] = min(v, oldest.get(t.prompt_index, v))
        group_lags = Counter(trained_version - v for v in oldest.values())
        for lag, count in sorted(group_lags.items()):
            out[f"offpolicy/staleness/{lag}"] = float(count)
        token_lags_count = Counter(lag for row, t in zip(self.lags, trajectories)
                                   for lag, m in zip(row[len(t.prompt_token_ids):], t.loss_mask) if m)
        total = sum(token_lags_count.values())
        for lag, count in sorted(token_lags_count.items()):
            out[f"offpolicy/token_share/{lag}"] = count / total
        return out

    def state(self) -> dict[str, Any]:
        return {"next_batch": self.next_batch, "buffer": BUFFER_FILE}

    def save(self, checkpoint: Path) -> None:
        self.buffer.save(Path(checkpoint) / BUFFER_FILE)

    def restore(self, checkpoint: Path, state: Optional[dict[str, Any]]) -> None:
        """The buffer and the next batch number of a checkpoint; one without them (a sync-mode checkpoint)
        starts with an empty buffer at the next step."""
        if not state:
            self.next_batch = self.rt.step + 1
            logger.info("off-policy: checkpoint %s has no rollout buffer (sync mode?); starting with an empty one",
                        checkpoint)
            return
        path = Path(checkpoint) / state["buffer"]
        if not path.exists():  # killed between the actor's save and the buffer's: its prompts are skipped
            self.next_batch = self.rt.step + 1
            logger.warning("off-policy: checkpoint %s lists a rollout buffer that is missing; its groups are lost "
                           "(their prompts are not redrawn this epoch)", checkpoint)
            return
        self.next_batch = int(state["next_batch"])
        self.buffer.load(path)
        logger.info("off-policy: resumed with %d buffered groups, next batch %d", len(self.buffer), self.next_batch)


def start_off_policy(rt: Runtime) -> Optional[OffPolicyLoop]:
    """The loop for ``trainer.mode: off_policy`` (None in sync mode, and when replaying records)."""
    if rt.cfg.trainer.mode != "off_policy" or rt.replay is not None:
        return None
    return OffPolicyLoop(rt)


def abandon_step(rt: Runtime, sampler_before: dict) -> None:
    """A step abandoned before its update: sync mode redraws its prompts, off-policy mode keeps its batch."""
    if getattr(rt, "off_policy", None) is None:
        rt.sampler.load_state_dict(sampler_before)
    else:
        rt.off_policy.put_back()


__all__ = ["BUFFER_FILE", "OffPolicyLoop", "abandon_step", "start_off_policy"]
