"""The ``rollout`` section of an experiment config: engines, sampling and the ARPO/AEPO branching, with defaults.

The one definition of these settings. The experiment config (:mod:`megatron_arpo.config_schema`) composes
:class:`RolloutSection`; the scheduler's options extend it (``rollout.scheduler.RolloutOptions`` adds
``greedy`` and a test-only allow-list) and the engine takes its defaults from it
(``rollout.engine.EngineConfig``, ``SegmentRequest``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_arpo.config_field import setting


@dataclass(frozen=True)
class RolloutSection:
    num_engines: int = setting(1, ge=1, help="vLLM engines in the rollout group")
    tensor_parallel: Optional[int] = setting(None, ge=1, help="TP per engine; null = model config default")
    cpu_kv_cache_gib: float = setting(1.0, gt=0, help="VLLM_CPU_KVCACHE_SPACE per engine on CPU")
    gpu_memory_utilization: float = setting(0.6, gt=0, le=1, help="vLLM share of GPU memory on GPU")
    kv_cache_gib: Optional[float] = setting(None, gt=0, help="GPU: KV cache per engine worker, fixed (vLLM kv_cache_memory_bytes) instead of what gpu_memory_utilization leaves after vLLM's profile; megatron-arpo plan shows the need")
    cpu_omp_threads_bind: Optional[str] = setting(None, help="VLLM_CPU_OMP_THREADS_BIND; null = leave unset")
    max_model_len: Optional[int] = setting(None, ge=1, help="null = data.max_prompt_tokens + response_length")
    max_num_seqs: Optional[int] = setting(None, ge=1, help="vLLM max_num_seqs; null = vLLM default")
    max_num_batched_tokens: Optional[int] = setting(None, ge=1, help="vLLM max_num_batched_tokens; null = vLLM default")
    enable_prefix_caching: bool = setting(True)
    enforce_eager: bool = setting(False, help="vLLM eager mode: no torch.compile graph and no CUDA graphs. The engine starts sooner (no compile) and decodes slower; production keeps the default (compiled)")
    n: int = setting(16, ge=1, le=4096, help="trajectories per prompt (global budget M)")
    initial_rollouts: int = setting(8, ge=1, help="fresh trajectories started per prompt; = n is plain GRPO")
    beam_size: int = setting(2, ge=1, help="a branch decision forks up to beam_size - 1 copies")
    branch_threshold: float = setting(0.5, ge=0, le=1, help="tau. ARPO: branch iff clip(U - beta*dH, 0, 1) <= tau, P = tau + beta*dH; AEPO: branch iff clip((U + beta*dH)*(1 - penalty*c), 0, 1) >= tau, P = 1 - tau + beta*dH at c = 0 (so AEPO's tau = 1 - ARPO's). The published 0.5 assumes branch_timing: reference; with after_result lower it by beta*E[dH at 1st decision] (ARPO) or raise it (AEPO) to get the published first-decision rate (table: megatron_arpo/algo/branching.py)")
    entropy_weight: float = setting(0.2, ge=0, help="beta, weight of the entropy change dH (both variants). The published 0.2 is on the reference estimator's scale; with entropy_estimator: mean use about 0.2*window*ln(logprobs_topk)/ln|V| (0.77 for 20, 10, Qwen; less when segments are shorter than the window)")
    entropy_window: int = setting(20, ge=1, help="tokens after a tool result that the entropy is measured on")
    entropy_estimator: Literal["reference", "mean"] = setting("reference", help="reference: sum over <= window positions / ln/V/, 0..~3.9, grows with segment length (the published tau/beta's scale); mean: per-token top-k entropy / ln k, 0..1, length independent")
    branch_timing: Literal["after_result", "reference"] = setting("after_result", help="after_result: a decision reads the first window tokens after the tool result (dH != 0 from the 1st decision); reference: the segment that ended with the call (1st decision dH = 0, P = tau)")
    logprobs_topk: int = setting(10, ge=1, help="top-k log-probs per position of the entropy window (other tokens: the sampled one's only)")
    entropy_metrics: bool = setting(False, help="measure every segment's entropy (top-k in its first entropy_window tokens) for the rollout/entropy_* metrics; false: only where a branch decision reads it (none in GRPO)")
    variant: Literal["arpo", "aepo"] = setting("arpo", help="branching rule")
    dynamic_initial_rollouts: bool = setting(False, help="AEPO entropy pre-monitoring sets initial_rollouts per prompt")
    initial_entropy_tokens: int = setting(50, ge=1, help="AEPO pre-monitoring: tokens sampled for H_root")
    consecutive_branch_penalty: float = setting(0.05, ge=0, help="AEPO consecutive-branch penalty factor")
    call_limit: int = setting(3, ge=0, help="tool calls per trajectory")
    response_length: int = setting(4096, ge=1, help="tokens after the prompt (model + tool tokens)")
    temperature: float = setting(1.0, gt=0)
    top_p: float = setting(1.0, gt=0, le=1)
    top_k: int = setting(-1, ge=-1, help="-1 disables")
    seed: int = setting(0, ge=0, help="sampling seed and the branch-draw RNG stream")
    scheduler: Literal["async", "barrier"] = setting("async", help="barrier = reference-style rounds (for benchmarks)")
    verify_sync: Literal["first", "true", "false"] = setting(
        "first", help="checksum sampled tensors on both sides of a weight sync: first = the first sync of each "
                      "process (a new run, or a resume), so a wrong transport stops the job at step 1; true = every "
                      "sync; false = none")
    sync_bucket_mb: int = setting(512, ge=1, help="weight-sync bucket size")
    sync_transport: Literal["auto", "gloo", "nccl", "ipc"] = setting(
        "auto", help="weight-sync transport (actor ranks -> engines): auto = gloo on CPU, ipc colocated, nccl "
                     "for separate GPU pools")
    max_staleness: int = setting(1, ge=0, help="trainer.mode: off_policy: a trained token was sampled at most this many policy versions (updates) before the update that trains it; older groups are dropped and counted (0 = on-policy, no overlap)")
    buffer_groups: Optional[int] = setting(None, ge=1, help="trainer.mode: off_policy: prompt groups (whole trees) the rollout buffer holds; null = (max_staleness + 1) x trainer.train_batch_size; at least one batch")
    in_flight_updates: bool = setting(False, help="trainer.mode: off_policy with max_staleness >= 1: batch calls run concurrently up to the staleness bound and keep generating through each weight sync (the engines pause at a step boundary, load the new weights and resume; a trajectory's later tokens carry the new version). Faster when tool latency leaves the engines idle; runs are then not bit-reproducible (the pause point depends on timing). false: one call at a time, and the sync waits for it")
    max_engine_restarts: int = setting(3, ge=0, help="trainer.mode: off_policy: engine actors that die mid-generation are replaced (same placement, current weights) at most this many times per run; their in-flight groups are counted and regenerated. Beyond it the run stops (0: stop at the first death, as sync mode does)")
    enable_sleep_mode: bool = setting(False, help="colocated: vLLM sleeps while the actor trains (CUDA; on CPU the same phase switch runs and frees nothing)")
    sleep_level: int = setting(2, ge=1, le=2, help="1: weights kept in host memory while asleep; 2: dropped (the sync after every update re-sends them)")
