"""The ARPO/AEPO RL loop: ``megatron-arpo train --config X.yaml [--set a.b=c ...] [--resume auto|none|PATH]``.

One step: rollout (branched multi-turn tool trajectories) -> reward -> GRPO advantages -> old (and
reference) log-probs -> PPO update -> weight sync (with colocated sleep/offload, the phase switches of
``megatron_arpo.trainer.phases`` around the log-probs, update and sync) -> validation (every ``trainer.val_every``) ->
log (``metrics.jsonl`` row, rollout records) -> checkpoint (every ``trainer.save_every``, and at the end):
the log is durable before the checkpoint that covers it is published. The components and the phase functions
live in ``megatron_arpo.trainer``; this file is the loop. With ``trainer.mode: off_policy`` the rollout is a
batch from the rollout buffer and the engines generate the next ones during the update
(``megatron_arpo.trainer.off_policy``). A stop request (preemption) is served at the
next safe point inside the step (``megatron_arpo.trainer.signals``). ``--replay-rollouts DIR`` trains on the
rollout records a run saved (``logging.save_rollout_records``) instead, without engines or tools
(``megatron_arpo.trainer.replay``).

Exit codes: 0 done (final policy in ``<run_dir>/hf``); ``launcher.preempt_exit_code`` (42) after SIGUSR1
and a checkpoint (the Slurm script requeues); 143 after SIGTERM and a checkpoint; 1 when a component
failed (one line on stderr, the traceback in ``<run_dir>/logs/train-error.log``); 2 for bad input (config,
tools this machine cannot run, a dataset row, a checkpoint to resume from).
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path
from typing import Sequence

from megatron_arpo.errors import InputError, as_symlink_loop
from megatron_arpo.progress import Progress
from megatron_arpo.tracking import format_step_summary, progress, setup_console_logging
from megatron_arpo.trainer import checkpointing, metrics, off_policy, phases, steps
from megatron_arpo.trainer.replay import ReplaySource, save_step_records
from megatron_arpo.trainer.signals import LeadTimeAdvisor, StepAborted, StopRequest
from megatron_arpo.command_args import PROG, add_config_arguments, config_from_args

logger = logging.getLogger(__name__)


def train(cfg, resume: str = "auto", replay_dir: str | None = None) -> int:
    """Run (or continue) the training of ``cfg``; returns the process exit code."""
    # deferred: start_runtime is looked up per call, so a patch of its module takes effect
    from megatron_arpo.trainer.runtime import start_runtime

    with StopRequest.install() as stop, start_runtime(cfg, resume, replay_dir) as rt:
        stop.reinstall()  # Ray and vLLM start-up may have replaced our handlers
        cfg, t = rt.cfg, rt.cfg.trainer
        lead = LeadTimeAdvisor(cfg.launcher.signal_lead_seconds)
        if t.val_before_train and rt.step == 0 and rt.val is not None:
            rt.metrics_logger.log(0, steps.validate(rt, 0))
        report = Progress("train", rt.total_steps, done=rt.step, rate_unit="generated tok",
                          bar=None if cfg.logging.progress_bars else False)
        while rt.step < rt.total_steps and not stop.requested:
            step = rt.step + 1
            with progress(f"step {step}/{rt.total_steps}", None, cfg.logging.progress_bars) as bar:
                timer = metrics.PhaseTimer(bar)
                sampler_before = rt.sampler.state_dict()
                offp = getattr(rt, "off_policy", None)  # trainer.mode: off_policy: batches from the buffer
                tools_before = steps.tool_stats(rt)
                try:  # until the update starts a stop abandons the step (signals.py: safe points)
                    with timer("rollout"):
                        if offp is None:
                            prompts, indices = steps.next_prompts(rt)
                            prompts, result = steps.rollout(rt, prompts, step, cancel_when=lambda: stop.requested)
                        else:
                            prompts, indices, result = offp.take_batch(step, cancel_when=lambda: stop.requested)
                    tools_after = steps.tool_stats(rt)
                    # off-policy with weights in flight: batch calls run on meanwhile (OffPolicyLoop.background)
                    on_side = offp.background if offp is not None else (lambda work: work())
                    with timer("reward"):
                        sources = on_side(lambda: steps.score(rt, result, prompts, rt.train, indices))
                    with timer("advantage"):
                        batch = on_side(lambda: steps.make_train_batch(rt, result))
                    phase = phases.switch_phase(rt, "train")  # colocated: the engines sleep, the actor onloads
                    if offp is not None:  # log-probs and update while the engines generate the next batches
                        logprob_info, weights, update = offp.train_while_generating(
                            batch, result.trajectories(), timer, lambda: stop.requested)
                    else:
                        logprob_info, weights = steps.add_log_probs(rt, batch, timer), {}
                        if stop.requested:
                            raise StepAborted(f"step {step} abandoned before its update")
                except StepAborted as exc:
                    off_policy.abandon_step(rt, sampler_before)  # the resumed run redoes this step
                    logger.warning("%s; the checkpoint is step %d's state", exc, rt.step)
                    break
                if offp is None:
                    with timer("update"):
                        update = steps.update(rt, batch)
                rt.phases.weights_stale = True
                sync, val = {}, {}
                if not stop.requested:  # stopping: the engines restart from the checkpoint anyway
                    if offp is not None:
                        offp.check_engines()  # an engine that died during the update (or between calls): replaced, synced below
                    with timer("sync"):  # offload, wake the weights, sync, wake the KV cache (trainer/phases.py)
                        # off-policy: an engine that dies during the sync is replaced and the sync runs again
                        sync = offp.switch_to_rollout() if offp is not None else phases.switch_phase(rt, "rollout")
                    if rt.val is not None and t.val_every and checkpointing.is_due(step, t.val_every, rt.total_steps):
                        with timer("validate"):
                            val = steps.validate(rt, step)
                rt.step = step
                trajs = result.trajectories()
                row = {**metrics.reward_metrics(trajs, sources),
                       **metrics.rollout_metrics(result, offp.engine_busy_s() if offp else timer.seconds["rollout"]),
                       **metrics.tool_metrics(trajs, result.stats, tools_before, tools_after, steps.tool_tags(rt, trajs)),
                       **metrics.token_statistics(batch, trajs, cfg.rollout.entropy_window),
                       **metrics.actor_metrics(update, logprob_info["padding_fraction"]),
                       **steps.signal_metrics(rt, batch, step),
                       **(offp.metrics(trajs, weights) if offp else {}),
                       **phase, **sync, **val, **timer.metrics(), **lead.observe(timer.seconds),
                       **metrics.data_metrics([p.prompt_id.split(":", 1)[1] for p in prompts], rt.sampler.state_dict())}
                # The step's row and records are durable before the checkpoint that covers them is published: a
                # kill before the publish redoes the step (the resume drops the row), a kill after loses nothing.
                rt.metrics_logger.log(step, row)
                logger.info(format_step_summary(step, row, rt.total_steps))
                report.update(1, float(row.get("rollout/generated_tokens", 0.0)))
                if cfg.logging.save_rollout_records:
                    save_step_records(rt.run_dir / "rollouts", step, result)
                if checkpointing.is_due(step, t.save_every, rt.total_steps) or stop.requested:
                    with timer("save"):
                        checkpointing.save_checkpoint(rt, stopping=stop.requested)
                    lead.observe(timer.seconds)  # the save time, for the preemption lead-time advice
                    logger.info("step %d: checkpoint saved in %.1f s", step, timer.seconds["save"])

        report.close()
        if stop.requested:
            if rt.step != rt.last_saved_step and rt.step > 0:
                checkpointing.save_checkpoint(rt, stopping=True)
            code = stop.exit_code(cfg.launcher.preempt_exit_code)
            logger.warning("stopped at step %d on request; exit code %d", rt.step, code)
            return code
        hf_dir = checkpointing.export_hf(rt) if t.export_hf_at_end else None
        checkpointing.write_finished(rt, hf_dir)
        logger.info("training done: %d steps in %s", rt.step, rt.run_dir)
        return 0


def train_main(argv: Sequence[str]) -> int:
    # deferred: pulls in ctypes, urllib, which this module's importers need not load
    from megatron_arpo.preflight import preflight

    parser = argparse.ArgumentParser(prog=f"{PROG} train", description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--resume", default=None, metavar="auto|none|PATH",
                        help="continue from the newest checkpoint (auto), start fresh (none), or a checkpoint "
                             "directory; default: trainer.resume")
    parser.add_argument("--replay-rollouts", default=None, metavar="DIR",
                        help="train on the rollout records a run saved in DIR (logging.save_rollout_records: "
                             "<run_dir>/rollouts) instead of rolling out: no vLLM engine, no tools, no validation")
    args = parser.parse_args(list(argv))
    cfg = config_from_args(args)
    setup_console_logging(cfg.logging.console_level)
    if args.replay_rollouts is not None:
        ReplaySource.open(args.replay_rollouts)  # a bad DIR: exit 2 before anything starts
    # Paths, the checkpoint against model.config, the tokenizer and (the tools run in this process) the tools:
    # every problem at once, before Ray starts. The rows are read once, by the runtime.
    preflight(cfg, "train", data=False, probe=False, tools=args.replay_rollouts is None)
    done = None if args.replay_rollouts else checkpointing.finished_run(cfg, args.resume or cfg.trainer.resume)
    if done is not None:  # nothing to train or export: do not start Ray and the engines
        print(f"{cfg.run_dir}: already finished ({done['step']} of {done['total_steps']} steps, checkpoint "
              f"{done['checkpoint']}" + (f", final policy {done['hf']}" if done["hf"] else "") + "); nothing to do. "
              f"To train further, raise trainer.total_epochs or trainer.total_steps")
        return 0
    try:
        return train(cfg, args.resume or cfg.trainer.resume, args.replay_rollouts)
    except InputError:
        raise  # a config, dataset or checkpoint problem: the CLI prints it and exits 2
    except Exception as exc:  # any component: one clear line, the traceback in a file
        loop = as_symlink_loop(exc)
        if loop is not None:
            raise loop from exc  # a path the user gave: exit 2
        log = Path(cfg.run_dir) / "logs" / "train-error.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"{PROG} train: error: {type(exc).__name__}: {message} (traceback: {log})", file=sys.stderr)
        return 1
