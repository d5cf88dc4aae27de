"""Resume decisions, the driver's part of a checkpoint, and the final HF export.

A training checkpoint is the actor's ``<run_dir>/checkpoints/step-N`` (Megatron dist-checkpoint of
model and optimizer, per-rank RNG, LR schedule; see ``megatron_arpo.actor.checkpoint``) whose
``state.json`` carries the driver's *extra state*:

- ``step``: RL steps done;
- ``sampler``: the prompt sampler's ``(epoch, position)`` — the next step draws the very next prompts;
- ``rollout``: the seed of the branch/sampling streams. The rollout of step ``k`` derives every random
  draw from ``(rollout.seed, "train-k", trajectory id)``, so there is no stream position to save: a
  resumed step ``k`` draws what an uninterrupted one would have;
- ``tool_cache``: a consistent snapshot of the tool cache (``step-N/tool_cache.sqlite``), merged into
  the live cache on resume (a lost or node-local cache file comes back);
- ``off_policy`` (``trainer.mode: off_policy``): the next batch number and ``step-N/rollout_buffer.json``,
  the buffer's finished groups (``megatron_arpo.trainer.off_policy``), written after the tool cache;
- ``total_steps`` and ``metrics_step`` for reference (``metrics.jsonl`` is cut back to ``step`` on resume).

The snapshot is written right after the actor's save has made ``step-N`` complete; a run killed in
between resumes without it (a warning), which costs only cache hits.

Where the live cache lives (``tool_cache_path``): ``tools.cache.path`` when set, else
``<run_dir>/tool_cache/tool_cache.sqlite``: a directory of the run's own, never a predictable name in a
shared /tmp that another user could create first (``megatron_arpo.tools.cache.prepare_cache_path`` checks
owner and mode). On a network filesystem the cache uses a rollback journal instead of WAL, whose shared
memory such filesystems do not provide; only the trainer process uses the cache (the tools run in it).

A run that ends writes ``<run_dir>/finished.json`` (its last checkpoint, the HF export, a digest of the
resolved config); ``finished_run`` finds it again, so rerunning a finished run with ``--resume auto`` and
the same config says so and exits without starting Ray or engines just to re-export.

``resolve_resume``: ``auto`` = the newest complete checkpoint under ``<run_dir>/checkpoints`` (or none:
a fresh start); ``none`` = a fresh start, refused when that directory already holds checkpoints (their
step numbers would collide with the new run's); anything else is a path to a checkpoint root or a
``step-N`` directory, which must be complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

from megatron_arpo.config import with_absolute_paths
from megatron_arpo.errors import InputError
from megatron_arpo.fsutil import atomic_write
from megatron_arpo.trainer.state import Runtime

logger = logging.getLogger(__name__)

TOOL_CACHE_SNAPSHOT = "tool_cache.sqlite"
FINISHED = "finished.json"


class ResumeError(InputError):
    """A checkpoint to resume from is missing, incomplete or damaged (the CLI exits 2)."""


def resolve_resume(checkpoint_root: Path, resume: str) -> Optional[Path]:
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.actor.checkpoint import latest_checkpoint

    resume = (resume or "auto").strip()
    found = latest_checkpoint(checkpoint_root)
    if resume == "auto":
        return check_resume_files(found) if found is not None else None
    if resume == "none":
        if found is not None:
            raise ResumeError(f"--resume none, but {checkpoint_root} already holds checkpoint {found.name}; pass "
                              f"--resume auto to continue that run, or choose a new trainer.run_dir")
        return None
    path = latest_checkpoint(Path(resume))
    if path is None:
        raise ResumeError(f"--resume {resume}: no complete checkpoint there (expected a step-N directory with a "
                          f"COMPLETE file, or a directory of them); use --resume auto or none")
    return check_resume_files(path.resolve())


def check_resume_files(path: Path) -> Path:
    """Refuse a checkpoint whose shards are damaged before any rank tries to load it (a truncated
    ``.distcp`` would otherwise fail deep inside every rank, after the cluster started)."""
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.actor.checkpoint import check_shard_files

    problems = [p for sub in ("model", "optim") if (path / sub).is_dir() for p in check_shard_files(path / sub)]
    if not (path / "model").is_dir():
        problems.append(f"{path / 'model'}: missing")
    if problems:
        raise ResumeError(f"checkpoint {path} is damaged: {'; '.join(problems[:3])}"
                          f"{f' (+{len(problems) - 3} more)' if len(problems) > 3 else ''}. Resume from an earlier "
                          f"checkpoint (--resume {path.parent}/step-N), or move this one away and use --resume auto")
    return path


def is_due(step: int, every: int, total: int) -> bool:
    """``every`` = 0 means only at the last step."""
    return step == total or (every > 0 and step % every == 0)


def tool_cache_path(cfg: Any) -> Optional[str]:
    """The live tool cache file of ``cfg`` (None when ``tools.cache`` is null); see the module docstring."""
    cache = cfg.tools.cache
    if cache is None:
        return None
    if cache.path:
        return str(cache.path)
    return str(Path(cfg.run_dir).resolve() / "tool_cache" / TOOL_CACHE_SNAPSHOT)


def driver_state(rt: Runtime) -> dict[str, Any]:
    return {"step": rt.step, "total_steps": rt.total_steps, "metrics_step": rt.step,
            "sampler": rt.sampler.state_dict(), "rollout": {"seed": rt.cfg.rollout.seed, "call_key": "train-<step>"},
            "tool_cache": TOOL_CACHE_SNAPSHOT if _cache(rt) is not None else None,
            "off_policy": rt.off_policy.state() if getattr(rt, "off_policy", None) is not None else None}


def _cache(rt: Runtime) -> Any:
    return getattr(rt.tools, "cache", None) if rt.tools is not None else None


def save_checkpoint(rt: Runtime, stopping: bool = False) -> Path:
    """Actor checkpoint with the driver state, then the tool cache snapshot inside it; prunes to keep_last.
    Off-policy batch calls still running (``rollout.in_flight_updates``) finish first, or with ``stopping`` (a
    stop request) are cancelled, so that the buffer, the sampler and the batch numbers saved agree."""
    t = rt.cfg.trainer
    if getattr(rt, "off_policy", None) is not None:
        rt.off_policy.settle(cancel=stopping)
    path = Path(rt.actor.save(str(rt.checkpoint_root), driver_state(rt), step=rt.step, keep_last=t.keep_last,
                              timeout=t.timeouts.save_s))
    cache = _cache(rt)
    if cache is not None:
        cache.export(str(path / TOOL_CACHE_SNAPSHOT))
    if getattr(rt, "off_policy", None) is not None:
        rt.off_policy.save(path)  # the buffer's finished groups (settled above: no call runs)
    rt.last_saved_step = rt.step
    logger.info("checkpoint %s saved", path)
    return path


def restore_driver_state(rt: Runtime, state: dict[str, Any]) -> None:
    """Put back step, sampler and tool cache from the extra state the actor's load returned."""
    if "sampler" not in state:
        raise ResumeError(f"checkpoint {rt.resume_from} has no sampler state (was it written by `megatron-arpo "
                          f"sft`?); resume RL only from RL checkpoints, or start fresh from its HF export")
    rt.step = int(state["step"])
    rt.policy_version = rt.step  # one update per step
    rt.last_saved_step = rt.step
    rt.sampler.load_state_dict(state["sampler"])
    saved_seed = (state.get("rollout") or {}).get("seed")
    if saved_seed is not None and saved_seed != rt.cfg.rollout.seed:
        logger.warning("rollout.seed changed from %s to %s since the checkpoint: resumed rollouts will differ",
                       saved_seed, rt.cfg.rollout.seed)
    cache = _cache(rt)
    if state.get("tool_cache") and cache is not None:
        snapshot = Path(rt.resume_from) / state["tool_cache"]
        if snapshot.exists():
            logger.info("tool cache: merged %d entries from %s", cache.import_(str(snapshot)), snapshot)
        else:
            logger.warning("checkpoint %s lists a tool cache snapshot that is missing; continuing with the live "
                           "cache only", rt.resume_from)
    if getattr(rt, "off_policy", None) is not None:
        rt.off_policy.restore(Path(rt.resume_from), state.get("off_policy"))
    elif state.get("off_policy"):
        logger.warning("checkpoint %s holds an off-policy rollout buffer; trainer.mode: sync does not use it, so the "
                       "prompts of its groups are skipped this epoch", rt.resume_from)
    logger.info("resumed at step %d of %d (epoch %d, position %d)", rt.step, rt.total_steps, rt.sampler.epoch,
                rt.sampler.position)


def export_hf(rt: Runtime) -> Path:
    """The final HF checkpoint (safetensors, config, tokenizer) of the policy in ``<run_dir>/hf``."""
    out = rt.run_dir / "hf"
    rt.actor.workers.call_all("write_hf_checkpoint", str(out), timeout=rt.cfg.trainer.timeouts.save_s)
    logger.info("HF checkpoint of the final policy: %s", out)
    return out


def config_digest(cfg: Any) -> str:
    """sha256 of the resolved config (paths absolute, as the runtime holds it)."""
    return hashlib.sha256(json.dumps(with_absolute_paths(cfg).to_dict(), sort_keys=True, default=str)
                          .encode()).hexdigest()


def write_finished(rt: Any, hf_dir: Optional[Path]) -> None:
    """``<run_dir>/finished.json``: this config's run is done, at this checkpoint, with this export."""
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.actor.checkpoint import latest_checkpoint

    last = latest_checkpoint(Path(rt.run_dir) / "checkpoints")  # Runtime.checkpoint_root
    record = {"step": rt.step, "total_steps": rt.total_steps, "checkpoint": last.name if last else None,
              "hf": str(hf_dir) if hf_dir else None, "config_sha256": config_digest(rt.cfg)}
    with atomic_write(Path(rt.run_dir) / FINISHED) as fh:
        fh.write(json.dumps(record, indent=2) + "\n")


def finished_run(cfg: Any, resume: str) -> Optional[dict[str, Any]]:
    """The finished record of this run when rerunning it would do nothing: ``--resume auto``, the same
    config, the same newest checkpoint, and the HF export (if it made one) still there. Else None."""
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.actor.checkpoint import latest_checkpoint

    path = Path(cfg.run_dir) / FINISHED
    if (resume or "auto").strip() != "auto" or not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    last = latest_checkpoint(Path(cfg.run_dir) / "checkpoints")
    if not isinstance(record, dict) or last is None or record.get("checkpoint") != last.name:
        return None
    if record.get("config_sha256") != config_digest(cfg):
        return None  # more epochs, other data, ...: the runtime decides what is left to do
    if cfg.trainer.export_hf_at_end and not (record.get("hf") and (Path(record["hf"]) / "config.json").exists()):
        return None  # the export is missing: redo it
    return record
