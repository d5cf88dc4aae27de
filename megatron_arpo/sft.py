"""``megatron-arpo sft --config X [--resume auto|none|PATH]``: cold-start SFT on tool-integrated conversations.

The same Megatron actor as RL, on the same Ray actor group (``megatron_arpo.actor.group.ActorGroup``, one
Ray actor per rank, ``actor.tensor_parallel x pipeline_parallel x data_parallel`` of them, across every
node of the Ray cluster that ``connect_ray`` finds or forms — so ``megatron-arpo launch slurm --job sft``
runs it at the RL recipes' scale). The driver (this process) tokenizes the data, draws the batches and
writes the outputs; the ranks train token-mean NLL on assistant tokens only (tool results masked as in
RL, see ``megatron_arpo.data.sft``), from ``model.hf_checkpoint``, with ``sft.lr`` / ``sft.min_lr`` /
``sft.lr_schedule`` / ``sft.warmup_fraction`` and Adam / clipping / weight decay from ``actor.optimizer``.
One optimizer step sees ``sft.global_batch_size`` conversations drawn by the checkpointable
``EpochSampler`` (seed ``data.seed``, shuffle ``data.shuffle``), split over the DP replicas by tokens;
``ceil(sft.epochs x conversations / global_batch_size)`` steps in all.

Outputs in ``sft.output_dir`` (default ``<run_dir>/sft``): ``metrics.jsonl`` (one line per step),
``checkpoints/step-N`` (actor checkpoint every ``sft.save_every`` steps and at the end, with the sampler
state) and, with ``sft.export_hf``, ``hf/`` — an HF checkpoint (weights, config, tokenizer) that
``model.hf_checkpoint`` of the RL stage can point at.

Resume and preemption work as in RL: ``--resume auto`` continues from the newest complete SFT checkpoint
(same batches from there on); SIGUSR1 (Slurm's preemption notice) checkpoints after the current step and
exits with ``launcher.preempt_exit_code`` so the sbatch script requeues the job; SIGTERM does the same and
exits 143. Bad input (config, data rows, a damaged checkpoint) exits 2 before any rank starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence
from megatron_arpo.cluster.runtime import connect_ray
from megatron_arpo.command_args import PROG, add_config_arguments, config_from_args
from megatron_arpo.config import ConfigError, validate_paths, with_absolute_paths
from megatron_arpo.data.chat import load_chat_format
from megatron_arpo.data.fields import FieldKeys
from megatron_arpo.data.sft import load_sft_examples
from megatron_arpo.progress import Progress
from megatron_arpo.tracking import setup_console_logging
from megatron_arpo.trainer.signals import StopRequest

logger = logging.getLogger(__name__)

STAGE = "sft"


def sft_output_dir(cfg) -> Path:
    return Path(cfg.sft.output_dir) if cfg.sft.output_dir else cfg.run_dir / "sft"


def _metrics_lines(path: Path, keep_through_step: int) -> list[str]:
    """The metrics lines of steps <= ``keep_through_step`` (a resumed run rewrites the later ones)."""
    if not path.exists() or keep_through_step <= 0:
        return []
    return [line for line in path.read_text().splitlines() if line.strip()
            and json.loads(line).get("step", 0) <= keep_through_step]


def _cpus_per_rank(cfg) -> float | None:
    """On CPU-only nodes SFT is the only tenant: each rank gets its share of the cluster's CPUs (and as many
    intra-op threads); on GPU nodes the actor group's default (one CPU per GPU rank) stands."""
    if cfg.launcher.gpus_per_node > 0:
        return None
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray

    return float(max(1, int(ray.cluster_resources().get("CPU", 1) // cfg.layout.world_size)))


def run_sft(cfg, resume: str = "auto") -> dict[str, Any]:
    """SFT of ``cfg`` on the actor group; returns losses, output paths, steps and the exit code."""
    # deferred: pulls in transformers (heavy; this module imports without it)
    from transformers import AutoTokenizer

    from megatron_arpo.actor.group import ActorGroup
    from megatron_arpo.actor.optimizer import settings_for_sft
    from megatron_arpo.data.sampler import EpochSampler
    from megatron_arpo.trainer.checkpointing import ResumeError, is_due, resolve_resume
    from megatron_arpo.trainer.runtime import record_placement

    cfg = with_absolute_paths(cfg)  # the ranks do not share the driver's working directory
    if not cfg.model.hf_checkpoint:
        raise ConfigError(["model.hf_checkpoint: required for SFT (the model to fine-tune)"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.hf_checkpoint)
    # The checkpoint's chat format (template, EOS ids, thinking prefix): SFT prompts are RL prompts.
    chat = load_chat_format(tokenizer, cfg.model.hf_checkpoint, tokenizer_dir=cfg.model.tokenizer,
                            chat_template_file=cfg.data.chat_template, enable_thinking=cfg.data.enable_thinking)
    examples, stats = load_sft_examples(cfg.sft.train_files, chat, cfg.sft.max_seq_tokens, cfg.data.on_bad_row,
                                        keys=FieldKeys(cfg.data.prompt_key, cfg.data.answer_key))
    batch_size = cfg.sft.global_batch_size
    total_steps = math.ceil(cfg.sft.epochs * len(examples) / batch_size)
    out_dir = sft_output_dir(cfg).resolve()
    resume_from = resolve_resume(out_dir / "checkpoints", resume)
    sampler = EpochSampler(len(examples), batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    logger.info("SFT: %d conversations (%d truncated, %d dropped, %d bad rows skipped, %d tool results masked, "
                "%d thinking prefixes stripped), %d steps, %s", stats.kept, stats.truncated, stats.dropped_no_target,
                stats.skipped_bad, stats.result_spans, stats.prefix_stripped, total_steps,
                f"resuming from {resume_from}" if resume_from else "fresh start")

    with StopRequest.install() as stop, connect_ray(cfg) as conn:
        stop.reinstall()  # Ray's start-up may have replaced the handlers
        group = ActorGroup(cfg, role="policy", hf_dir=cfg.model.hf_checkpoint,
                           load_dir=str(resume_from) if resume_from else None, name="actor-sft",
                           optim_settings=settings_for_sft(cfg.actor, cfg.sft, total_steps),
                           num_cpus_per_rank=_cpus_per_rank(cfg))
        with group:
            stop.reinstall()
            if batch_size < group.dp:
                raise ConfigError([f"sft.global_batch_size: {batch_size} is below the {group.dp} data-parallel "
                                   f"replicas; raise it or lower actor.data_parallel"])
            step = 0
            if resume_from is not None:
                state = group.init_state or {}
                if state.get("stage") != STAGE or "sampler" not in state:
                    raise ResumeError(f"checkpoint {resume_from} is not an SFT checkpoint (stage "
                                      f"{state.get('stage')!r}); resume SFT from sft/checkpoints, or --resume none")
                step = int(state["step"])
                sampler.load_state_dict(state["sampler"])
            logger.info("SFT on %d ranks (tp=%d pp=%d dp=%d) over %d Ray node(s)", group.world_size, group.tp,
                        group.pp, group.dp, conn.num_nodes)
            record_placement(cfg, group)
            out_dir.mkdir(parents=True, exist_ok=True)
            metrics_path = out_dir / "metrics.jsonl"
            kept = _metrics_lines(metrics_path, step)
            losses = [json.loads(line)["loss"] for line in kept]
            last_saved = step if resume_from is not None else None
            ckpt = str(resume_from) if resume_from else None

            def save() -> str:
                return group.save(str(out_dir / "checkpoints"), {"sampler": sampler.state_dict(), "stage": STAGE},
                                  step=step, export_hf=False, keep_last=cfg.trainer.keep_last)

            report = Progress("sft", total_steps, done=step, rate_unit="tok",
                              bar=None if cfg.logging.progress_bars else False)
            with open(metrics_path, "w") as log, report:
                log.write("".join(line + "\n" for line in kept))
                while step < total_steps and not stop.requested:
                    indices = sampler.next_batch()
                    batch = {"input_ids": [examples[i].input_ids for i in indices],
                             "loss_mask": [examples[i].loss_mask for i in indices]}
                    metrics = group.sft_step(batch)
                    step += 1
                    losses.append(metrics["loss"])
                    log.write(json.dumps({"step": step, "epoch": sampler.epoch, **metrics}) + "\n")
                    log.flush()
                    logger.info("sft step %d/%d loss %.4f grad_norm %.3f lr %.3g", step, total_steps,
                                metrics["loss"], metrics["grad_norm"], metrics["lr"])
                    report.update(1, float(metrics.get("tokens", 0.0)))
                    if is_due(step, cfg.sft.save_every, total_steps) or stop.requested:
                        ckpt, last_saved = save(), step
            if stop.requested:
                if step > 0 and last_saved != step:
                    ckpt = save()
                code = stop.exit_code(cfg.launcher.preempt_exit_code)
                logger.warning("SFT stopped at step %d of %d on request; exit code %d", step, total_steps, code)
                return {"losses": losses, "checkpoint": ckpt, "hf_dir": None, "num_examples": stats.kept,
                        "steps": step, "exit_code": code}
            if last_saved != step:
                ckpt = save()
            hf_dir = None
            if cfg.sft.export_hf:
                hf_dir = str(out_dir / "hf")
                group.workers.call_all("write_hf_checkpoint", hf_dir, timeout=cfg.trainer.timeouts.save_s)
    return {"losses": losses, "checkpoint": ckpt, "hf_dir": hf_dir, "num_examples": stats.kept,
            "steps": total_steps, "exit_code": 0}


def sft_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} sft", description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                        help="continue from the newest SFT checkpoint (auto, the default), start fresh (none), or "
                             "a checkpoint directory")
    args = parser.parse_args(list(argv))
    cfg = config_from_args(args)
    setup_console_logging(cfg.logging.console_level)
    validate_paths(cfg, for_command="sft")
    start = time.time()
    result = run_sft(cfg, args.resume)
    losses = result["losses"]
    if result["exit_code"]:
        print(f"SFT stopped after step {result['steps']}; checkpoint: {result['checkpoint']} (resume with --resume "
              f"auto)")
        return result["exit_code"]
    print(f"SFT done in {time.time() - start:.1f}s: {result['steps']} steps on {result['num_examples']} "
          f"conversations" + (f", loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""))
    print(f"checkpoint: {result['checkpoint']}")
    if result["hf_dir"]:
        print(f"HF checkpoint: {result['hf_dir']}  (set model.hf_checkpoint to it for RL)")
    return 0
