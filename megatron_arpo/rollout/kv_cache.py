"""The KV cache an engine really got, and the start-up check against the plan.

vLLM sizes its KV cache once, at start: on GPU from ``gpu_memory_utilization`` less what its profile saw
in use (or exactly ``kv_cache_memory_bytes``: ``rollout.kv_cache_gib``), on CPU from
``VLLM_CPU_KVCACHE_SPACE`` (``rollout.cpu_kv_cache_gib``). `kv_cache_info` reads the result from the
engine's config (blocks x block size x bytes per token of one worker), which vLLM fills in after the
engine core allocated the cache, in-process or in its own process. The plan (``launchers.planner``)
needs ``rollout.max_num_seqs`` (the planner's 64 when unset) sequences of ``max_model_len`` tokens per
engine; `check_kv_caches` refuses a smaller cache at start-up, naming the numbers and the fix.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from megatron_arpo.errors import InputError

logger = logging.getLogger(__name__)

GiB = 2**30
PLANNED_CONCURRENCY = 64  # launchers.planner.PlanInput.concurrency: sequences per engine when max_num_seqs is unset


class KvCacheTooSmall(InputError):
    """An engine's KV cache cannot hold the planned sequences."""


def kv_cache_info(vllm_config: Any, engine_index: int = 0) -> dict[str, Any]:
    """What one worker of the engine holds: ``blocks``, ``block_size`` (tokens), ``tokens``,
    ``bytes_per_token`` (K and V of every layer on this worker) and ``bytes``."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = model.dtype if cache.cache_dtype == "auto" else getattr(torch, str(cache.cache_dtype), None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1  # fp8 caches: one byte per element
    per_token = (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
                 * itemsize)
    blocks = int(cache.num_gpu_blocks or 0)
    tokens = blocks * int(cache.block_size)
    return {"engine_index": engine_index, "blocks": blocks, "block_size": int(cache.block_size), "tokens": tokens,
            "bytes_per_token": per_token, "bytes": tokens * per_token,
            "max_model_len": int(model.max_model_len)}


def required_tokens(rollout: Any, max_model_len: int) -> tuple[int, int]:
    """``(sequences, tokens)`` one engine must hold at once: the plan's concurrency x max_model_len."""
    sequences = rollout.max_num_seqs or PLANNED_CONCURRENCY
    return sequences, sequences * max_model_len


def check_kv_caches(infos: Sequence[dict], rollout: Any, on_gpu: bool) -> list[str]:
    """Log each engine's KV cache beside the plan's; raise `KvCacheTooSmall` for the first that is smaller.
    Returns the logged lines."""
    lines = []
    for info in infos:
        sequences, need = required_tokens(rollout, info["max_model_len"])
        need_bytes = need * info["bytes_per_token"]
        line = (f"engine {info['engine_index']}: KV cache {info['bytes'] / GiB:.2f} GiB per worker ({info['tokens']:,} "
                f"tokens in {info['blocks']:,} blocks of {info['block_size']}); the plan needs {need_bytes / GiB:.2f} "
                f"GiB ({sequences} sequences x {info['max_model_len']} tokens = {need:,})")
        logger.info("start-up: %s", line)
        lines.append(line)
        if info["tokens"] < need:
            fix = ("raise rollout.gpu_memory_utilization or set rollout.kv_cache_gib (megatron-arpo plan shows the "
                   "need), lower rollout.max_num_seqs or max_model_len, or enable rollout.enable_sleep_mode"
                   if on_gpu else "raise rollout.cpu_kv_cache_gib, or lower rollout.max_num_seqs or max_model_len")
            set_seqs = "" if rollout.max_num_seqs else f" (rollout.max_num_seqs unset: the plan's {PLANNED_CONCURRENCY})"
            raise KvCacheTooSmall(
                f"vLLM engine {info['engine_index']} got a KV cache of {info['bytes'] / GiB:.2f} GiB per worker "
                f"({info['tokens']:,} tokens), smaller than the plan's {need_bytes / GiB:.2f} GiB ({sequences} "
                f"sequences{set_seqs} x max_model_len {info['max_model_len']} = {need:,} tokens); {fix}")
    return lines
