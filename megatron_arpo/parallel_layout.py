"""The run's parallel layout, computed once from the config and passed to whoever needs it.

``ExperimentConfig.layout`` checks the config's sizes (`layout_errors`: TP/PP against the model, the
engines' TP against its heads, TP x PP x DP and the engines against the devices, each problem naming
the key and the fix) and builds the `ParallelLayout` (`ParallelLayout.from_config`: DP derived from
the actor's devices, one replica on CPU-only nodes). The actor group, its workers (`for_world`), the
placement plan, the runtime and the memory probe read it instead of re-deriving the sizes; the planner
sizes candidate layouts with the same pieces, and the converter checks its ``--tp``/``--pp`` with
`model_layout_errors`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

# This module imports nothing of the project, so that everything (the cluster's placement included) can
# stand on it. Hence two names for annotations only: ``cfg`` is a resolved
# ``megatron_arpo.config.ExperimentConfig`` (config.py builds its ``layout`` here), ``model`` a
# ``megatron_arpo.models.config.ModelConfig``.
ExperimentConfigLike = Any
ModelConfigLike = Any

__all__ = ["ParallelLayout", "derive_data_parallel", "engine_tp_errors", "expert_world_errors", "layout_errors",
           "model_layout_errors", "moe_layout_errors", "tensor_parallel_choices"]


@dataclass(frozen=True)
class ParallelLayout:
    """Actor TP x PP x DP, the engines' TP and count, and the devices they run on."""

    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    engine_tp: int
    num_engines: int
    nodes: int
    gpus_per_node: int  # 0: CPU-only nodes, where a "device" is a process slot
    placement: str  # trainer.placement: colocated | separate
    actor_devices: Optional[int] = None  # trainer.actor_devices (separate placement)
    rollout_devices: Optional[int] = None  # trainer.rollout_devices (separate placement)
    ep: int = 1  # actor.expert_parallel: MoE experts split over EP ranks (inside the DP x TP ranks)
    etp: Optional[int] = None  # actor.expert_tensor_parallel; None: the experts' TP is tp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def total_devices(self) -> Optional[int]:
        """GPUs in the job; None on CPU-only nodes."""
        return self.nodes * self.gpus_per_node or None

    @property
    def engine_slots(self) -> int:
        """Devices (CPU: process slots) all engines take together."""
        return self.num_engines * self.engine_tp

    @classmethod
    def from_config(cls, cfg: ExperimentConfigLike) -> "ParallelLayout":
        """The layout of a validated config (`layout_errors` empty: ``ExperimentConfig.layout`` checks)."""
        a, r, t, la = cfg.actor, cfg.rollout, cfg.trainer, cfg.launcher
        return cls(tp=a.tensor_parallel, pp=a.pipeline_parallel,
                   dp=derive_data_parallel(a.tensor_parallel, a.pipeline_parallel,
                                           t.actor_devices or _total_devices(cfg), a.data_parallel),
                   sequence_parallel=a.sequence_parallel, engine_tp=r.tensor_parallel, num_engines=r.num_engines,
                   nodes=la.nodes, gpus_per_node=la.gpus_per_node, placement=t.placement,
                   actor_devices=t.actor_devices, rollout_devices=t.rollout_devices,
                   ep=a.expert_parallel, etp=a.expert_tensor_parallel)

    def for_world(self, world_size: int, data_parallel: Optional[int] = None) -> "ParallelLayout":
        """This layout over a process group of ``world_size`` ranks (an actor worker's actual world, which a
        test may size apart from the devices): DP follows the world, and must be ``data_parallel`` if set."""
        if world_size % (self.tp * self.pp):
            raise ValueError(f"world size {world_size} is not a multiple of actor.tensor_parallel x "
                             f"actor.pipeline_parallel = {self.tp * self.pp}")
        dp = world_size // (self.tp * self.pp)
        if data_parallel is not None and data_parallel != dp:
            raise ValueError(f"actor.data_parallel is {data_parallel} but the world of {world_size} ranks "
                             f"gives {dp} with tp={self.tp}, pp={self.pp}; set it to {dp} or null")
        errors = expert_world_errors(self.tp, dp, self.ep, self.etp)
        if errors:
            raise ValueError("; ".join(errors))
        return dataclasses.replace(self, dp=dp)


def derive_data_parallel(tp: int, pp: int, pool: Optional[int], data_parallel: Optional[int] = None) -> int:
    """DP of an actor of TP x PP on ``pool`` devices (None: CPU-only nodes, one replica unless given)."""
    if data_parallel is not None:
        return data_parallel
    return 1 if pool is None else max(1, pool // (tp * pp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_choices(cfg: ModelConfigLike) -> list[int]:
    """TP sizes this model can take: divisors of the attention heads, KV heads and FFN width alike."""
    return [t for t in _divisors(cfg.num_key_value_heads)
            if cfg.num_attention_heads % t == 0 and cfg.intermediate_size % t == 0]


def expert_world_errors(tp: int, dp: int, ep: int, etp: Optional[int], section: str = "actor") -> list[str]:
    """Megatron places the EP x ETP expert grid inside the DP x TP ranks of a pipeline stage."""
    expert_tp = etp or tp
    if (tp * dp) % (ep * expert_tp):
        valid = [e for e in _divisors(tp * dp) if (tp * dp) % (e * expert_tp) == 0]
        return [f"{section}.expert_parallel: {ep} x expert tensor parallel {expert_tp} = {ep * expert_tp} does not "
                f"divide data_parallel x tensor_parallel = {dp} x {tp} = {tp * dp}; valid values with these sizes: "
                f"{valid}, or add data-parallel ranks"]
    return []


def moe_layout_errors(cfg: ModelConfigLike, expert_parallel: int, expert_tensor_parallel: Optional[int],
                      section: str = "actor") -> list[str]:
    """Problems of an EP / expert-TP layout for this model (a dense model takes only EP 1)."""
    num_experts = getattr(cfg, "num_experts", None)
    if num_experts is None:
        if expert_parallel != 1 or expert_tensor_parallel is not None:
            return [f"{section}.expert_parallel / {section}.expert_tensor_parallel: {cfg.name} is a dense model "
                    f"(no experts); set {section}.expert_parallel: 1 and {section}.expert_tensor_parallel: null"]
        return []
    errors = []
    if num_experts % expert_parallel:
        errors.append(f"{section}.expert_parallel: {expert_parallel} does not divide {cfg.name} num_experts "
                      f"{num_experts}; valid values: {_divisors(num_experts)}")
    if expert_tensor_parallel is not None and cfg.moe_intermediate_size % expert_tensor_parallel:
        errors.append(f"{section}.expert_tensor_parallel: {expert_tensor_parallel} does not divide {cfg.name} "
                      f"moe_intermediate_size {cfg.moe_intermediate_size}; valid values: "
                      f"{_divisors(cfg.moe_intermediate_size)}")
    return errors


def model_layout_errors(cfg: ModelConfigLike, tensor_parallel: int, pipeline_parallel: int,
                        sequence_parallel: bool = False, section: str = "actor", expert_parallel: int = 1,
                        expert_tensor_parallel: Optional[int] = None) -> list[str]:
    """Problems of a TP/PP/SP (and EP/ETP) layout for this model, each naming the key and the values that work."""
    errors = moe_layout_errors(cfg, expert_parallel, expert_tensor_parallel, section)
    tp_ok = tensor_parallel_choices(cfg)
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, what)
        if value % tensor_parallel:
            errors.append(f"{section}.tensor_parallel: {tensor_parallel} does not divide {cfg.name} {what} {value}; "
                          f"valid values: {tp_ok}")
            break
    if pipeline_parallel is not None and cfg.num_hidden_layers % pipeline_parallel:
        errors.append(f"{section}.pipeline_parallel: {pipeline_parallel} does not divide {cfg.name} num_hidden_layers "
                      f"{cfg.num_hidden_layers}; valid values: {_divisors(cfg.num_hidden_layers)}")
    if sequence_parallel and tensor_parallel == 1:
        errors.append(f"{section}.sequence_parallel: true needs {section}.tensor_parallel > 1 (it splits the sequence "
                      f"over the TP ranks); set {section}.sequence_parallel: false, or {section}.tensor_parallel to "
                      f"one of {[t for t in tp_ok if t > 1]}")
    return errors


def engine_tp_errors(model: ModelConfigLike, engine_tp: int) -> list[str]:
    """The engines' TP against the model: it must divide the attention and the KV heads."""
    for what in ("num_attention_heads", "num_key_value_heads"):
        if getattr(model, what) % engine_tp:
            valid = [t for t in range(1, model.num_attention_heads + 1)
                     if model.num_attention_heads % t == 0 and model.num_key_value_heads % t == 0]
            return [f"rollout.tensor_parallel: {engine_tp} does not divide {model.name} {what} "
                    f"{getattr(model, what)}; valid values: {valid}"]
    return []


def _total_devices(cfg: ExperimentConfigLike) -> Optional[int]:
    return cfg.launcher.nodes * cfg.launcher.gpus_per_node or None


def _actor_pool(cfg: ExperimentConfigLike) -> Optional[int]:
    t = cfg.trainer
    return t.actor_devices if t.placement == "separate" else _total_devices(cfg)


def layout_errors(cfg: ExperimentConfigLike, model: ModelConfigLike) -> list[str]:
    """Problems of the config's parallel sizes against the model and the devices (empty: it fits)."""
    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    tp, pp = a.tensor_parallel, a.pipeline_parallel
    errors = model_layout_errors(model, tp, pp, a.sequence_parallel, expert_parallel=a.expert_parallel,
                                 expert_tensor_parallel=a.expert_tensor_parallel)
    if a.expert_parallel > 1 and a.expert_tensor_parallel not in (None, tp):
        errors.append(f"actor.expert_tensor_parallel: {a.expert_tensor_parallel} with actor.expert_parallel "
                      f"{a.expert_parallel}: the weight sync and the HF export stream the experts only when they "
                      f"are split like the dense layers (docs/moe.md); set actor.expert_tensor_parallel: null "
                      f"(= actor.tensor_parallel {tp})")
    errors += engine_tp_errors(model, r.tensor_parallel)
    devices = _total_devices(cfg)
    if t.placement == "separate":
        for key in ("actor_devices", "rollout_devices"):
            if getattr(t, key) is None:
                errors.append(f"trainer.{key}: required when trainer.placement is 'separate'")
        if t.actor_devices and t.rollout_devices and devices and t.actor_devices + t.rollout_devices > devices:
            errors.append(f"trainer.actor_devices + trainer.rollout_devices = {t.actor_devices + t.rollout_devices} "
                          f"exceeds the {devices} devices of launcher.nodes x launcher.gpus_per_node")
    actor_pool = _actor_pool(cfg)
    if actor_pool is not None:
        if actor_pool % (tp * pp):
            errors.append(f"actor.tensor_parallel x actor.pipeline_parallel = {tp * pp} does not divide the "
                          f"{actor_pool} actor devices; choose tp*pp among the divisors of {actor_pool}")
        elif a.data_parallel is not None and tp * pp * a.data_parallel != actor_pool:
            errors.append(f"actor.data_parallel: {a.data_parallel} gives a world of {tp * pp * a.data_parallel} "
                          f"but there are {actor_pool} actor devices; set it to {actor_pool // (tp * pp)} or null")
        else:
            dp = derive_data_parallel(tp, pp, actor_pool, a.data_parallel)
            errors += expert_world_errors(tp, dp, a.expert_parallel, a.expert_tensor_parallel)
    elif a.data_parallel is not None:  # CPU-only nodes: the world is what the config says
        errors += expert_world_errors(tp, a.data_parallel, a.expert_parallel, a.expert_tensor_parallel)
    rollout_pool = t.rollout_devices if t.placement == "separate" else devices
    if rollout_pool is not None and r.num_engines * r.tensor_parallel > rollout_pool:
        errors.append(f"rollout.num_engines x rollout.tensor_parallel = {r.num_engines * r.tensor_parallel} "
                      f"exceeds the {rollout_pool} rollout devices")
    return errors
