"""The typed sections of an experiment config: one frozen dataclass per process.

Each field carries its bounds and one line of help (``_f``, :func:`megatron_arpo.config_field.setting`);
``megatron_arpo.config`` builds, coerces and validates these from YAML and ``--set`` overrides, and renders
the config reference from the help text. A section read by one component is defined by that component and
only composed here (``rollout``: :mod:`megatron_arpo.rollout.config`; ``tools``:
:mod:`megatron_arpo.tools.config`; ``launcher``: :mod:`megatron_arpo.cluster.launch_options`; ``algorithm``
is read by the actor's loss as it is). Defaults are the ARPO reference's (docs/design/arpo_reference.md §2.1, §3.3) unless noted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_arpo.config_field import setting
from megatron_arpo.tools.config import (  # noqa: F401  (the tools own their section; composed here)
    PythonToolSection,
    SearchToolSection,
    ToolCacheSection,
    ToolsSection,
)
from megatron_arpo.cluster.launch_options import LauncherSection  # noqa: F401  (composed here)
from megatron_arpo.rollout.config import RolloutSection  # noqa: F401  (composed here)

_f = setting


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
    expert_parallel: int = _f(1, ge=1, help="MoE models: ranks the routed experts are split over (divides num_experts; EP x expert TP divides DP x TP)")
    expert_tensor_parallel: Optional[int] = _f(None, ge=1, help="MoE models: tensor parallelism inside each expert; null = actor.tensor_parallel")
    moe_routing_replay: bool = _f(False, help="MoE models: training forwards use each token's experts recorded by the engines at rollout (R3, docs/moe.md); the engines bind vLLM's routing capturer when the model loads, before compilation")
    moe_replay_diagnostics: bool = _f(False, help="with moe_routing_replay: one more log-prob pass per step on the actor's own routing, to log the mismatch replay removes (rollout/*_unreplayed, docs/moe.md)")
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
# RolloutSection: megatron_arpo/rollout/config.py (the scheduler's RolloutOptions extends it).


# ----------------------------------------------------------------------------------------- algorithm
@dataclass(frozen=True)
class KLSection:
    coef: float = _f(0.0, ge=0, help="KL loss coefficient; > 0 needs algorithm.use_reference")
    kind: Literal["k1", "k2", "k3", "low_var_kl"] = _f("low_var_kl")


@dataclass(frozen=True)
class AlgorithmSection:
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
    behaviour_weight_cap: float = _f(2.0, gt=1, help="trainer.mode: off_policy: decoupled PPO's importance weight pi_prox/pi_behav is truncated at this value (megatron_arpo/algo/off_policy.py)")


# --------------------------------------------------------------------------------------------- tools
# PythonToolSection, SearchToolSection, ToolCacheSection, ToolsSection: megatron_arpo/tools/config.py,
# with the tools that read them.


# ---------------------------------------------------------------------------------------------- data
# The names megatron_arpo.rewards.get_reward_fn knows (kept in sync by a test).
BUILTIN_REWARDS = ("deep_research", "math", "qa_em", "qa_f1")


@dataclass(frozen=True)
class DataSection:
    train_files: list[str] = _f(factory=list, help="parquet/JSONL files")
    val_files: list[str] = _f(factory=list)
    format: Literal["auto", "parquet", "jsonl", "json"] = _f("auto", help="auto = from the file suffix (docs/data.md)")
    prompt_key: Optional[str] = _f(None, help="field holding the question or the prompt messages (RL, eval, SFT rows); "
                                              "null = the accepted names of docs/data.md")
    answer_key: Optional[str] = _f(None, help="field holding the gold answer (dotted: reward_model.ground_truth); "
                                              "null = the accepted names of docs/data.md")
    max_prompt_tokens: int = _f(1536, ge=1, help="longer prompts are filtered out (counted)")
    on_bad_row: Literal["error", "skip"] = _f("error")
    shuffle: bool = _f(True)
    seed: int = _f(42, ge=0)
    drop_last: bool = _f(True)
    system_prompt: Optional[str] = _f(None, help="for rows without their own: a built-in name (default, arpo, none) "
                                                 "or the text; null = default")
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
    mode: Literal["sync", "off_policy"] = _f("sync", help="sync: rollout, then update, then sync, in turn; off_policy (needs placement: separate): the engines generate the next batches into a buffer while the actor trains, at most rollout.max_staleness policy versions behind (docs/off_policy.md)")
    actor_devices: Optional[int] = _f(None, ge=1, help="separate: devices for actor ranks; null = all (colocated)")
    rollout_devices: Optional[int] = _f(None, ge=1, help="separate: devices for engines")
    export_hf_on_save: bool = _f(False)
    export_hf_at_end: bool = _f(True)
    deterministic: bool = _f(False, help="GPU: deterministic kernels in the actor (Megatron deterministic_mode, torch's deterministic algorithms, NCCL_ALGO=Ring) and vLLM's batch-invariant mode in the engines; slower (docs/reproducibility.md)")
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
    progress_bars: bool = _f(True, help="bars on a terminal (false: plain lines there too); a log file always gets a progress line every 30 s")
    tensorboard: bool = _f(False, help="also write TensorBoard scalars to <run_dir>/tensorboard (tensorboard --logdir)")
    metrics_jsonl: bool = _f(True, help="write <run_dir>/metrics.jsonl")
    save_rollout_records: bool = _f(False, help="write <run_dir>/rollouts/step-N.jsonl (+ .stats.json) each step; train --replay-rollouts <run_dir>/rollouts trains on them without engines")


# ------------------------------------------------------------------------------------------ launcher
# LauncherSection: megatron_arpo/cluster/launch_options.py (launchers.options.LauncherOptions extends it).


# ----------------------------------------------------------------------------------------- sft, eval
@dataclass(frozen=True)
class SFTSection:
    train_files: list[str] = _f(factory=list, help="JSON/JSONL/parquet: conversation rows (ShareGPT / messages), "
                                                   "or prompt rows (question/answer, alpaca, ARPO parquet; "
                                                   "data.prompt_key / answer_key) trained on prompt -> answer")
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
