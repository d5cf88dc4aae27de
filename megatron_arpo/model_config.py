"""Model architecture configs (``model_configs/*.yaml``): loading, validation, and the HF ``config.json`` side.

A model YAML carries the exact Hugging Face architecture fields of one checkpoint (``hidden_size``,
``head_dim``, ``rope_scaling``, ...) plus default parallelism for its size. This module is pure Python: it
loads and validates those files, compares them with an HF ``config.json`` and renders a ``config.json``
back. What differs between families (fields a family fixes, keys config.json leaves implicit, RoPE scaling
types) comes from the family's module, found in :mod:`megatron_arpo.models.registry` by the exact HF
``model_type``; this module has no per-family branch. Mapping a model config onto Megatron's
``TransformerConfig`` happens in exactly one place, ``megatron_arpo.actor.model_builder``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from megatron_arpo.models.config import MOE_FIELDS, ModelConfig, ParallelDefaults, RopeScaling
from megatron_arpo.models.registry import get_family

__all__ = ["ARCH_FIELDS", "MODEL_CONFIG_DIR", "ModelConfig", "ParallelDefaults", "RopeScaling", "check_hf_config",
           "hf_config_dict", "load_model_config", "model_config_from_dict", "model_config_from_hf",
           "read_hf_config", "resolve_model_config_path"]



def _model_config_dir() -> Path:
    """``model_configs/`` of a source checkout, else the copy an installed package carries (setup.py)."""
    checkout = Path(__file__).resolve().parent.parent / "model_configs"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parent / "model_configs"


MODEL_CONFIG_DIR = _model_config_dir()


ROPE_TYPES = ("llama3",)


def rope_scaling_from_dict(data: Any, where: str) -> RopeScaling | None:
    """Validate a ``rope_scaling`` mapping (YAML, or HF with the legacy ``type`` key); ``None`` for plain RoPE."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: rope_scaling must be a mapping or null, got {data!r}")
    data = dict(data)
    legacy_type = data.pop("type", None)  # transformers < 4.45 wrote "type" (later ones may write both)
    if legacy_type is not None:
        data.setdefault("rope_type", legacy_type)
    data.pop("rope_theta", None)  # transformers >= 5 keeps rope_theta inside rope_parameters
    rope_type = data.get("rope_type", "default")
    if rope_type == "default" and set(data) <= {"rope_type"}:
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_scaling.rope_type {rope_type!r} is not supported; supported: "
                         f"{list(ROPE_TYPES)} (or rope_scaling: null for plain RoPE)")
    names = [f.name for f in dataclasses.fields(RopeScaling)]
    missing = [k for k in names if k not in data]
    unknown = [k for k in data if k not in names]
    if missing or unknown:
        raise ValueError(f"{where}: rope_scaling of type {rope_type!r} needs exactly the keys {names}; "
                         f"missing {missing}, unknown {unknown}")
    values = {"rope_type": rope_type}
    for key in names[1:-1]:
        values[key] = _expect_type(where, f"rope_scaling.{key}", data[key], float)
    values[names[-1]] = _expect_type(where, f"rope_scaling.{names[-1]}", data[names[-1]], int)
    rope = RopeScaling(**values)
    if rope.factor < 1 or rope.original_max_position_embeddings < 1 or not (
            0 < rope.low_freq_factor < rope.high_freq_factor):
        raise ValueError(f"{where}: rope_scaling needs factor >= 1, original_max_position_embeddings >= 1 and "
                         f"0 < low_freq_factor < high_freq_factor; got {rope.to_hf()}")
    return rope


# The fields compared against an HF config.json, in the order mismatches are reported.
ARCH_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "rope_scaling", "tie_word_embeddings", "attention_bias", "qk_layernorm",
) + MOE_FIELDS


def _expect_type(where: str, key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key} must be {kind.__name__}, got {value!r} ({type(value).__name__})")
    return value


def model_config_from_dict(data: Mapping[str, Any], where: str = "model config") -> ModelConfig:
    """Build and validate a ModelConfig; errors name the file, the key, the value and the fix."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of architecture fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"{where}: unknown key(s) {', '.join(hints)}; allowed keys: {sorted(fields)}")
    missing = [name for name, f in fields.items()
               if name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: missing required key(s) {missing}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name == "rope_scaling":
            kwargs[name] = rope_scaling_from_dict(value, where)
            continue
        if name == "defaults":
            value = value or {}
            dfields = {f.name for f in dataclasses.fields(ParallelDefaults)}
            bad = [k for k in value if k not in dfields]
            if bad:
                raise ValueError(f"{where}: unknown key(s) {bad} under defaults; allowed: {sorted(dfields)}")
            for k, v in value.items():
                _expect_type(where, f"defaults.{k}", v, int)
                if v < 1:
                    raise ValueError(f"{where}: defaults.{k} must be >= 1, got {v}")
            kwargs[name] = ParallelDefaults(**value)
            continue
        if name == "mlp_only_layers" and value is not None:
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ValueError(f"{where}: mlp_only_layers must be a list of layer indices, got {value!r}")
            kwargs[name] = tuple(value)
            continue
        annotation = fields[name].type
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation.split(" |")[0])
        if value is None and "None" in annotation:
            kwargs[name] = None
            continue
        kwargs[name] = _expect_type(where, name, value, kind) if kind else value
    cfg = ModelConfig(**kwargs)
    family = get_family(cfg.model_type)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                "make_vocab_size_divisible_by"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{where}: {key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"{where}: num_attention_heads {cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {cfg.num_key_value_heads}; grouped-query attention needs it to be"
        )
    if cfg.is_moe:
        _check_moe_sizes(cfg, where)
    if not 0 < cfg.rms_norm_eps < 1:
        raise ValueError(f"{where}: rms_norm_eps must be in (0, 1), got {cfg.rms_norm_eps}")
    family.check(cfg, where)
    if cfg.hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported; allowed: ['silu']")
    return cfg


def _check_moe_sizes(cfg: ModelConfig, where: str) -> None:
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise ValueError(f"{where}: {key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.num_experts_per_tok is not None and cfg.num_experts_per_tok > cfg.num_experts:
        raise ValueError(f"{where}: num_experts_per_tok {cfg.num_experts_per_tok} exceeds num_experts "
                         f"{cfg.num_experts}; a token cannot be routed to more experts than exist")
    if cfg.router_aux_loss_coef is not None and cfg.router_aux_loss_coef < 0:
        raise ValueError(f"{where}: router_aux_loss_coef must be >= 0, got {cfg.router_aux_loss_coef}")


def resolve_model_config_path(name_or_path: str | os.PathLike) -> Path:
    """A path to a YAML, or a bare name looked up in ``model_configs/`` (``qwq-32b``)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = MODEL_CONFIG_DIR / f"{path.name.removesuffix('.yaml')}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))
    raise FileNotFoundError(f"model config {str(name_or_path)!r} not found; give a YAML path or one of {known}")


def load_model_config(name_or_path: str | os.PathLike) -> ModelConfig:
    path = resolve_model_config_path(name_or_path)
    with open(path) as fh:
        data = yaml.safe_load(fh)
    return model_config_from_dict(data, where=str(path))


def model_config_from_hf(hf_config: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """Read the architecture fields of an HF ``config.json`` dict, filling what the family implies."""
    family = get_family(hf_config.get("model_type", "<missing>"))
    where = f"HF config ({name})"
    family.check_hf_values(hf_config, where)
    hf_config = dict(hf_config)
    # transformers >= 5 writes rope_theta (and the scaling) inside rope_parameters, torch_dtype as dtype.
    rope = hf_config.get("rope_parameters") or {}
    if "rope_theta" not in hf_config and "rope_theta" in rope:
        hf_config["rope_theta"] = rope["rope_theta"]
    if hf_config.get("rope_scaling") is None and rope:
        hf_config["rope_scaling"] = rope
    hf_config["rope_scaling"] = rope_scaling_from_dict(hf_config.get("rope_scaling"), where)
    if "torch_dtype" not in hf_config and "dtype" in hf_config:
        hf_config["torch_dtype"] = hf_config["dtype"]
    if "num_experts" not in hf_config and "num_local_experts" in hf_config:  # transformers >= 5's name
        hf_config["num_experts"] = hf_config["num_local_experts"]
    data: dict[str, Any] = {"name": name}
    for key in ARCH_FIELDS:
        if key in MOE_FIELDS and not family.moe:
            continue  # a dense family: None whatever config.json says (its model class has no experts)
        if key == "rope_scaling":
            data[key] = None if hf_config[key] is None else dataclasses.asdict(hf_config[key])
        elif key in hf_config and key != "qk_layernorm":
            data[key] = hf_config[key]
        elif key in family.implicit_fields:
            data[key] = family.implicit_fields[key]
        elif key in family.hf_defaults:
            data[key] = family.hf_defaults[key]
        elif key == "head_dim":
            data[key] = hf_config["hidden_size"] // hf_config["num_attention_heads"]
        elif key == "tie_word_embeddings":
            data[key] = False  # PretrainedConfig's default
        else:
            raise ValueError(f"HF config ({name}) lacks the architecture field {key!r}")
    for key in ("hidden_act", "torch_dtype", "bos_token_id", "eos_token_id"):
        if key in hf_config:
            data[key] = hf_config[key]
    if isinstance(data.get("eos_token_id"), list):
        data["eos_token_id"] = data["eos_token_id"][0]
    return model_config_from_dict(data, where=f"HF config {name}")


def check_hf_config(model_cfg: ModelConfig, hf_config: Mapping[str, Any], hf_where: str = "config.json") -> None:
    """Raise if an HF config.json disagrees with the model YAML on any architecture field (all listed)."""
    hf_cfg = model_config_from_hf(hf_config, name=hf_where)
    mismatches = [
        f"  {key}: model config says {getattr(model_cfg, key)!r}, {hf_where} says {getattr(hf_cfg, key)!r}"
        for key in ARCH_FIELDS if getattr(model_cfg, key) != getattr(hf_cfg, key)
    ]
    if mismatches:
        raise ValueError(
            f"{hf_where} disagrees with model config {model_cfg.name!r} on {len(mismatches)} architecture "
            f"field(s):\n" + "\n".join(mismatches)
            + "\nPoint --model-config at the YAML that matches this checkpoint, or fix the YAML."
        )


def hf_config_dict(model_cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` transformers and vLLM expect for this architecture."""
    family = get_family(model_cfg.model_type)
    out: dict[str, Any] = {"architectures": [family.hf_architecture], "model_type": model_cfg.model_type}
    for key in ARCH_FIELDS:
        if key in ("model_type", "qk_layernorm") or key in family.hf_omitted_fields:
            continue
        if key in MOE_FIELDS:
            if getattr(model_cfg, key) is not None:
                value = getattr(model_cfg, key)
                out[key] = list(value) if isinstance(value, tuple) else value
            continue
        out[key] = getattr(model_cfg, key)
    out["rope_scaling"] = model_cfg.rope_scaling.to_hf() if model_cfg.rope_scaling else None
    out.update(hidden_act=model_cfg.hidden_act, torch_dtype=model_cfg.torch_dtype,
               bos_token_id=model_cfg.bos_token_id, eos_token_id=model_cfg.eos_token_id)
    out.update(family.extra_hf_fields)
    out.update(family.derived_hf_fields(model_cfg))
    return out


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; --hf must point at a Hugging Face checkpoint directory")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); the file is truncated or corrupt, restore it from the "
                         f"original checkpoint") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of config fields, got {type(data).__name__}")
    return data
