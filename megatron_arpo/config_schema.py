"""The typed sections of an experiment config: one frozen dataclass per process.

Each field carries its bounds and one line of help (``_f``); ``megatron_arpo.config`` builds, coerces and
validates these from YAML and ``--set`` overrides, and renders the config reference from the help text.
Defaults are the ARPO reference's (ARPO_REFERENCE.md §2.1, §3.3) unless noted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

def _f(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, ge: float | None = None,
       gt: float | None = None, le: float | None = None, lt: float | None = None, help: str = "") -> Any:
    """A dataclass field carrying its numeric bounds and one line of help for the config reference."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "help": help}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelSection:
    config: Optional[str] = _f(None, help="required: a model_configs/ name (qwq-32b) or a model YAML path")
    hf_checkpoint: Optional[str] = _f(None, help="HF checkpoint dir to initialise from (policy and reference)")
    tokenizer: Optional[str] = _f(None, help="tokenizer dir; null = hf_checkpoint")


# --------------------------------------------------------------------------------------------- actor
@dataclass(frozen=True)
class OptimizerSection:
    lr: float = _f(1e-6, gt=0, help="peak learning rate")
    min_lr: float = _f(0.0, ge=0, help="floor of the cosine schedule")
    lr_schedule: Literal["constant", "cosine"] = _f("constant")
    lr_warmup_steps: int = _f(0, ge=0, help="optimizer steps of linear warmup")
    weight_decay: float = _f(0.01, ge=0)
    adam_beta1: float = _f(0.9, ge=0, lt=1)
    adam_beta2: float = _f(0.999, ge=0, lt=1)
    adam_eps: float = _f(1e-8, gt=0)
    clip_grad: float = _f(1.0, ge=0, help="global grad-norm clip; 0 disables")


@dataclass(frozen=True)
class ActorCheckpointSection:
    save_optimizer: bool = _f(True, help="include optimizer states (needed for exact resume)")
    load_optimizer: bool = _f(True, help="restore optimizer states on resume")
    fully_parallel_save: bool = _f(True, help="spread the save over data-parallel ranks")


@dataclass(frozen=True)
class ActorSection:
    tensor_parallel: Optional[int] = _f(None, ge=1, help="null = model config default")
    pipeline_parallel: Optional[int] = _f(None, ge=1, help="null = model config default")
    data_parallel: Optional[int] = _f(None, ge=1, help="null = actor devices / (tp*pp)")
    sequence_parallel: bool = _f(False, help="Megatron sequence parallelism (needs tp > 1); rows padded to a multiple of tp")
    micro_batch_tokens: int = _f(16384, ge=1, help="token budget of one packed micro-batch")
    logprob_micro_batch_tokens: Optional[int] = _f(None, ge=1, help="budget for log-prob passes; null = micro_batch_tokens")
    mini_batch_size: int = _f(16, ge=1, help="prompts per optimizer step (each brings rollout.n trajectories)")
    ppo_epochs: int = _f(1, ge=1)
    optimizer: OptimizerSection = _f(factory=OptimizerSection)
    use_distributed_optimizer: bool = _f(True)
    recompute: Literal["none", "selective", "full"] = _f("none", help="activation recomputation: selective = core attention, full = every layer")
    params_dtype: Literal["fp32", "bf16"] = _f("bf16")
    use_te: Literal["auto", "true", "false"] = _f("auto", help="Transformer Engine layer spec; auto = when importable on GPU (else a loud fallback, refused at >= 8192-token micro-batches)")
    seed: int = _f(1234, ge=0)
    checkpoint: ActorCheckpointSection = _f(factory=ActorCheckpointSection)
    offload: bool = _f(False, help="colocated: grad buffers freed and optimizer state in host memory between updates (the weights stay)")

    @property
    def use_te_flag(self) -> bool | None:
        """``use_te`` as model_builder.resolve_use_te takes it: None = decide from the machine."""
        return {"auto": None, "true": True, "false": False}[self.use_te]


# ------------------------------------------------------------------------------------------- rollout
@dataclass(frozen=True)
class RolloutSection:
    num_engines: int = _f(1, ge=1, help="vLLM engines in the rollout group")
    tensor_parallel: Optional[int] = _f(None, ge=1, help="TP per engine; null = model config default")
    cpu_kv_cache_gib: float = _f(1.0, gt=0, help="VLLM_CPU_KVCACHE_SPACE per engine on CPU")
    gpu_memory_utilization: float = _f(0.6, gt=0, le=1, help="vLLM share of GPU memory on GPU")
    cpu_omp_threads_bind: Optional[str] = _f(None, help="VLLM_CPU_OMP_THREADS_BIND; null = leave unset")
    max_model_len: Optional[int] = _f(None, ge=1, help="null = data.max_prompt_tokens + response_length")
    max_num_seqs: Optional[int] = _f(None, ge=1, help="vLLM max_num_seqs; null = vLLM default")
    max_num_batched_tokens: Optional[int] = _f(None, ge=1, help="vLLM max_num_batched_tokens; null = vLLM default")
    enable_prefix_caching: bool = _f(True)
    n: int = _f(16, ge=1, le=4096, help="trajectories per prompt (global budget M)")
    initial_rollouts: int = _f(8, ge=1, help="fresh trajectories started per prompt; = n is plain GRPO")
    beam_size: int = _f(2, ge=1, help="a branch decision forks up to beam_size - 1 copies")
    branch_threshold: float = _f(0.5, ge=0, le=1, help="tau. ARPO: branch iff clip(U - beta*dH, 0, 1) <= tau, P = tau + beta*dH; AEPO: branch iff clip((U + beta*dH)*(1 - penalty*c), 0, 1) >= tau, P = 1 - tau + beta*dH at c = 0 (so AEPO's tau = 1 - ARPO's). The published 0.5 assumes branch_timing: reference; with after_result lower it by beta*E[dH at 1st decision] (ARPO) or raise it (AEPO) to get the published first-decision rate (table: megatron_arpo/algo/branching.py)")
    entropy_weight: float = _f(0.2, ge=0, help="beta, weight of the entropy change dH (both variants). The published 0.2 is on the reference estimator's scale; with entropy_estimator: mean use about 0.2*window*ln(logprobs_topk)/ln|V| (0.77 for 20, 10, Qwen; less when segments are shorter than the window)")
    entropy_window: int = _f(20, ge=1, help="tokens after a tool result that the entropy is measured on")
    entropy_estimator: Literal["reference", "mean"] = _f("reference", help="reference: sum over <= window positions / ln/V/, 0..~3.9, grows with segment length (the published tau/beta's scale); mean: per-token top-k entropy / ln k, 0..1, length independent")
    branch_timing: Literal["after_result", "reference"] = _f("after_result", help="after_result: a decision reads the first window tokens after the tool result (dH != 0 from the 1st decision); reference: the segment that ended with the call (1st decision dH = 0, P = tau)")
    logprobs_topk: int = _f(10, ge=1, help="top-k log-probs per position of the entropy window (other tokens: the sampled one's only)")
    variant: Literal["arpo", "aepo"] = _f("arpo", help="branching rule")
    dynamic_initial_rollouts: bool = _f(False, help="AEPO entropy pre-monitoring sets initial_rollouts per prompt")
    initial_entropy_tokens: int = _f(50, ge=1, help="AEPO pre-monitoring: tokens sampled for H_root")
    consecutive_branch_penalty: float = _f(0.05, ge=0, help="AEPO consecutive-branch penalty factor")
    call_limit: int = _f(3, ge=0, help="tool calls per trajectory")
    response_length: int = _f(4096, ge=1, help="tokens after the prompt (model + tool tokens)")
    temperature: float = _f(1.0, gt=0)
    top_p: float = _f(1.0, gt=0, le=1)
    top_k: int = _f(-1, ge=-1, help="-1 disables")
    seed: int = _f(0, ge=0, help="sampling seed and the branch-draw RNG stream")
    scheduler: Literal["async", "barrier"] = _f("async", help="barrier = reference-style rounds (for benchmarks)")
    verify_sync: bool = _f(False, help="checksum sampled tensors on both sides of every weight sync")
    sync_bucket_mb: int = _f(512, ge=1, help="weight-sync bucket size")
    sync_transport: Literal["auto", "gloo", "nccl", "ipc"] = _f(
        "auto", help="weight-sync transport (actor ranks -> engines): auto = gloo on CPU, ipc colocated, nccl "
                     "for separate GPU pools")
    enable_sleep_mode: bool = _f(False, help="colocated: vLLM sleeps while the actor trains (CUDA; on CPU the same phase switch runs and frees nothing)")
    sleep_level: int = _f(2, ge=1, le=2, help="1: weights kept in host memory while asleep; 2: dropped (the sync after every update re-sends them)")


# ----------------------------------------------------------------------------------------- algorithm
@dataclass(frozen=True)
class KLSection:
    coef: float = _f(0.0, ge=0, help="KL loss coefficient; > 0 needs algorithm.use_reference")
    kind: Literal["k1", "k2", "k3", "low_var_kl"] = _f("low_var_kl")


@dataclass(frozen=True)
class AlgorithmSection:
    advantage: Literal["grpo"] = _f("grpo")
    norm_by_std: bool = _f(True)
    advantage_eps: float = _f(1e-6, gt=0)
    clip_low: float = _f(0.2, gt=0, lt=1)
    clip_high: float = _f(0.2, gt=0)
    dual_clip: Optional[float] = _f(3.0, gt=1, help="dual-clip constant c for negative advantages; null disables")
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = _f("token-mean")
    entropy_balanced_clip: bool = _f(False, help="AEPO gradient-preserving upper clip")
    entropy_aware_advantage: bool = _f(False, help="AEPO A*(1 + alpha*z(H))")
    entropy_advantage_alpha: float = _f(0.2, ge=0)
    kl: KLSection = _f(factory=KLSection)
    use_reference: bool = _f(False, help="compute reference-policy log-probs (needed for kl.coef > 0)")


# --------------------------------------------------------------------------------------------- tools
# Field names match megatron_arpo.tools.registry.build_tools, which takes ``cfg.to_dict()["tools"]``.
@dataclass(frozen=True)
class PythonToolSection:
    enabled: bool = _f(True)
    tag: str = _f("python", help="the <tag>...</tag> the model writes")
    sandbox: Literal["required", "best_effort"] = _f(
        "required", help="required: refuse to start unless every run gets the bubblewrap sandbox; best_effort: "
        "run code without isolation when it is unavailable (warns at every start)")
    timeout_s: float = _f(10.0, gt=0, help="wall clock per run (keep below tools.timeout_s)")
    cpu_s: Optional[int] = _f(None, ge=1, help="CPU seconds of the whole run and of each process; null = ceil(timeout_s)")
    memory_mb: int = _f(2048, ge=16, help="memory of the whole run (cgroup, else a meter) and of each process")
    file_size_mb: int = _f(32, ge=1, help="largest file the code may write (RLIMIT_FSIZE)")
    disk_mb: int = _f(64, ge=1, help="size of the run's private scratch tmpfs (/tmp, also HOME)")
    nproc: int = _f(32, ge=1, help="processes/threads the whole run may add (RLIMIT_NPROC in its user namespace)")
    max_output_chars: int = _f(4000, ge=1, help="output shown to the model is truncated beyond this")
    max_capture_bytes: int = _f(1048576, ge=1, help="output read before the run is stopped")
    user: str = _f("nobody", help="account the code runs as when the trainer runs as root")
    python_executable: Optional[str] = _f(None, help="null = the trainer's base interpreter (stdlib only); a venv "
                                          "made for the model's code exposes its packages read-only")
    isolate_network: bool = _f(True, help="false shares the host network with the code")
    cgroup: Literal["auto", "required", "off"] = _f("auto", help="a memory cgroup per run: auto = when one can be had")
    cgroup_parent: Optional[str] = _f(None, help="delegated cgroup v2 dir (memory in its subtree_control) for the runs")
    auto_print: bool = _f(True, help="print the value of a trailing expression, notebook-style")


@dataclass(frozen=True)
class SearchToolSection:
    enabled: bool = _f(True)
    tag: str = _f("search")
    backend: Literal["local", "http", "web"] = _f("local")
    topk: int = _f(3, ge=1, help="passages returned per query")
    result_chars: int = _f(1000, ge=1, help="per-passage truncation")
    corpus: Optional[str] = _f(None, help="local: JSONL corpus for BM25")
    url: Optional[str] = _f(None, help="http: retriever endpoint")
    index_version: Optional[str] = _f(None, help="http: a name for the index behind url; part of the tool-cache "
                                      "key, change it when the index changes")
    timeout_s: float = _f(30.0, gt=0, help="http/web request timeout")
    api_key_env: str = _f("BRIGHT_DATA_API_KEY", help="web: NAME of the env var holding the key")
    zone: Optional[str] = _f(None, help="web: Bright Data zone")
    location: str = _f("us", help="web: country code of the search market")


@dataclass(frozen=True)
class ToolCacheSection:
    path: Optional[str] = _f(None, help="SQLite file; null = node-local (under $TMPDIR), snapshotted into each checkpoint")
    busy_timeout_s: float = _f(30.0, gt=0)


@dataclass(frozen=True)
class ToolsSection:
    max_concurrency: int = _f(8, ge=1, help="tool calls running at once per rollout process")
    timeout_s: float = _f(30.0, gt=0, help="enforced limit on one call, retries included")
    retries: int = _f(2, ge=0, help="extra attempts after a transport error only (empty output is valid)")
    backoff_s: float = _f(0.5, ge=0, help="first retry delay; doubles each retry")
    backoff_max_s: float = _f(8.0, ge=0)
    python: PythonToolSection = _f(factory=PythonToolSection)
    search: SearchToolSection = _f(factory=SearchToolSection)
    cache: Optional[ToolCacheSection] = _f(factory=ToolCacheSection, help="null disables the cache")

    @property
    def enabled_tags(self) -> list[str]:
        return [t.tag for t in (self.python, self.search) if t.enabled]


# ---------------------------------------------------------------------------------------------- data
# The names megatron_arpo.rewards.get_reward_fn knows (kept in sync by a test).
BUILTIN_REWARDS = ("deep_research", "math", "qa_em", "qa_f1")


@dataclass(frozen=True)
class DataSection:
    train_files: list[str] = _f(factory=list, help="parquet/JSONL files")
    val_files: list[str] = _f(factory=list)
    format: Literal["auto", "parquet", "jsonl"] = _f("auto", help="auto = from the file suffix")
    prompt_key: Optional[str] = _f(None, help="null = the format's own: 'prompt' (parquet) / 'question' (jsonl)")
    max_prompt_tokens: int = _f(1536, ge=1, help="longer prompts are filtered out (counted)")
    on_bad_row: Literal["error", "skip"] = _f("error")
    shuffle: bool = _f(True)
    seed: int = _f(42, ge=0)
    drop_last: bool = _f(True)
    system_prompt: Optional[str] = _f(None, help="JSONL system prompt; null = data.datasets.DEFAULT_SYSTEM_PROMPT")
    chat_template: Optional[str] = _f(None, help="Jinja file; null = the tokenizer's template")
    enable_thinking: Optional[bool] = _f(None, help="passed to the chat template (Qwen3: false = no-think mode); "
                                                    "null = the template's default")
    reward: str = _f("deep_research", help="deep_research | math | qa | dotted.path:function")


# ------------------------------------------------------------------------------------------- trainer
@dataclass(frozen=True)
class TimeoutsSection:
    startup_s: float = _f(900.0, gt=0, help="actors and engines ready")
    rollout_s: float = _f(3600.0, gt=0)
    logprob_s: float = _f(1800.0, gt=0)
    update_s: float = _f(3600.0, gt=0)
    sync_s: float = _f(900.0, gt=0)
    save_s: float = _f(1800.0, gt=0)


@dataclass(frozen=True)
class TrainerSection:
    run_dir: Optional[str] = _f(None, help="null = runs/<name>")
    total_epochs: int = _f(1, ge=1)
    total_steps: Optional[int] = _f(None, ge=1, help="overrides total_epochs when set")
    train_batch_size: int = _f(128, ge=1, help="prompts per RL step")
    save_every: int = _f(5, ge=0, help="steps between checkpoints; 0 = only at the end")
    keep_last: int = _f(3, ge=1, help="checkpoints kept")
    val_every: int = _f(5, ge=0, help="steps between validations; 0 disables")
    val_before_train: bool = _f(False)
    resume: str = _f("auto", help="auto | none | PATH of a checkpoint")
    placement: Literal["colocated", "separate"] = _f("colocated")
    actor_devices: Optional[int] = _f(None, ge=1, help="separate: devices for actor ranks; null = all (colocated)")
    rollout_devices: Optional[int] = _f(None, ge=1, help="separate: devices for engines")
    export_hf_on_save: bool = _f(False)
    export_hf_at_end: bool = _f(True)
    timeouts: TimeoutsSection = _f(factory=TimeoutsSection)


# ------------------------------------------------------------------------------------------- logging
@dataclass(frozen=True)
class WandbSection:
    mode: Literal["auto", "online", "offline", "disabled"] = _f("auto", help="auto = online iff WANDB_API_KEY is set")
    project: str = _f("megatron-arpo")
    entity: Optional[str] = _f(None)
    name: Optional[str] = _f(None, help="null = the experiment name")
    tags: list[str] = _f(factory=list)


@dataclass(frozen=True)
class LoggingSection:
    wandb: WandbSection = _f(factory=WandbSection)
    console_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _f("INFO")
    progress_bars: bool = _f(True)
    metrics_jsonl: bool = _f(True, help="write <run_dir>/metrics.jsonl")
    save_rollout_records: bool = _f(False, help="write <run_dir>/rollouts/step-N.jsonl (+ .stats.json) each step; train --replay-rollouts <run_dir>/rollouts trains on them without engines")


# ------------------------------------------------------------------------------------------ launcher
# Flat, with the field names of launchers.options.LauncherOptions, so that
# ``launcher_options(cfg.launcher, {"run_dir": cfg.trainer.run_dir})`` takes the section as it is.
# The ray_* ports are megatron_arpo.cluster.ports.PortPlan: per-job blocks from ray_port_range, derived
# from the Slurm job id and checked free; ray_node_port_base pins node k to base + k * ray_ports_per_node.
@dataclass(frozen=True)
class LauncherSection:
    nodes: int = _f(1, ge=1)
    gpus_per_node: int = _f(8, ge=0, help="0 = CPU-only nodes")
    cpus_per_task: Optional[int] = _f(None, ge=1, help="CPUs of the one task per node; null = all (needs exclusive)")
    memory_per_node: Optional[str] = _f("all", help="all = --mem=0 (the whole node), a Slurm size (480G), null = site default")
    exclusive: bool = _f(True, help="--exclusive: whole nodes (other jobs' processes would share the GPUs' CPUs)")
    partition: Optional[str] = _f(None)
    account: Optional[str] = _f(None)
    qos: Optional[str] = _f(None)
    time: str = _f("24:00:00", help="Slurm time limit (HH:MM:SS or D-HH:MM:SS); quote it in YAML")
    job_name: str = _f("megatron-arpo")
    container_image: Optional[str] = _f(None, help="pyxis/enroot: srun --container-image")
    container_mounts: Optional[str] = _f(None, help="extra pyxis mounts; submit dir, run dir and data paths are added")
    signal_lead_seconds: int = _f(300, ge=0, le=65535, help="USR1 this long before the time limit")
    requeue: bool = _f(True, help="requeue after a preemption checkpoint")
    max_requeues: int = _f(3, ge=0)
    preempt_exit_code: int = _f(42, ge=1, le=125, help="trainer exit code meaning 'checkpointed, requeue me'")
    preempt_grace_seconds: int = _f(0, ge=0, help="wait for the step after forwarding USR1; 0 = no limit")
    python: str = _f("python", help="interpreter that runs `-m launchers` on the nodes")
    network_interface: Optional[str] = _f(None, help="NCCL/GLOO_SOCKET_IFNAME; null = env, default route")
    ray_port_range: str = _f("20000-32000", help="LO-HI: per-job port blocks, derived from the job id, checked free")
    ray_ports_per_node: int = _f(200, ge=20, help="10 service ports + worker ports per node")
    ray_node_port_base: Optional[int] = _f(None, ge=1024, le=65535, help="pin node 0's block here; null = per job")
    ray_gcs_port: Optional[int] = _f(None, ge=1024, le=65535, help="null = inside the head's block")
    ray_client_server_port: Optional[int] = _f(None, ge=1024, le=65535, help="null = inside the head's block")
    ray_log_sync_seconds: int = _f(60, ge=0, help="copy Ray session logs to <run_dir>/logs/ray this often; 0 = at the end")
    num_cpus: Optional[int] = _f(None, ge=1, help="CPUs Ray advertises per node; null = detected")
    object_store_memory: Optional[int] = _f(None, ge=1, help="bytes per node; null = Ray default")
    ready_timeout: float = _f(300.0, gt=0, help="seconds to wait for the head address and for all nodes")
    temp_root: str = _f("/tmp", help="per-node Ray temp dirs go under it (keep it short: socket paths)")
    env: dict[str, str] = _f(factory=dict, help="extra non-secret env vars exported on every node")
    extra_sbatch: list[str] = _f(factory=list, help="extra '#SBATCH' options, e.g. --exclusive")
    setup_commands: list[str] = _f(factory=list, help="shell lines run on every node before Ray starts")


# ----------------------------------------------------------------------------------------- sft, eval
@dataclass(frozen=True)
class SFTSection:
    train_files: list[str] = _f(factory=list, help="ShareGPT-style JSON/JSONL (conversations, system)")
    max_seq_tokens: int = _f(4096, ge=1, help="longer conversations are truncated")
    epochs: int = _f(3, ge=1)
    global_batch_size: int = _f(16, ge=1, help="conversations per optimizer step")
    lr: float = _f(7e-6, gt=0)
    min_lr: float = _f(0.0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = _f("cosine")
    warmup_fraction: float = _f(0.1, ge=0, lt=1)
    save_every: int = _f(0, ge=0, help="steps between SFT checkpoints; 0 = only at the end (and on preemption)")
    output_dir: Optional[str] = _f(None, help="null = <run_dir>/sft")
    export_hf: bool = _f(True, help="write an HF checkpoint at the end (for the RL stage)")


@dataclass(frozen=True)
class JudgeSection:
    enabled: bool = _f(False)
    url: Optional[str] = _f(None, help="OpenAI-compatible base URL")
    model: Optional[str] = _f(None)
    api_key_env: str = _f("OPENAI_API_KEY", help="NAME of the env var holding the key")
    max_concurrency: int = _f(8, ge=1)
    timeout_s: float = _f(60.0, gt=0)
    retries: int = _f(3, ge=0)


@dataclass(frozen=True)
class EvalSection:
    datasets: list[str] = _f(factory=list)
    data_dir: Optional[str] = _f(None)
    k: int = _f(1, ge=1, help="samples per question (pass@k)")
    temperature: float = _f(0.6, ge=0, help="0 = greedy")
    top_p: float = _f(0.95, gt=0, le=1)
    max_samples: Optional[int] = _f(None, ge=1, help="cap per dataset")
    output_dir: Optional[str] = _f(None, help="null = <run_dir>/eval")
    judge: JudgeSection = _f(factory=JudgeSection)
