"""The ``trainer.mode: off_policy`` loop parts: the engines generate the next batches while the actor trains.

Batches are generated one scheduler call at a time, as in sync mode: ``train_batch_size`` prompts from the
sampler, ``call_key = "train-<j>"`` for the j-th batch, so every draw is a function of the seed and j. The
finished groups go into the ``RolloutBuffer`` (megatron_arpo/rollout/buffer.py). One step:

1. ``take_batch``: the oldest ``train_batch_size`` fit groups; while the buffer has too few, the engines
   generate (the actor waits: actor idle time).
2. score and advantages as in sync mode.
3. ``train_while_generating``: the actor's part — log-probs, then ``add_behaviour_weights`` (decoupled PPO's
   weights, megatron_arpo/algo/off_policy.py, when a token of the batch was sampled by an older version),
   then the update — runs in a worker thread while the engines generate batch j on the policy version they
   hold, for each j the staleness bound admits (``j - 1 - version <= max_staleness``: batch j is trained by
   the update that makes version j, if no group is dropped) and the buffer has room. No call starts after
   the update returns; the call running then finishes first (the actor waits: actor idle time).
4. the usual weight sync (train.py), engines idle between calls (the in-flight update of
   ``start_weight_update(keep_in_flight=True)`` is not used yet), then ``rt.group`` holds the new version.

With ``max_staleness: 0`` step 3 never admits a batch, so each batch is generated after the previous
update's sync, at the version it trains: the trajectories and the losses of sync mode, bit for bit.

A checkpoint (taken between steps, when no call runs) saves the buffer's finished groups, the next
batch number and the counters of the calls finished since the last take; the resumed run trains those
groups first and continues the batch numbers. A call cancelled by a stop request loses its groups
(counted as dropped in flight) and gives its prompts back to the sampler; a step abandoned before its
update puts its batch back in front (docs/off_policy.md, "Checkpoints and resume").

An engine actor that dies during a call loses that call's groups only (counted as dropped in flight, their
prompts drawn again): ``restart_dead_engines`` replaces it on its placement and syncs the current weights
into it, at most ``rollout.max_engine_restarts`` times per run. Seen in ``take_batch`` it happens at once;
seen while the actor trains, the engines stop generating and it happens after the update, before the
step's sync (the actor's weights are mid-update until then).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_arpo.algo.off_policy import sequence_weights, token_lags
from megatron_arpo.errors import first_line
from megatron_arpo.rollout.buffer import BufferedGroup, RolloutBuffer
from megatron_arpo.trainer import steps
from megatron_arpo.trainer.signals import StepAborted
from megatron_arpo.trainer.state import Runtime

logger = logging.getLogger(__name__)

BUFFER_FILE = "rollout_buffer.json"
_STAT_KEYS_MAX = ("barrier_rounds",)  # scheduler counters that are not summed over calls


class OffPolicyLoop:
    """The producer side (engines to buffer) and the off-policy parts of one step."""

    def __init__(self, rt: Runtime, restart_engine: Optional[Callable[[int], None]] = None):
        self.rt = rt
        # restart_engine(index): a new engine actor in place of the dead one (trainer.runtime.restart_engine)
        self.restart_engine = restart_engine
        self.max_restarts = rt.cfg.rollout.max_engine_restarts
        self.restarts = 0                  # engine actors replaced in this run (this process)
        self.dead: Optional[BaseException] = None  # an engine death seen while the actor trains, not yet handled
        r, t = rt.cfg.rollout, rt.cfg.trainer
        self.buffer = RolloutBuffer(r.buffer_groups, r.max_staleness)
        self.batch_size = t.train_batch_size
        self.next_batch = rt.step + 1     # the call_key number of the next batch the engines generate
        self.stats: dict[str, float] = {}  # scheduler counters of the calls finished since the last take
        self.busy_s = 0.0                  # engines generating, this step
        self.waited_s = 0.0                # actor waiting for a batch or for the last call before the sync
        self.step_start = time.perf_counter()
        self.take_info: dict[str, float] = {}
        self.taken: list[BufferedGroup] = []   # the step's batch (and below its calls' counters), for put_back
        self.taken_stats: dict[str, float] = {}
        # an abandoned step's counters: the step that takes its batch again reports them (then self.stats)
        self.put_back_stats: Optional[dict[str, float]] = None
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
        except BaseException as exc:  # cancelled by a stop request (StepAborted), an engine died, a timeout
            self.buffer.lose_in_flight(len(prompts))
            rt.sampler.load_state_dict(sampler_before)  # its prompts are drawn again by the next call
            if is_engine_death(exc):
                logger.warning("off-policy: an engine actor died during batch %d (%s); its %d in-flight groups are "
                               "lost and their prompts drawn again; restarting the engine", number,
                               first_line(exc), len(prompts))
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
        # Nothing taken yet: a stop that cancels this take puts back nothing (the last batch was trained).
        self.taken, self.taken_stats = [], {}
        version = rt.policy_version
        dropped_before = self.buffer.counters["dropped_stale"]

        async def fill() -> None:
            calls = 0
            if self.dead is not None:  # seen during the last update and not replaced (check_engines not run)
                await self.restart_dead_engines(self.dead)
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
                try:
                    await self._generate_one()
                except Exception as exc:
                    if not is_engine_death(exc):
                        raise
                    await self.restart_dead_engines(exc)  # the actor waits: the engines are not in use
                    continue
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
        if self.put_back_stats is not None:  # an abandoned step's batch: its row as it would have been
            stats, self.put_back_stats = self.put_back_stats, None
        else:
            stats, self.stats = self.stats, {}
        self.taken_stats = stats
        self.take_info = {"dropped": float(self.buffer.counters["dropped_stale"] - dropped_before)}
        result = RolloutResult(groups=[g.trajectories for g in groups],
                               prompt_info=[{"prompt_id": g.prompt_id} for g in groups], stats=stats)
        prompts = [RolloutPrompt(g.prompt_id, list(g.token_ids)) for g in groups]
        return prompts, [g.dataset_index for g in groups], result

    def put_back(self) -> None:
        """An abandoned step: its batch waits in the buffer for the resumed step, and its calls' counters
        for that step's row."""
        self.buffer.put_back(self.taken)
        self.put_back_stats = self.taken_stats
        self.taken, self.taken_stats = [], {}

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

    def train_while_generating(self, batch: dict[str, Any], trajectories: list, timer: Any,
                               stop_requested: Callable[[], bool]) -> tuple[dict, dict, dict]:
        """The actor's part of the step in a worker thread — log-probs (`steps.add_log_probs`), behaviour
        weights, update — while the engines generate the admissible batches; returns ``(logprob_info,
        weights, update metrics)``. A stop request before the update raises ``StepAborted`` (after the call
        running then has finished: `abandon_step` puts the batch back)."""
        rt = self.rt

        def actor_part() -> tuple[dict, dict, dict]:
            logprob_info = steps.add_log_probs(rt, batch, timer)
            weights = self.add_behaviour_weights(batch, trajectories)
            if stop_requested():
                raise StepAborted(f"step {rt.step + 1} abandoned before its update")
            with timer("update"):
                return logprob_info, weights, steps.update(rt, batch)

        t = rt.cfg.trainer.timeouts
        return self.while_generating(actor_part, t.logprob_s + t.update_s + t.rollout_s,
                                     "trainer.timeouts.logprob_s + update_s + rollout_s", stop_requested)

    def while_generating(self, work: Callable[[], Any], timeout: float, timeout_key: str,
                         cancel_when: Optional[Callable[[], bool]] = None) -> Any:
        """``work()`` in a worker thread while the engines generate the batches the staleness bound admits;
        no call starts after ``work`` returns, and the call running then finishes first (the actor waits)."""
        rt = self.rt
        limit = rt.total_steps

        async def both() -> Any:
            loop = asyncio.get_running_loop()
            done = loop.run_in_executor(None, work)
            finished: list[float] = []
            done.add_done_callback(lambda _: finished.append(time.perf_counter()))
            try:
                while (not done.done() and self.dead is None and self._admissible(limit)
                       and not (cancel_when and cancel_when())):
                    try:
                        await self._generate_one()  # a stop request is served after this call, at the step's end
                    except Exception as exc:
                        if not is_engine_death(exc):
                            raise
                        self.dead = exc  # replaced after the update (check_engines), not while it runs
                return await done
            finally:
                if finished:  # the actor finished during the last call: it waited for that call
                    self.waited_s += max(time.perf_counter() - finished[0], 0.0)

        return rt.run_async(both(), timeout, "the actor's step (with the engines generating)", timeout_key)

    # ------------------------------------------------------------------ engine deaths
    async def restart_dead_engines(self, exc: Optional[BaseException], sync: bool = True) -> None:
        """Replace the engines that died (``exc``, when given, named one of them; the others are probed) and,
        with ``sync``, give every engine the current weights and version; raises the clear error once
        ``rollout.max_engine_restarts`` is spent."""
        rt = self.rt
        dead = await find_dead_engines(rt.group.engines, exc)
        if not dead:
            if exc is not None:  # raised by an engine actor but every engine answers: not a death to mend here
                raise exc
            return
        cause = first_line(exc) if exc is not None else "its health call failed"
        if self.restart_engine is None or self.restarts + len(dead) > self.max_restarts:
            raise RuntimeError(
                f"vLLM engine {', '.join(map(str, dead))} died ({cause}) after {self.restarts} engine "
                f"restart(s) this run; rollout.max_engine_restarts={self.max_restarts} allows no more. Its log is in "
                "the Ray session dir (logs/worker-*.err); raise rollout.max_engine_restarts or resume the run") from exc
        for index in dead:
            logger.warning("off-policy: restarting vLLM engine %d (restart %d of at most %d)", index,
                           self.restarts + 1, self.max_restarts)
            self.restart_engine(index)
            self.restarts += 1
        self.dead = None
        if sync:
            steps.sync_weights(rt)  # the new engines get the current weights and version (the others again)

    def check_engines(self) -> None:
        """After the update, before the step's sync: replace an engine that died while the actor trained
        (seen by a call, or found by a ``health`` probe when it died between calls); the step's sync, next,
        gives it the weights."""
        self.rt.run_async(self.restart_dead_engines(self.dead, sync=False), self.rt.cfg.trainer.timeouts.startup_s,
                          "the check (and restart) of the vLLM engines", "trainer.timeouts.startup_s")

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
            "offpolicy/engine_restarts_total": float(self.restarts),
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
        """The checkpoint's ``off_policy`` entry. ``stats``: the counters of the calls finished since the last
        take, which the next step's row reports (``rollout/*``, ``tools/errors``); ``put_back_stats``: those
        of a step abandoned by the stop, reported before them by the step that trains its batch."""
        return {"next_batch": self.next_batch, "buffer": BUFFER_FILE, "stats": dict(self.stats),
                "put_back_stats": self.put_back_stats}

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
        self.stats = {k: float(v) for k, v in (state.get("stats") or {}).items()}
        put_back = state.get("put_back_stats")
        self.put_back_stats = {k: float(v) for k, v in put_back.items()} if put_back is not None else None
        logger.info("off-policy: resumed with %d buffered groups, next batch %d", len(self.buffer), self.next_batch)


def start_off_policy(rt: Runtime, restart_engine: Optional[Callable[[int], None]] = None) -> Optional[OffPolicyLoop]:
    """The loop for ``trainer.mode: off_policy`` (None in sync mode, and when replaying records)."""
    if rt.cfg.trainer.mode != "off_policy" or rt.replay is not None:
        return None
    return OffPolicyLoop(rt, restart_engine)


def is_engine_death(exc: BaseException) -> bool:
    """Whether ``exc`` says an engine actor died (ray's RayActorError, ActorDiedError among them, as the
    scheduler re-raises it from the engine call)."""
    # deferred: pulls in ray (heavy; this module imports without it)
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


async def find_dead_engines(engines: Sequence[Any], exc: Optional[BaseException], probe_s: float = 30.0) -> list[int]:
    """Indices of the dead engines: the one ``exc`` names by actor id, and any whose ``health`` call fails
    with an actor error (a death without an id, or more than one)."""
    named = getattr(exc, "actor_id", None)
    dead = set()
    for handle in engines:
        actor_id = getattr(getattr(handle.target, "_actor_id", None), "hex", lambda: None)()
        if named is not None and actor_id == named:
            dead.add(handle.index)
            continue
        try:
            await asyncio.wait_for(handle.call("health"), probe_s)
        except Exception as probe_exc:
            if is_engine_death(probe_exc):
                dead.add(handle.index)
    return sorted(dead)


def abandon_step(rt: Runtime, sampler_before: dict) -> None:
    """A step abandoned before its update: sync mode redraws its prompts, off-policy mode keeps its batch."""
    if getattr(rt, "off_policy", None) is None:
        rt.sampler.load_state_dict(sampler_before)
    else:
        rt.off_policy.put_back()


__all__ = ["BUFFER_FILE", "OffPolicyLoop", "abandon_step", "find_dead_engines", "is_engine_death", "start_off_policy"]
