"""What a training run holds: the `Runtime` (one object over everything started), its `PromptSet` s and
the colocated phase state (`PhaseState`).

``megatron_arpo.trainer.runtime.start_runtime`` builds a Runtime; the trainer's steps, phases and
checkpointing take it. It lives apart from the builder so that those modules can name its type without
importing the builder (which calls them). The heavy parts (the actor group and the rollout scheduler
import torch, the tokenizer transformers, the engines are Ray actor handles) are imported for the
annotations only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Optional

from megatron_arpo.cluster.placement import ResourcePools
from megatron_arpo.cluster.runtime import RayConnection
from megatron_arpo.config import ExperimentConfig
from megatron_arpo.data.chat import ChatFormat
from megatron_arpo.data.sampler import EpochSampler
from megatron_arpo.errors import first_line
from megatron_arpo.rewards import RewardFn
from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.tools.base import ToolExecutor
from megatron_arpo.tracking import MetricsLogger
from megatron_arpo.trainer.replay import ReplaySource
from megatron_arpo.trainer.signals import StepAborted

# Ray is imported inside the methods that call it: tests build a Runtime without starting Ray.
if TYPE_CHECKING:  # heavy: torch (actor group, scheduler), transformers, ray
    from ray.actor import ActorHandle
    from transformers import PreTrainedTokenizerBase

    from megatron_arpo.actor.group import ActorGroup
    from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutScheduler

logger = logging.getLogger(__name__)


@dataclass
class PromptSet:
    """Prompts of one split: records (question, ground truth, data source) and their rendered token ids."""

    records: list
    token_ids: list[list[int]]
    num_dropped: int = 0

    def __len__(self) -> int:
        return len(self.records)


@dataclass
class PhaseState:
    """Who holds the colocated GPUs now (``megatron_arpo.trainer.phases`` switches it)."""

    sleep_level: Optional[int]       # None: the engines never sleep
    offload: bool
    phase: str = "rollout"           # start_runtime switches to "rollout" once: engines awake, actor offloaded
    engines_asleep: bool = False
    weights_dropped: bool = False    # slept at level 2: the engines hold no weights until a sync
    actor_offloaded: bool = False
    weights_stale: bool = False      # the actor's weights changed since the engines last got them
    # What happened to the GPUs' holders, in order ("engines ready", "engines asleep", "actor ready", ...):
    # the start-up (megatron_arpo.trainer.runtime) and every switch append to it, and log each line.
    events: list[str] = field(default_factory=list, compare=False)

    def note(self, event: str) -> None:
        self.events.append(event)
        logger.info("phase: %s", event)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> "PhaseState":
        r = cfg.rollout
        return cls(sleep_level=r.sleep_level if r.enable_sleep_mode else None, offload=cfg.actor.offload)


@dataclass
class Runtime:
    """Everything one training run started and holds (built by ``megatron_arpo.trainer.runtime.start_runtime``)."""

    cfg: ExperimentConfig
    run_dir: Path
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    tokenizer: Optional[PreTrainedTokenizerBase] = None
    chat: Optional[ChatFormat] = None
    train: Optional[PromptSet] = None
    val: Optional[PromptSet] = None
    sampler: Optional[EpochSampler] = None
    total_steps: int = 0
    step: int = 0
    policy_version: int = 0           # updates the actor's weights have had (the engines get it with each sync)
    last_saved_step: Optional[int] = None
    resume_from: Optional[Path] = None
    conn: Optional[RayConnection] = None
    pools: Optional[ResourcePools] = None
    engines: list[ActorHandle] = field(default_factory=list)  # the vLLM engine actors (rollout.engine)
    engine_config: Optional[Any] = None  # their EngineConfig (megatron_arpo.rollout.engine), for restarts
    actor: Optional[ActorGroup] = None
    reference: Optional[ActorGroup] = None
    group: Optional[RolloutGroup] = None
    scheduler: Optional[RolloutScheduler] = None
    options: Optional[RolloutOptions] = None
    protocol: Optional[TagProtocol] = None
    tools: Optional[ToolExecutor] = None
    transport: Optional[str] = None   # the weight-sync transport, chosen once (weight_sync.protocol.choose_transport)
    reward_fn: Optional[RewardFn] = None
    metrics_logger: Optional[MetricsLogger] = None
    phases: Optional[PhaseState] = None   # colocated sleep/offload
    replay: Optional[ReplaySource] = None  # when replaying recorded rollouts
    off_policy: Optional[Any] = None      # trainer.mode: off_policy (megatron_arpo.trainer.off_policy.OffPolicyLoop)
    closed: bool = False

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def run_async(self, coro: Awaitable, timeout: float, what: str, timeout_key: str,
                  cancel_when: Optional[Any] = None) -> Any:
        """Run a coroutine on the runtime's event loop, bounded by ``timeout`` seconds; a dead engine actor
        becomes one RuntimeError naming the phase. ``cancel_when()`` turning true (a stop request) cancels it
        and raises ``StepAborted``."""
        # deferred: pulls in ray (heavy; this module imports without it)
        from ray.exceptions import RayActorError

        try:
            if cancel_when is not None:
                return self.loop.run_until_complete(_cancellable(asyncio.wait_for(coro, timeout), cancel_when, what))
            return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))
        except RayActorError as exc:  # the only actors awaited here are the engines
            raise RuntimeError(f"{what} failed: a vLLM engine actor died ({first_line(exc)}); its log is in the Ray session "
                               f"dir (logs/worker-*.err)") from exc
        except asyncio.TimeoutError as exc:
            raise TimeoutError(f"{what} did not finish within {timeout:.0f} s ({timeout_key}); "
                               f"an engine or a tool may hang — check the Ray logs, or raise the timeout") from exc

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop everything this runtime started; idempotent, never raises."""
        if self.closed:
            return
        self.closed = True
        steps = [("off-policy calls", lambda: self.off_policy and self.off_policy.close()),
                 ("tools", self._close_tools), ("actor", lambda: self.actor and self.actor.shutdown()),
                 ("reference", lambda: self.reference and self.reference.shutdown()),
                 ("engines", self._stop_engines), ("resource pools", lambda: self.pools and self.pools.remove()),
                 ("leftover check", self._report_leftovers),
                 ("metrics logger", lambda: self.metrics_logger and self.metrics_logger.close()),
                 ("ray", lambda: self.conn and self.conn.shutdown())]
        for name, fn in steps:
            try:
                fn()
            except Exception as exc:  # keep stopping the rest
                logger.warning("shutdown: stopping %s failed: %s", name, exc)
        self.loop.close()

    def _close_tools(self) -> None:
        if self.tools is not None:
            self.loop.run_until_complete(asyncio.wait_for(self.tools.close(), 30))

    def _stop_engines(self) -> None:
        # deferred: pulls in ray (heavy; this module imports without it)
        import ray

        if not self.engines:
            return
        try:
            ray.get([e.shutdown.remote() for e in self.engines], timeout=30)
        except Exception as exc:  # a dead engine cannot shut down; killing it is enough
            logger.debug("engine shutdown: %s", exc)
        for engine in self.engines:
            ray.kill(engine, no_restart=True)
        self.engines = []

    def _report_leftovers(self) -> None:
        """Wait (briefly) until every actor this job started is DEAD in the GCS; warn about any that is not."""
        deadline = time.monotonic() + 15.0
        alive = alive_actors_of_this_job()
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = alive_actors_of_this_job()
        if alive is None:
            return
        if alive:
            logger.warning("shutdown: %d Ray actor(s) of this job still alive: %s", len(alive), alive[:5])
        else:
            logger.info("shutdown: no Ray actor of this job is alive")


async def _cancellable(coro: Awaitable, cancel_when: Any, what: str, poll_s: float = 0.2) -> Any:
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if cancel_when():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise StepAborted(f"{what} was cancelled by a stop request")


def alive_actors_of_this_job() -> Optional[list[str]]:
    """Class names of this job's actors that are not DEAD (GCS actor table); None when it cannot be read."""
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray

    if not ray.is_initialized():
        return None
    try:
        from ray._private import state

        job = ray.get_runtime_context().get_job_id()
        table = state.actors()
    except Exception as exc:  # a private API: report "unknown" rather than fail the shutdown
        logger.debug("cannot read the actor table: %s", exc)
        return None
    return [info.get("ActorClassName", "?") for info in table.values()
            if info.get("JobID") == job and info.get("State") != "DEAD"]
