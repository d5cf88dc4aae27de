"""Actor checkpoints: Megatron distributed checkpoints of model + optimizer, RNG, step and extra state.

Layout of one checkpoint (``ROOT/step-N``)::

    step-N/model/        dist_checkpointing (torch_dist) of GPTModel.sharded_state_dict(): Megatron's own keys,
                         global offsets, so it loads at any TP/PP; readable by
                         ``python -m conversion megatron-to-hf step-N`` (it looks in DIR/model)
    step-N/model/hf_extra/  tokenizer + generation_config of the initial HF checkpoint (copied by megatron-to-hf)
    step-N/optim/        dist_checkpointing of the optimizer (``dp_reshardable`` for the distributed
                         optimizer): exp_avg / exp_avg_sq / fp32 main params per parameter, plus step counts
    step-N/rng/rank_R.pt python, numpy, torch (and CUDA) generator states + Megatron's RNG tracker, per rank
    step-N/model_config.yaml  the architecture (megatron-to-hf finds it here)
    step-N/state.json    {"format", "step", "layout": {tp, pp, dp}, "scheduler", "has_optimizer", "extra": {...}}
    step-N/hf/           optional HF export (safetensors + config + tokenizer)
    step-N/COMPLETE      written last

Atomicity: every rank writes into ``ROOT/.tmp-step-N``; after a barrier rank 0 writes ``state.json``,
renames the directory to ``step-N`` and only then writes ``COMPLETE`` (fsynced). :func:`latest_checkpoint`
considers only directories with ``COMPLETE``, so an interrupted save never replaces the last good one.
Then the oldest complete checkpoints beyond ``keep_last`` are deleted. All ranks must see the same
filesystem (a shared one on multi-node jobs).

Loading (:func:`load_checkpoint`): the model always (at any TP/PP); the optimizer and the RNG states only
when the checkpoint's (tp, pp, dp) equals the current layout (otherwise a warning, and the fp32 master
weights are refreshed from the loaded model); the LR scheduler state always. Every pickle it reads goes
through an allow-list (:mod:`megatron_arpo.actor.checkpoint_pickles`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import yaml

from megatron_arpo.ckpt_format.dcp_pickles import ForeignPickleError
from megatron_arpo.ckpt_format.torch_dist import read_dcp_metadata, resolve_checkpoint_dir
from megatron_arpo.actor.checkpoint_pickles import (common_load_strategy, install_restricted_unpickling, load_rng_file,
                                                    refusals_named)
from megatron_arpo.fsutil import fsync_path
from megatron_arpo.hf.checkpoint_io import copy_tokenizer_files

logger = logging.getLogger(__name__)

FORMAT = "megatron-arpo-actor"
COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step-(\d+)$")
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


def step_dir_name(step: int) -> str:
    return f"step-{int(step)}"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete ``step-N`` directory with the largest N under ``root`` (``root`` itself if complete)."""
    root = Path(root)
    if (root / COMPLETE).exists():
        return root
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and (child / COMPLETE).exists():
            step = int(match.group(1))
            if best is None or step > best[0]:
                best = (step, child)
    return None if best is None else best[1]





def check_shard_files(directory: str | os.PathLike) -> list[str]:
    """Problems of one torch distributed-checkpoint directory (``model/`` or ``optim/``), without loading it:
    an unreadable ``.metadata`` (or one naming a class outside the allow-list: nothing of it runs), or a
    ``.distcp`` shard that is missing or shorter than the bytes the metadata places in it (a copy or a
    save cut short). Empty when every shard is whole."""
    directory = Path(directory)
    meta_path = directory / ".metadata"
    try:
        _, storage = read_dcp_metadata(meta_path)
    except ForeignPickleError as exc:
        return [f"{meta_path}: {str(exc).removeprefix(f'{meta_path}: ')}"]
    except Exception as exc:  # pickle raises EOF/OSError/... variants for a damaged .metadata
        return [f"{meta_path}: unreadable ({type(exc).__name__}: {exc})"]
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing (the metadata places {size} bytes in it)")
        elif path.stat().st_size < size:
            problems.append(f"{path}: truncated ({path.stat().st_size} bytes; the metadata needs {size})")
    return problems


def _write_file(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def rng_state() -> dict[str, Any]:
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _save_strategy(fully_parallel: bool):
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    if fully_parallel and parallel_state.get_data_parallel_world_size() > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    return strategy


def save_checkpoint(root: str | os.PathLike, step: int, *, model, optimizer=None, scheduler=None, model_cfg,
                    layout: dict[str, int], extra_state: dict | None = None, keep_last: int | None = None,
                    tokenizer_dir: str | os.PathLike | None = None, fully_parallel: bool = True,
                    hf_writer=None) -> Path:
    """Collective over all ranks; returns ``ROOT/step-N``. ``model`` is the bare GPTModel of this rank.

    ``hf_writer(out_dir)``, if given, is called on every rank (it is collective) to add ``step-N/hf``.
    """
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import dist_checkpointing

    root = Path(root)
    rank = dist.get_rank()
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    extra_state = dict(extra_state or {})
    try:
        json.dumps(extra_state)
    except TypeError as exc:
        raise ValueError(f"extra_state must be JSON-serialisable (sampler state, paths, numbers): {exc}") from exc
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by an interrupted save
        for sub in ("model", "optim", "rng"):
            (tmp / sub).mkdir(parents=True)
    dist.barrier()
    # Every rank creates what it writes into: rank 0 made it before the barrier, but on a network
    # filesystem another node may not see a fresh directory yet.
    for sub in ("model", "optim", "rng"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save(model_sd, str(tmp / "model"), sharded_strategy=_save_strategy(fully_parallel))
    has_optimizer = optimizer is not None
    if has_optimizer:
        optim_sd = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=False, metadata=OPTIM_METADATA)
        dist_checkpointing.save(optim_sd, str(tmp / "optim"), sharded_strategy=_save_strategy(fully_parallel))
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if hf_writer is not None:
        hf_writer(tmp / "hf")
    dist.barrier()
    if rank == 0:
        state = {"format": FORMAT, "version": 1, "step": int(step), "layout": dict(layout),
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "has_optimizer": has_optimizer, "model_config": model_cfg.name, "extra": extra_state}
        publish_checkpoint(root, step, state, model_cfg=model_cfg, tokenizer_dir=tokenizer_dir, keep_last=keep_last)
    dist.barrier()
    return final


def publish_checkpoint(root: str | os.PathLike, step: int, state: dict, *, model_cfg,
                       tokenizer_dir: str | os.PathLike | None = None, keep_last: int | None = None) -> Path:
    """Rank 0's part of :func:`save_checkpoint`, after every rank wrote its shards into ``.tmp-step-N``.

    Writes ``state.json``, the model config and the tokenizer files, renames the directory to ``step-N``
    (replacing an older one of that step), writes ``COMPLETE`` and prunes to ``keep_last``.
    """
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    _write_file(tmp / "state.json", json.dumps(state, indent=2, sort_keys=True) + "\n")
    _write_file(tmp / "model_config.yaml", yaml.safe_dump(model_cfg.to_dict(), sort_keys=False))
    if tokenizer_dir is not None:
        extra = tmp / "model" / "hf_extra"
        extra.mkdir(exist_ok=True)
        copy_tokenizer_files(tokenizer_dir, extra)
        if (Path(tokenizer_dir) / "generation_config.json").exists():
            shutil.copy2(Path(tokenizer_dir) / "generation_config.json", extra / "generation_config.json")
    old = None
    if final.exists():
        old = root / f".old-{step_dir_name(step)}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _write_file(final / COMPLETE, f"{int(step)}\n")
    fsync_path(final)
    fsync_path(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last:
        prune_checkpoints(root, keep_last)
    logger.info("saved checkpoint %s", final)
    return final


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (and incomplete ``step-*`` older than those)."""
    steps = sorted(((int(m.group(1)), c) for c in Path(root).iterdir() if (m := _STEP_RE.match(c.name))),
                   key=lambda item: item[0])
    complete = [item for item in steps if (item[1] / COMPLETE).exists()]
    keep = {path for _, path in complete[-keep_last:]}
    oldest_kept = min((s for s, p in complete if p in keep), default=None)
    removed = []
    for step, path in steps:
        if path in keep or (oldest_kept is not None and step > oldest_kept):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def resolve_load_dir(path: str | os.PathLike) -> tuple[Path, Path]:
    """``(checkpoint dir, model dir)`` for a checkpoint root, a ``step-N`` dir or a plain Megatron checkpoint."""
    path = Path(path)
    ckpt = latest_checkpoint(path)
    if ckpt is not None:
        return ckpt, ckpt / "model"
    try:
        model_dir = resolve_checkpoint_dir(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"no complete checkpoint under {path}: expected step-N/COMPLETE (a training checkpoint root), a "
            f"step-N directory, or a Megatron checkpoint with metadata.json (e.g. from `python -m conversion "
            f"hf-to-megatron`)") from exc
    return path, model_dir


def init_empty_optimizer_state(optimizer) -> None:
    """Give a never-stepped torch Adam its state tensors (zeros, step 0) before a checkpoint is loaded into it.

    Megatron 0.16.1's ``DistributedOptimizer.state_dict()`` reads one ``step`` from the per-parameter states
    when neither Apex nor TE is installed, and asserts there is exactly one: a fresh optimizer has none
    (its ``init_state_fn`` adds exp_avg/exp_avg_sq but no step). The values are overwritten by the load.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param.data)
                    state["exp_avg_sq"] = torch.zeros_like(param.data)


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """Put the saved Adam step count back into every parameter state of a distributed optimizer.

    Megatron 0.16.1 (torch Adam, no Apex/TE): ``load_state_dict`` sets each state's ``step`` from the saved
    param groups, but the ``dp_reshardable`` parameter state then copies the *current* local step (a
    non-persistent object) over it, so a fresh optimizer would resume with step 0 and the wrong Adam bias
    correction. The saved value is in ``loaded["optimizer"]["param_groups"][*]["step"]``.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded] if len(chained) == 1 else [v for _, v in sorted(loaded.items())]
    for opt, state in zip(chained, states):
        groups = (state.get("optimizer") or {}).get("param_groups", []) if isinstance(state, dict) else []
        steps = {g["step"] for g in groups if g.get("step") is not None}
        inner = getattr(opt, "optimizer", None)
        if len(steps) != 1 or inner is None:
            continue
        step = float(steps.pop())
        for param_state in inner.state.values():
            if "step" in param_state:
                param_state["step"] = torch.tensor(step, dtype=param_state["step"].dtype)


def load_checkpoint(path: str | os.PathLike, *, model, optimizer=None, scheduler=None, layout: dict[str, int],
                    load_optimizer: bool = True) -> dict[str, Any]:
    """Collective; restores what the layout allows and returns ``{"step", "extra", "full_state"}``."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import dist_checkpointing

    ckpt, model_dir = resolve_load_dir(path)
    state_path = ckpt / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    install_restricted_unpickling()  # no pickle of the checkpoint runs code (checkpoint_pickles.py)
    model_sd = model.sharded_state_dict()
    with refusals_named():
        loaded = dist_checkpointing.load(model_sd, str(model_dir), common_strategy=common_load_strategy())
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"checkpoint {model_dir} did not provide {missing[:8]} ({len(missing)} tensors)")
    same_layout = state.get("layout") == dict(layout)
    full = False
    if optimizer is not None:
        if load_optimizer and state.get("has_optimizer") and same_layout and (ckpt / "optim").exists():
            init_empty_optimizer_state(optimizer)
            with torch.no_grad():  # fp32 main params are views of the (leaf) model parameters
                optim_sd = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True,
                                                        metadata=OPTIM_METADATA)
                with refusals_named():
                    loaded_optim = dist_checkpointing.load(optim_sd, str(ckpt / "optim"),
                                                           common_strategy=common_load_strategy())
                optimizer.load_state_dict(loaded_optim)
                _restore_adam_steps(optimizer, loaded_optim)
            full = True
        else:
            if state.get("has_optimizer") and load_optimizer:
                logger.warning("checkpoint %s was saved with layout %s, running %s: loading model weights only "
                               "(fresh optimizer state)", ckpt, state.get("layout"), layout)
            with torch.no_grad():
                optimizer.reload_model_params()
    if scheduler is not None and state.get("scheduler"):
        scheduler.load_state_dict(state["scheduler"])
    rng_file = ckpt / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if same_layout and rng_file.exists():
        set_rng_state(load_rng_file(rng_file))
    dist.barrier()
    logger.info("loaded checkpoint %s (%s)", ckpt, "full state" if full else "model weights")
    return {"step": int(state.get("step", 0)), "extra": state.get("extra", {}), "full_state": full}
