"""The ``trainer.mode: off_policy`` loop parts: the engines generate the next batches while the actor trains.

A batch is one scheduler call: ``train_batch_size`` prompts from the sampler, ``call_key = "train-<j>"``
for the j-th batch, so every draw is a function of the seed and j, as in sync mode. Finished calls go into
the ``RolloutBuffer`` (megatron_arpo/rollout/buffer.py) in batch order. Batch j is trained by the update
that makes version j, so it may start while the engines hold a version v with ``j - 1 - v <=
max_staleness`` (and the buffer has room). One step:

1. ``take_batch``: the oldest ``train_batch_size`` fit groups; while the buffer has too few, the engines
   generate (the actor waits: actor idle time).
2. score and advantages as in sync mode.
3. ``train_while_generating``: the actor's part — log-probs, then ``add_behaviour_weights`` (decoupled PPO's
   weights, megatron_arpo/algo/off_policy.py, when a token of the batch was sampled by an older version),
   then the update — runs in a worker thread while the engines generate the batches the bound admits.
4. the weight sync (train.py), then ``rt.group`` holds the new version.

Two producers, by ``rollout.in_flight_updates``:

- false (default): one call at a time. No call starts after the update returns; the call running then
  finishes first (the actor waits: actor idle time), and the sync runs on idle engines. Bit-reproducible.
- true: up to ``max_staleness + 1`` calls side by side, started as soon as the bound admits them (in
  ``take_batch`` too), and running on through the sync: the engines pause at a step boundary, drop the
  prefix cache and the paused requests' KV, load, resume on the new version (``ActorGroup.sync_weights``
  with ``keep_in_flight`` and ``clear_cache``), so one response's tokens can carry two versions. The
  tail of one batch (trajectories waiting on tools) overlaps the head of the next. Where the pause lands
  depends on timing: runs are not bit-reproducible.

With ``max_staleness: 0`` step 3 never admits a batch, so each batch is generated after the previous
update's sync, at the version it trains: the trajectories and the losses of sync mode, bit for bit.

A checkpoint saves the buffer's finished groups, the next batch number and the counters of the calls
finished since the last take; calls still running finish first (``settle``), or with a stop request are
cancelled. The resumed run trains those groups first and continues the batch numbers. A call cancelled by
a stop request loses its groups (counted as dropped in flight) and gives its prompts back to the sampler
(with every later call: they drew after it); a step abandoned before its update puts its batch back in
front (docs/off_policy.md, "Checkpoints and resume").

An engine actor that dies during a call loses that call's groups (and those of later calls still running,
which drew their prompts after it), counted as dropped in flight, their prompts drawn again:
``restart_dead_engines`` replaces it on its placement and syncs the current weights into it, at most
``rollout.max_engine_restarts`` times per run. Seen in ``take_batch`` it happens at once; seen while the
actor trains, the engines stop generating and it happens after the update, before the step's sync (the
actor's weights are mid-update until then).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_arpo.algo.off_policy import sequence_weights, token_lags
from megatron_arpo.errors import first_line
from megatron_arpo.rollout.buffer import BufferedGroup, RolloutBuffer
from megatron_arpo.trainer import phases, steps
from megatron_arpo.trainer.signals import StepAborted
from megatron_arpo.trainer.state import Runtime

logger = logging.getLogger(__name__)

BUFFER_FILE = "rollout_buffer.json"
_STAT_KEYS_MAX = ("barrier_rounds",)  # scheduler counters that are not summed over calls


@dataclass
class _Call:
    """One batch call: its prompts, the sampler state before they were drawn, the task, the engines' version at
    its start."""
    number: int
    prompts: list
    indices: list[int]
    sampler_before: dict
    task: "asyncio.Future[Any]"
    version: int
    restarts: int  # engine restarts before it started: a death it reports may be of an engine since replaced


class OffPolicyLoop:
    """The producer side (engines to buffer) and the off-policy parts of one step."""

    def __init__(self, rt: Runtime, restart_engine: Optional[Callable[[int], None]] = None):
        self.rt = rt
        # restart_engine(index): a new engine actor in place of the dead one (trainer.runtime.restart_engine)
        self.restart_engine = restart_engine
        self.max_restarts = rt.cfg.rollout.max_engine_restarts
        self.restarts = 0                  # engine actors replaced in this run (this process)
        self.dead: Optional[BaseException] = None  # an engine death seen while the actor trains, not yet handled
        self.dead_before_restart = False   # ... reported by a call that started before the last engine restart
        r, t = rt.cfg.rollout, rt.cfg.trainer
        self.buffer = RolloutBuffer(r.buffer_groups, r.max_staleness)
        self.batch_size = t.train_batch_size
        self.next_batch = rt.step + 1     # the call_key number of the next batch call to start
        # rollout.in_flight_updates: calls run concurrently up to the staleness bound and across weight syncs
        self.in_flight_updates = r.in_flight_updates
        self.calls: dict[int, _Call] = {}  # started and not yet in the buffer, by batch number (start order)
        self._busy_since: Optional[float] = None  # a call has been running since then
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

    def running(self) -> int:
        """Batch calls still generating."""
        return sum(not c.task.done() for c in self.calls.values())

    def _launch(self, limit_batches: int, cancel_when: Optional[Callable[[], bool]] = None,
                at_least_one: bool = False) -> None:
        """Start every batch call the staleness bound and the buffer admit: one at a time, or with
        ``rollout.in_flight_updates`` as many as admitted, each drawing its prompts in batch order.
        ``at_least_one`` (the actor waits for a batch): with no call running, one starts whatever the bound
        says, as long as the buffer has room (the engines hold the version being trained)."""
        most = self.buffer.max_staleness + 1 if self.in_flight_updates else 1
        while (self.dead is None and self.running() < most and self._admissible(limit_batches)
               and not (cancel_when and cancel_when())):
            self._start_call()
        if at_least_one and self.dead is None and not self.running() and self.buffer.room >= self.batch_size:
            self._start_call()

    def _start_call(self) -> None:
        rt = self.rt
        sampler_before = rt.sampler.state_dict()
        prompts, indices = steps.next_prompts(rt)
        number = self.next_batch
        self.buffer.reserve(len(prompts))
        self.next_batch += 1
        if not self.running():
            self._busy_since = time.perf_counter()
        task = asyncio.ensure_future(rt.scheduler.run(prompts, call_key=f"train-{number}", options=None))
        self.calls[number] = _Call(number, prompts, indices, sampler_before, task,
                                   rt.group.engines[0].version if rt.group is not None else rt.policy_version,
                                   self.restarts)
        task.add_done_callback(self._call_ended)

    def engine_busy_s(self) -> float:
        """Seconds of this step during which at least one batch call ran."""
        running_since = time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0
        return self.busy_s + running_since

    def _call_ended(self, _task: Any) -> None:
        if not self.running() and self._busy_since is not None:
            self.busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None

    def _collect(self) -> int:
        """Finished calls into the buffer, in batch order (a later call waits for an earlier one); a failed call
        drops itself and every later one (`_drop_from`). Returns the calls put; raises a failure other than an
        engine death."""
        for number, call in list(self.calls.items()):
            if call.task.done() and not call.task.cancelled() and is_engine_death(call.task.exception()):
                exc = call.task.exception()
                logger.warning("off-policy: an engine actor died during batch %d (%s); its %d in-flight groups are "
                               "lost and their prompts drawn again; restarting the engine", number,
                               first_line(exc), len(call.prompts))
                self.dead = exc
                self.dead_before_restart = call.restarts < self.restarts
                self._drop_from(number)
                break
        put = 0
        while self.calls:
            number, call = next(iter(self.calls.items()))
            if not call.task.done():
                break
            if call.task.cancelled() or call.task.exception() is not None:
                exc = call.task.exception() if not call.task.cancelled() else asyncio.CancelledError()
                self._drop_from(number)
                raise exc
            result = call.task.result()
            del self.calls[number]
            steps.check_tool_backends(result.trajectories(), number)
            self.buffer.put([BufferedGroup(p.prompt_id, list(p.token_ids), i, g)
                             for p, i, g in zip(call.prompts, call.indices, result.groups)])
            for key, value in result.stats.items():
                if isinstance(value, (int, float)):
                    old = self.stats.get(key, 0.0)
                    self.stats[key] = max(old, value) if key in _STAT_KEYS_MAX else old + value
            put += 1
            logger.info("off-policy: batch %d generated from policy version %d on (%d groups buffered)", number,
                        call.version, len(self.buffer))
        return put

    def _drop_from(self, number: int) -> None:
        """Call ``number`` and every later one are lost (counted as dropped in flight; running ones cancelled):
        the sampler goes back to before ``number``'s prompts, which the next call draws again."""
        lost = [c for n, c in self.calls.items() if n >= number]
        for call in lost:
            call.task.cancel()
            self.buffer.lose_in_flight(len(call.prompts))
            del self.calls[call.number]
        self.rt.sampler.load_state_dict(lost[0].sampler_before)
        self.next_batch = number

    async def _wait_any(self, *others: Any) -> None:
        pending = [c.task for c in self.calls.values() if not c.task.done()] + [o for o in others if not o.done()]
        if pending:
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    async def _cancel_all(self) -> None:
        if self.calls:
            tasks = [c.task for c in self.calls.values()]
            self._drop_from(min(self.calls))
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _finish_running(self) -> None:
        """Wait for every running call and put what it generated (a death is noted, not raised)."""
        try:
            while self.running():
                await self._wait_any()
                self._collect()
            self._collect()
        except asyncio.CancelledError:
            await self._cancel_all()
            raise

    def settle(self, cancel: bool) -> None:
        """Before a checkpoint: no call may run, so that the buffer, the sampler and the batch numbers saved agree.
        ``cancel`` (a stop request): the running calls are cancelled, their groups counted as dropped in flight
        and their prompts drawn again after the resume; otherwise they finish first."""
        if not self.calls:
            return
        if cancel:
            self._collect()  # the calls that finished go into the buffer; the rest are lost
            self.rt.run_async(self._cancel_all(), self.rt.cfg.trainer.timeouts.rollout_s,
                              "the cancellation of the running batch calls", "trainer.timeouts.rollout_s")
            return
        self.rt.run_async(self._finish_running(), self.rt.cfg.trainer.timeouts.rollout_s,
                          "the batch calls running at the checkpoint", "trainer.timeouts.rollout_s")

    def close(self) -> None:
        """Cancel the calls still running (the run ends or failed)."""
        if self.calls and not self.rt.loop.is_closed():
            try:
                self.rt.loop.run_until_complete(asyncio.wait_for(self._cancel_all(), 30))
            except Exception as exc:  # closing: report, go on
                logger.warning("off-policy: cancelling the running batch calls failed: %s", first_line(exc))

    # ------------------------------------------------------------------ one step
    def take_batch(self, step: int, cancel_when: Optional[Callable[[], bool]] = None) -> tuple[list, list[int], Any]:
        """The step's prompts, dataset indices and a ``RolloutResult`` of whole groups, generating while
        the buffer holds too few fit groups. Group ids (``prompt_index``) are the positions in the batch."""
        # deferred: pulls in importlib.metadata, which this module's importers need not load
        from megatron_arpo.rollout.scheduler import RolloutPrompt, RolloutResult

        rt = self.rt
        self.step_start = time.perf_counter()
        self.busy_s = self.waited_s = 0.0
        if self._busy_since is not None:  # a call runs on from the last step: this step counts from now
            self._busy_since = self.step_start
        # Nothing taken yet: a stop that cancels this take puts back nothing (the last batch was trained).
        self.taken, self.taken_stats = [], {}
        version = rt.policy_version
        dropped_before = self.buffer.counters["dropped_stale"]

        async def fill() -> None:
            calls = 0
            try:
                while True:
                    calls += self._collect()
                    if self.dead is not None:  # seen now, or during the last update and not replaced yet
                        await self.restart_dead_engines(self.dead)  # the actor waits: nothing to train yet
                        continue
                    if self.buffer.ready(self.batch_size, version):
                        return
                    self.buffer.drop_stale(version)
                    if calls > self.buffer.max_staleness + 1:
                        # batches generated now, on the synced weights, cannot be stale unless the engines' tokens
                        # carry another version than the trainer's: without this check the step regenerates forever
                        raise RuntimeError(
                            f"step {step}: {calls} batches generated on the synced weights were all dropped as older "
                            f"than rollout.max_staleness={self.buffer.max_staleness} versions behind policy version "
                            f"{version}; the engines label their tokens with another version (engine versions: "
                            f"{[e.version for e in rt.group.engines] if rt.group is not None else None}). The weight "
                            "sync must pass the trainer's version to the engines (steps.sync_weights)")
                    self._launch(rt.total_steps, at_least_one=True)
                    if not self.running():
                        raise RuntimeError(f"the rollout buffer has no room for a batch ({len(self.buffer)} finished, "
                                           f"{self.buffer.in_flight} in flight, capacity {self.buffer.capacity}); "
                                           f"raise rollout.buffer_groups")
                    await self._wait_any()
            except asyncio.CancelledError:  # a stop request: the running calls are lost, their prompts redrawn
                await self._cancel_all()
                raise

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
                while not done.done():
                    self._collect()
                    if not (cancel_when and cancel_when()):  # a stop request is served at the step's end
                        self._launch(limit)
                    await self._wait_any(done)
                if not self.in_flight_updates:
                    await self._finish_running()  # the sync needs idle engines: the actor waits for the call
                self._collect()
                return await done
            except asyncio.CancelledError:
                await self._cancel_all()
                raise
            finally:
                if finished and not self.in_flight_updates:  # the actor waited for the call after its update
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
            if exc is not None and not self.dead_before_restart:
                raise exc  # raised by an engine actor but every engine answers: not a death to mend here
            self.dead = None  # or a second call of an engine already replaced (calls side by side)
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

    def background(self, work: Callable[[], Any], timeout: float = 3600.0, what: str = "the trainer's work",
                   timeout_key: str = "trainer.timeouts") -> Any:
        """``work()``, with the event loop running while batch calls run (``rollout.in_flight_updates``): their
        tool calls and next requests go on meanwhile, and no tool timeout counts a stopped loop. No call
        starts. With no call running, ``work()`` runs here, as in sync mode."""
        if not self.running():
            return work()

        async def pump() -> Any:
            return await asyncio.get_running_loop().run_in_executor(None, work)

        return self.rt.run_async(pump(), timeout, what, timeout_key)

    def switch_to_rollout(self) -> dict[str, float]:
        """The step's weight sync (``phases.switch_phase(rt, "rollout")``). An engine actor that dies during it is
        replaced (within ``rollout.max_engine_restarts``) and the sync runs again into every engine: the
        survivors hold a partial update until then and generate nothing. A sync that fails with every engine
        alive is raised as it is (a transport or verification failure: nothing trains on those weights)."""
        rt = self.rt
        while True:
            try:
                return self.background(lambda: phases.switch_phase(rt, "rollout"), rt.cfg.trainer.timeouts.sync_s,
                                       "the weight sync", "trainer.timeouts.sync_s")
            except Exception as exc:
                dead = rt.run_async(find_dead_engines(rt.group.engines, None), rt.cfg.trainer.timeouts.startup_s,
                                    "the probe of the vLLM engines after a failed weight sync",
                                    "trainer.timeouts.startup_s") if rt.group is not None else []
                if not dead:
                    raise
                logger.warning("off-policy: vLLM engine %s died during the weight sync to version %d (%s); replacing "
                               "it and syncing again", ", ".join(map(str, dead)), rt.policy_version, first_line(exc))
                rt.run_async(self.restart_dead_engines(None, sync=False), rt.cfg.trainer.timeouts.startup_s,
                             "the restart of the vLLM engines", "trainer.timeouts.startup_s")

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
        busy = self.engine_busy_s()
        out: dict[str, float] = {
            "offpolicy/policy_version": float(self.rt.policy_version),
            "offpolicy/buffer_depth": float(len(self.buffer)),
            "offpolicy/dropped_stale": float(self.take_info.get("dropped", 0.0)),
            "offpolicy/dropped_stale_total": float(self.buffer.counters["dropped_stale"]),
            "offpolicy/dropped_in_flight_total": float(self.buffer.counters["dropped_in_flight"]),
            "offpolicy/engine_restarts_total": float(self.restarts),
            "offpolicy/engine_idle_s": max(wall - busy, 0.0),
            "offpolicy/engine_idle_frac": max(wall - busy, 0.0) / wall,
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


def _actor_id(handle: Any) -> Optional[str]:
    return getattr(getattr(handle.target, "_actor_id", None), "hex", lambda: None)()


async def find_dead_engines(engines: Sequence[Any], exc: Optional[BaseException], probe_s: float = 30.0) -> list[int]:
    """Indices of the dead engines: the one ``exc`` names by actor id, and any whose ``health`` call fails
    with an actor error (a death without an id, or more than one)."""
    named = getattr(exc, "actor_id", None)
    dead = set()
    for handle in engines:
        if named is not None and _actor_id(handle) == named:
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
