"""What one model family (one Hugging Face ``model_type``) is, as data: the type each ``models/<family>.py`` fills in.

A family module holds everything the project needs to know about that architecture, and nothing else
has a per-family branch:

- the HF ``config.json`` side: the architecture class, the fields the family fixes (``implicit_fields``,
  which HF leaves out of config.json or assumes), values a checkpoint must have for us to load it exactly
  (``required_hf_values``: ``mlp_bias: false``, ``use_sliding_window: false``), the RoPE scaling types it
  supports, whether ``head_dim`` is derived from ``hidden_size / num_attention_heads``, and the extra
  keys written back to config.json;
- the Megatron side, as plain keyword data consumed by :mod:`megatron_arpo.actor.model_builder` (the only
  package that imports ``megatron.core``): ``transformer_config`` entries for ``TransformerConfig`` and
  the layer spec (``qk_layernorm``, ``add_qkv_bias``);
- the weight mapping table (:mod:`megatron_arpo.models.rules`), from which every tensor shape is derived
  (:meth:`ModelFamily.hf_tensor_shapes`): there is no hand-written shape list anywhere else.

Families are found by :mod:`megatron_arpo.models.registry`; adding one is adding its module (plus a model
YAML and tests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from megatron_arpo.models.config import MOE_FIELDS

if TYPE_CHECKING:
    from megatron_arpo.models.config import ModelConfig
    from megatron_arpo.models.rules import Rule

LAYER = "{layer}"
EXPERT = "{expert}"


def _yaml_value(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _shown(value: Any) -> str:
    return str(list(value) if isinstance(value, tuple) else value)


def _no_fields(cfg: ModelConfig) -> Mapping[str, Any]:
    return {}


@dataclass(frozen=True)
class ModelFamily:
    """One HF ``model_type``: its config.json conventions, its Megatron choices and its weight mapping."""

    model_type: str
    hf_architecture: str
    # Weight mapping, in Megatron's parameter order (embedding, layer rules with {layer}, final norm, output).
    table: tuple[Rule, ...]
    # TransformerConfig / layer-spec keywords this family fixes (qk_layernorm, add_qkv_bias).
    transformer_config: Mapping[str, Any]
    # Model-config fields the family fixes; the HF config class assumes them when config.json omits them.
    implicit_fields: Mapping[str, Any]
    # config.json keys (not modelled by ModelConfig) that must have this value, else the model would not
    # be the one we build; absent keys take the HF default, which must be the value here too.
    required_hf_values: Mapping[str, Any] = field(default_factory=dict)
    # Model-config fields not written to config.json (the HF config class has no such key).
    hf_omitted_fields: tuple[str, ...] = ()
    # Keys written to config.json that are not architecture fields but that HF expects.
    extra_hf_fields: Mapping[str, Any] = field(default_factory=dict)
    # config.json keys computed from the model config (Qwen's max_window_layers, sliding_window).
    derived_hf_fields: Callable[[ModelConfig], Mapping[str, Any]] = _no_fields
    # head_dim must equal hidden_size / num_attention_heads (the HF model class derives it).
    head_dim_derived: bool = False
    # RoPE scaling types (``rope_scaling.rope_type``) this family supports besides plain RoPE.
    rope_types: tuple[str, ...] = ()
    # Mixture of experts: the model config must set every MoE field (models.config.MOE_FIELDS); a dense
    # family must set none of them.
    moe: bool = False
    # TransformerConfig keywords computed from the model config (the MoE router, experts and dispatcher).
    moe_transformer_config: Callable[[ModelConfig], Mapping[str, Any]] = _no_fields
    # Values transformers' config class assumes for keys a config.json may omit (Qwen3-MoE's
    # norm_topk_prob defaults to false there, though every release writes true).
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)

    def check(self, cfg: ModelConfig, where: str) -> None:
        """Refuse a model config this family cannot build, naming the key and the fix."""
        for key, implied in self.implicit_fields.items():
            if getattr(cfg, key) != implied:
                raise ValueError(
                    f"{where}: model_type {cfg.model_type!r} always has {key}={_shown(implied)}, but the config "
                    f"says {_shown(getattr(cfg, key))}; set {key}: {_yaml_value(implied)}")
        unset = [key for key in MOE_FIELDS if getattr(cfg, key) is None]
        if self.moe and unset:
            raise ValueError(f"{where}: model_type {cfg.model_type!r} is a mixture-of-experts model and needs "
                             f"{unset}; copy them from the checkpoint's config.json")
        if not self.moe and len(unset) < len(MOE_FIELDS):
            set_keys = [key for key in MOE_FIELDS if key not in unset]
            raise ValueError(f"{where}: model_type {cfg.model_type!r} is a dense model, but the config sets the "
                             f"mixture-of-experts field(s) {set_keys}; remove them, or use the MoE model_type "
                             f"(qwen3_moe) if the checkpoint has experts")
        if self.head_dim_derived and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise ValueError(
                f"{where}: {cfg.model_type} derives head_dim from hidden_size/num_attention_heads = "
                f"{cfg.hidden_size // cfg.num_attention_heads}, but head_dim is {cfg.head_dim}; set head_dim: "
                f"{cfg.hidden_size // cfg.num_attention_heads}")
        if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type not in self.rope_types:
            allowed = list(self.rope_types) or "none: remove rope_scaling"
            raise ValueError(
                f"{where}: model_type {cfg.model_type!r} does not support rope_scaling.rope_type "
                f"{cfg.rope_scaling.rope_type!r}; supported: {allowed}")

    def check_hf_values(self, hf_config: Mapping[str, Any], where: str) -> None:
        for key, want in self.required_hf_values.items():
            have = hf_config.get(key, want)
            if have != want:
                raise ValueError(
                    f"{where}: {key} is {have!r}, but megatron-arpo builds {self.model_type} models with {key}="
                    f"{want!r} only; this checkpoint's architecture is not supported")

    def hf_tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every HF tensor of a checkpoint of ``cfg``, layer by layer (embedding first; within a layer, expert
        by expert), with its shape."""
        layer_rules = [rule for rule in self.table if LAYER in rule.megatron]
        head = [rule for rule in self.table if LAYER not in rule.megatron and rule.megatron.startswith("embedding.")]
        tail = [rule for rule in self.table if LAYER not in rule.megatron and rule not in head]
        out: dict[str, tuple[int, ...]] = {}

        def add(rule: Rule, layer: int | None, expert: int | None = None) -> None:
            for name, shape in rule.hf_shapes(cfg).items():
                name = name if layer is None else name.replace(LAYER, str(layer))
                out.setdefault(name if expert is None else name.replace(EXPERT, str(expert)), shape)

        for rule in head:
            add(rule, None)
        for layer in range(cfg.num_hidden_layers):
            for rule in layer_rules:
                if EXPERT in rule.megatron:
                    for expert in range(cfg.num_experts or 0):
                        add(rule, layer, expert)
                else:
                    add(rule, layer)
        for rule in tail:
            add(rule, None)
        return out
