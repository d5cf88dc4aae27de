"""``trainer.deterministic``: the settings that make a GPU run repeat bit for bit, and what it cannot cover.

Without the flag a run is already bit-identical on one CPU machine (the e2e test
``tests/e2e/test_train_determinism.py`` guards it): the engines seed every request from the trajectory's
lineage, the scheduler's allocation does not depend on completion order, and the CPU kernels sum in a fixed
order. On a GPU three things break that, and the flag turns each off:

- the actor's kernels: Megatron's ``deterministic_mode`` (its embedding backward without atomics; with
  Transformer Engine it demands ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``), torch's deterministic algorithms
  (``CUBLAS_WORKSPACE_CONFIG`` must then be set), and NCCL reductions in a fixed order (``NCCL_ALGO``);
- the engines' kernels depend on the batch a request shares (split-k GEMMs, attention splits): vLLM's
  batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) makes a request's numbers independent of its batch;
- a search engine on the live web answers differently on a rerun: refused (use the local or an http
  retriever over a frozen index).

What it costs is listed in docs/reproducibility.md. This module imports nothing heavy: the config check runs
in ``config validate``, the environments are handed to Ray actors, and ``apply_torch`` runs in a rank.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

__all__ = ["ACTOR_ENV", "ENGINE_ENV", "actor_env", "apply_actor_settings", "deterministic_problems", "enabled"]

# Read by cuBLAS when a handle is created, by NCCL when a communicator is, by Transformer Engine when its
# attention picks a backend: set before any of those in the rank's process.
ACTOR_ENV: Mapping[str, str] = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",      # torch's deterministic algorithms refuse cuBLAS without it
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",    # Megatron asserts it with TE attention in deterministic_mode
    "NCCL_ALGO": "Ring",                        # one reduction order for every all-reduce
}
# vLLM's GPU worker reads it at start-up (rollout/engine.py: batch_invariant_env, GPU engines only: vLLM's
# batch-invariant ops are Triton kernels its CPU build cannot run).
ENGINE_ENV: Mapping[str, str] = {"VLLM_BATCH_INVARIANT": "1"}
_DETERMINISTIC_NCCL_ALGOS = ("Ring", "Tree", "ring", "tree")


def enabled(cfg: Any) -> bool:
    """``trainer.deterministic`` of an experiment config (False for configs without a trainer section)."""
    return bool(getattr(getattr(cfg, "trainer", None), "deterministic", False))


def actor_env(deterministic: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables an actor rank's process needs; a deterministic ``NCCL_ALGO`` already set is kept."""
    if not deterministic:
        return {}
    env = dict(ACTOR_ENV)
    if environ.get("NCCL_ALGO") in _DETERMINISTIC_NCCL_ALGOS:
        env["NCCL_ALGO"] = environ["NCCL_ALGO"]
    return env


def apply_actor_settings(deterministic: bool) -> None:
    """In an actor rank, before CUDA, NCCL or cuBLAS start: the environment and torch's deterministic mode.

    On CPU torch's switch changes no kernel this project runs (the tests run it there to keep the path
    exercised); on a GPU an op without a deterministic implementation raises instead of running.
    """
    if not deterministic:
        return
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch  # a rank imports torch anyway; this module stays importable without it for config checks

    os.environ.update(actor_env(True))
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def deterministic_problems(cfg: Any) -> list[str]:
    """Settings that ``trainer.deterministic: true`` cannot honour, each with the reason and the fix."""
    if not enabled(cfg):
        return []
    problems = []
    search = cfg.tools.search
    if search.enabled and search.backend == "web":
        problems.append("trainer.deterministic: true with tools.search.backend: web; a live web search answers "
                        "differently on a rerun, so no run can repeat; use backend local or http over a frozen "
                        "index, or set trainer.deterministic: false")
    if cfg.trainer.mode == "off_policy" and cfg.rollout.in_flight_updates:
        problems.append("trainer.deterministic: true with rollout.in_flight_updates: true; the engines take each "
                        "weight update wherever their responses happen to be, so which tokens the old weights "
                        "sample depends on timing; set rollout.in_flight_updates: false (one batch call at a "
                        "time, bit-reproducible) or trainer.deterministic: false")
    if os.environ.get("NCCL_ALGO") and os.environ["NCCL_ALGO"] not in _DETERMINISTIC_NCCL_ALGOS:
        problems.append(f"trainer.deterministic: true but NCCL_ALGO={os.environ['NCCL_ALGO']} is exported; only "
                        "Ring or Tree reduce in a fixed order: unset it or export NCCL_ALGO=Ring")
    return problems
