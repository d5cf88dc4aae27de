"""Start and stop everything one training run uses, as a single ``Runtime``.

``start_runtime(cfg, resume)`` builds, in this order (each step fails fast with a message naming the
config key to fix, and everything already started is stopped again on failure):

1. tokenizer and chat format (template, EOS ids from generation_config.json, thinking prefix:
   ``megatron_arpo.data.chat``), train/validation prompts (rendered with the chat template, filtered by
   ``data.max_prompt_tokens``), the epoch sampler and the number of steps;
2. which checkpoint to resume from (``trainer.checkpointing.resolve_resume``), and the tools (they run
   in this process) with one probe call per tool — both before Ray starts, so a bad ``--resume`` or a
   dead tool backend costs seconds, not an engine start;
3. Ray (``connect_ray``: RAY_ADDRESS, a Slurm allocation, or a private local instance), the resource
   pools of ``trainer.placement`` (``colocated``: actor ranks and engines share bundles, time-sliced;
   ``separate``: disjoint pools);
4. the vLLM engine actors, up and profiled before anything of the actor exists: vLLM sizes its KV cache
   from the device's free memory during its start, so a colocated actor allocating meanwhile (weights,
   DDP buffers, a resumed optimizer state) would shrink it. Each engine's KV cache is checked against the
   plan (``megatron_arpo.rollout.kv_cache``: one line naming the numbers and the fix when it is smaller)
   and, with ``rollout.enable_sleep_mode``, the engines sleep (``megatron_arpo.trainer.phases``). Then
   the policy ``ActorGroup`` (from the HF checkpoint, or from the resume checkpoint) and, when
   ``algorithm.use_reference`` is on, a frozen reference group on the same bundles as the policy. The
   order is in ``Runtime.phases.events``;
5. the rollout group and scheduler, the weight-sync transport, the metrics logger;
6. on resume: sampler, step, tool cache and (``trainer.mode: off_policy``) the rollout buffer restored; the first switch to the rollout phase wakes the
   engines and loads them with the actor's weights (resumed, or dropped by a level-2 sleep).

With ``replay_dir`` (``train --replay-rollouts DIR``, ``megatron_arpo.trainer.replay``) the tools, the
engines, the rollout group, the scheduler and the weight-sync transport are not started and validation is
off: the recorded rollouts replace them. The run ends at the last recorded step (the LR schedule still
counts the config's steps).

``Runtime.close()`` stops exactly what was started — tools, actor groups, engines, resource pools, the
Ray connection (a private local Ray instance ends with it) — and reports any actor of this job still
alive. Every blocking call is bounded by a ``trainer.timeouts`` value (``Runtime.run_async`` for the
asyncio parts; the actor group and ``ray.get`` calls take their own timeouts).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from megatron_arpo.cluster.placement import PlacementPlan, ResourcePools, plan_placement
from megatron_arpo.cluster.runtime import connect_ray
from megatron_arpo.config import BUILTIN_REWARDS, ExperimentConfig, with_absolute_paths
from megatron_arpo.config_schema import DataSection
from megatron_arpo.data.chat import ChatFormat, load_chat_format
from megatron_arpo.data.datasets import DEFAULT_SYSTEM_PROMPT, filter_by_length, load_prompt_files, render_prompt
from megatron_arpo.data.sampler import EpochSampler
from megatron_arpo.errors import ConfigError, InputError
from megatron_arpo.fsutil import atomic_write
from megatron_arpo.rewards import get_reward_fn
from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.kv_cache import check_kv_caches
from megatron_arpo.tools.base import ToolError, TransportError
from megatron_arpo.tools.registry import build_tools
from megatron_arpo.tracking import MetricsLogger
from megatron_arpo.trainer import checkpointing
from megatron_arpo.trainer.off_policy import start_off_policy
from megatron_arpo.trainer.phases import sleep_engines, switch_phase
from megatron_arpo.trainer.replay import ReplaySource
from megatron_arpo.trainer.state import PhaseState, PromptSet, Runtime
from megatron_arpo.weight_sync.protocol import choose_transport

# Imported where they are used: the actor group, the rollout scheduler, the engine and the KV-cache check
# import torch (the engine also vLLM), the tokenizer transformers; `import megatron_arpo.trainer.runtime`
# stays light (train.py imports it before the config is read).
if TYPE_CHECKING:
    from megatron_arpo.actor.group import ActorGroup

logger = logging.getLogger(__name__)

ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
CPU_BLOCK_SIZE = 32  # smallest block the CPU attention takes: prefix caching works at 32-token granularity
TOOL_PROBES = {"python": "print(1 + 1)", "search": "capital"}


def load_prompt_set(files: list[str], data: DataSection, chat: ChatFormat) -> PromptSet:
    """``chat``: the checkpoint's `ChatFormat` (its template renders the prompts)."""
    records, stats = load_prompt_files(files, fmt=data.format, on_bad_row=data.on_bad_row,
                                       system_prompt=data.system_prompt or DEFAULT_SYSTEM_PROMPT,
                                       strict_answers=data.reward in BUILTIN_REWARDS,
                                       prompt_key=data.prompt_key, answer_key=data.answer_key)
    token_ids = [render_prompt(chat, r) for r in records]
    keep, dropped = filter_by_length(records, token_ids, data.max_prompt_tokens)
    for s in stats:
        logger.info("%s: %d rows, %d loaded, %d malformed skipped", s.path, s.rows, s.loaded, s.skipped_bad)
    return PromptSet([records[i] for i in keep], [token_ids[i] for i in keep], dropped)


def count_steps(cfg: ExperimentConfig, num_prompts: int) -> int:
    t = cfg.trainer
    if t.total_steps is not None:
        return t.total_steps
    per_epoch = num_prompts // t.train_batch_size if cfg.data.drop_last else math.ceil(num_prompts / t.train_batch_size)
    if per_epoch < 1:
        raise ConfigError([f"trainer.train_batch_size: {t.train_batch_size} exceeds the {num_prompts} training "
                           f"prompts with data.drop_last; lower it, add data, or set trainer.total_steps"])
    return per_epoch * t.total_epochs


def _start_engines(rt: Runtime, hf_dir: str, on_gpu: bool) -> None:
    # deferred: pulls in importlib.metadata, which this module's importers need not load
    from megatron_arpo.rollout.engine import EngineConfig
    from megatron_arpo.rollout.engine_actor import create_engine_actor

    cfg = rt.cfg
    extra = {} if on_gpu else {"block_size": CPU_BLOCK_SIZE}
    engine_cfg = EngineConfig.from_rollout_section(hf_dir, cfg.rollout, dtype=ENGINE_DTYPES[cfg.actor.params_dtype],
                                                   extra=extra, batch_invariant=cfg.trainer.deterministic,
                                                   return_routed_experts=cfg.actor.moe_routing_replay)
    if cfg.trainer.deterministic:
        logger.info("trainer.deterministic: on (actor ranks in Megatron's deterministic mode with torch's "
                    "deterministic algorithms; GPU engines in vLLM's batch-invariant mode)")
    engine_cfg.weight_transfer = rt.transport  # the engines' receiver matches the actor's sender
    rt.engine_config = engine_cfg  # restart_engine starts a replacement with the same config
    for index in range(cfg.rollout.num_engines):
        rt.engines.append(create_engine_actor(engine_cfg, index, **rt.pools.engine_placement(index)))


def start_rollout_engines(rt: Runtime, hf_dir: str, on_gpu: bool) -> None:
    """Engines up, profiled, their KV cache checked and (with sleep mode) asleep: call before the actor
    allocates anything on the GPUs they share (see the module docstring)."""
    _start_engines(rt, hf_dir, on_gpu)
    ready_engines(rt, on_gpu)


def ready_engines(rt: Runtime, on_gpu: bool) -> None:
    """Wait for the started engines, check their KV caches against the plan, and put them to sleep when
    ``rollout.enable_sleep_mode`` is on."""
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray

    _wait_for_engines(rt)
    rt.phases.note("engines ready")
    infos = ray.get([e.kv_cache_info.remote() for e in rt.engines], timeout=rt.cfg.trainer.timeouts.startup_s)
    check_kv_caches(infos, rt.cfg.rollout, on_gpu)
    rt.phases.note("KV caches checked")
    sleep_engines(rt)


def restart_engine(rt: Runtime, index: int, on_gpu: bool) -> None:
    """Replace the dead engine actor ``index`` with a new one on its placement (same bundle, same
    ``EngineConfig``), ready and KV-checked as at start-up; it holds the HF weights until the next weight
    sync (the caller syncs: ``OffPolicyLoop.restart_dead_engines``)."""
    # deferred: pulls in ray and vLLM's config (heavy; this module imports without them)
    import ray
    from megatron_arpo.rollout.engine_actor import create_engine_actor

    try:
        ray.kill(rt.engines[index], no_restart=True)  # dead already; frees its bundle share if it is not
    except Exception as exc:  # a handle of a dead actor may refuse the kill: nothing to free then
        logger.debug("engine %d: kill of the dead actor: %s", index, exc)
    rt.engines[index] = create_engine_actor(rt.engine_config, index, **rt.pools.engine_placement(index))
    _wait_for_engines(rt)
    infos = ray.get([rt.engines[index].kv_cache_info.remote()], timeout=rt.cfg.trainer.timeouts.startup_s)
    check_kv_caches(infos, rt.cfg.rollout, on_gpu)
    rt.group.replace(index, rt.engines[index], version=0)  # the sync that follows labels it
    rt.phases.note(f"engine {index} restarted")


def _wait_for_engines(rt: Runtime) -> None:
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    timeout = rt.cfg.trainer.timeouts.startup_s
    try:
        health = ray.get([e.health.remote() for e in rt.engines], timeout=timeout)
    except RayActorError as exc:
        raise RuntimeError(f"a vLLM engine actor died during start-up ({str(exc).strip().splitlines()[0]}); its log "
                           f"is in the Ray session dir (logs/worker-*.err)") from exc
    except GetTimeoutError as exc:
        raise TimeoutError(f"the vLLM engines were not ready within {timeout:.0f} s (trainer.timeouts.startup_s); "
                           f"check the engine actors' logs in the Ray session dir") from exc
    bad = [h for h in health if not h["ok"]]
    if bad:
        raise RuntimeError(f"vLLM engine {bad[0]['engine_index']} is broken after start: {bad[0]['error']}")


def _probe_tools(rt: Runtime) -> None:
    """One direct call per tool (no cache, no retries): a backend that is down stops the run here, with
    its error, instead of turning every tool call of training into an error result."""
    for tag, tool in rt.tools.tools.items():
        try:
            result = rt.run_async(tool.execute(TOOL_PROBES.get(tag, "test")), rt.cfg.tools.timeout_s,
                                  f"the probe call of tool {tag!r}", "tools.timeout_s")
        except (TransportError, ToolError, TimeoutError) as exc:
            raise RuntimeError(f"tool {tag!r} does not work: {exc}; check tools.{tag} (backend, url, corpus, key) "
                               f"before training") from exc
        if result.error == "timeout":
            raise RuntimeError(f"tool {tag!r} timed out on a trivial probe call; check tools.{tag}")


def record_placement(cfg: ExperimentConfig, actor: ActorGroup) -> None:
    """``<run_dir>/placement.json``: the node each actor rank landed on (for operators and tests)."""
    rows = [dataclasses.asdict(p) for p in actor.workers.placement]
    with atomic_write(cfg.run_dir / "placement.json") as fh:
        json.dump({"actor": rows}, fh, indent=2)


def _placement_plan(cfg: ExperimentConfig) -> PlacementPlan:
    plan = plan_placement(cfg)
    if cfg.algorithm.use_reference:
        # The frozen reference runs on the policy's bundles: each takes half of the policy's share.
        plan = dataclasses.replace(plan, actor_num_cpus=plan.actor_num_cpus / 2, actor_num_gpus=plan.actor_num_gpus / 2)
    return plan


def start_runtime(cfg: ExperimentConfig, resume: str, replay_dir: Optional[str] = None) -> Runtime:
    # deferred: pulls in transformers (heavy; this module imports without it)
    from transformers import AutoTokenizer

    from megatron_arpo.actor.group import ActorGroup
    from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutScheduler

    cfg = with_absolute_paths(cfg)
    rt = Runtime(cfg=cfg, run_dir=cfg.run_dir)
    if replay_dir is not None:
        if cfg.trainer.mode == "off_policy":
            raise InputError("train --replay-rollouts trains the recorded steps in sync mode; set trainer.mode: sync")
        rt.replay = ReplaySource.open(replay_dir)  # a bad DIR fails before anything starts
    try:
        rt.run_dir.mkdir(parents=True, exist_ok=True)
        hf_dir = cfg.model.hf_checkpoint
        rt.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or hf_dir)
        rt.chat = load_chat_format(rt.tokenizer, hf_dir, tokenizer_dir=cfg.model.tokenizer,
                                   chat_template_file=cfg.data.chat_template, enable_thinking=cfg.data.enable_thinking)
        rt.train = load_prompt_set(cfg.data.train_files, cfg.data, rt.chat)
        rt.val = load_prompt_set(cfg.data.val_files, cfg.data, rt.chat) if cfg.data.val_files and rt.replay is None else None
        schedule_steps = count_steps(cfg, len(rt.train))  # the LR schedule's, also when a replay stops earlier
        rt.total_steps = schedule_steps if rt.replay is None else min(schedule_steps, rt.replay.last_step)
        rt.sampler = EpochSampler(len(rt.train), cfg.trainer.train_batch_size, seed=cfg.data.seed,
                                  shuffle=cfg.data.shuffle)
        rt.reward_fn = get_reward_fn(cfg.data.reward)
        rt.resume_from = checkpointing.resolve_resume(rt.checkpoint_root, resume)
        if rt.replay is None:  # tools run in this process: build and probe them before anything expensive starts
            _start_tools(rt)
        rt.options = RolloutOptions.from_config(cfg.rollout)
        # auto: gloo on CPU, ipc when colocated on GPUs, nccl for separate pools (a bad choice fails here).
        rt.transport = choose_transport(cfg.rollout.sync_transport, cfg.launcher.gpus_per_node > 0,
                                        cfg.trainer.placement)
        logger.info("run %s: %d train prompts (%d too long), %s val prompts, %d steps, %s", cfg.name, len(rt.train),
                    rt.train.num_dropped, len(rt.val) if rt.val else 0, rt.total_steps,
                    f"resuming from {rt.resume_from}" if rt.resume_from else "fresh start")

        rt.conn = connect_ray(cfg)
        on_gpu = cfg.launcher.gpus_per_node > 0
        rt.pools = ResourcePools.create(_placement_plan(cfg), timeout=cfg.trainer.timeouts.startup_s)
        # A replay has no engine to share the devices with: nothing sleeps or offloads.
        rt.phases = PhaseState.from_config(cfg) if rt.replay is None else PhaseState(sleep_level=None, offload=False)
        if rt.replay is None:
            start_rollout_engines(rt, hf_dir, on_gpu)  # before the actor allocates anything
        optimizer_steps = (schedule_steps * max(cfg.trainer.train_batch_size // cfg.actor.mini_batch_size, 1)
                           * cfg.actor.ppo_epochs)
        rt.actor = ActorGroup(cfg, role="policy", hf_dir=hf_dir,
                              load_dir=str(rt.resume_from) if rt.resume_from else None,
                              total_steps=optimizer_steps, pools=rt.pools, transport=rt.transport)
        rt.phases.note("actor ready" + (f" (resumed from {rt.resume_from.name})" if rt.resume_from else ""))
        record_placement(cfg, rt.actor)
        if cfg.algorithm.use_reference:
            rt.reference = ActorGroup(cfg, role="reference", hf_dir=hf_dir, pools=rt.pools)
            rt.phases.note("reference ready")
        if rt.replay is None:
            rt.group = RolloutGroup(rt.engines)
            rt.scheduler = RolloutScheduler(rt.group, rt.tools, rt.protocol, rt.options)
        # trainer.mode: off_policy: the rollout buffer (restored below); a dead engine is restarted in place
        rt.off_policy = start_off_policy(rt, restart_engine=lambda index: restart_engine(rt, index, on_gpu))

        if rt.resume_from is not None:
            checkpointing.restore_driver_state(rt, rt.actor.init_state or {})
        # Resumed: the engines started from the HF checkpoint, not the resumed weights (the switch syncs).
        rt.phases.weights_stale = rt.resume_from is not None
        switch_phase(rt, "rollout")  # and with actor.offload the actor's state leaves before the first rollout
        if rt.replay is not None:
            rt.replay.check_covers(rt.step + 1, rt.total_steps)
        _start_metrics_logger(rt)
        return rt
    except BaseException:
        rt.close()
        raise


def _start_tools(rt: Runtime) -> None:
    tools_cfg = rt.cfg.to_dict()["tools"]
    if tools_cfg["cache"] is not None:
        tools_cfg["cache"]["path"] = checkpointing.tool_cache_path(rt.cfg)  # node-local unless set
        logger.info("tool cache: %s (snapshot in every checkpoint)", tools_cfg["cache"]["path"])
    rt.tools = build_tools(tools_cfg)
    _probe_tools(rt)
    rt.protocol = rt.chat.protocol(rt.tools.tags)


def _start_metrics_logger(rt: Runtime) -> None:
    w = rt.cfg.logging.wandb
    # A fresh run drops every line of an earlier run in the same directory; a resumed one keeps its steps.
    rt.metrics_logger = MetricsLogger(rt.run_dir, rt.cfg.redacted(), wandb_mode=w.mode, project=w.project,
                                      entity=w.entity, name=w.name or rt.cfg.name, tags=list(w.tags),
                                      write_jsonl=rt.cfg.logging.metrics_jsonl,
                                      resume_step=rt.step if rt.resume_from is not None else -1,
                                      tensorboard=rt.cfg.logging.tensorboard)
