"""Model architecture configs (``model_configs/*.yaml``) and the registry of supported model families.

A model YAML carries the exact Hugging Face architecture fields of one checkpoint (``hidden_size``,
``head_dim``, ...) plus default parallelism for its size. This module is pure Python: it loads and
validates those files, compares them with an HF ``config.json`` and renders a ``config.json`` back.
Mapping a model config onto Megatron's ``TransformerConfig`` happens in exactly one place,
``megatron_arpo.actor.model_builder.build_transformer_config``, which dispatches on the same
``MODEL_FAMILIES`` registry.

The registry is keyed by the exact HF ``model_type`` (``qwen3``, ``qwen2``); a miss raises listing the
supported types. Fields a family fixes (Qwen3 always has q/k layernorm, Qwen2 always has QKV bias) are
recorded in the family, so an HF config that omits them is still checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

MODEL_CONFIG_DIR = Path(__file__).resolve().parent.parent / "model_configs"


@dataclass(frozen=True)
class ModelFamily:
    """What one HF ``model_type`` implies beyond the fields its config.json spells out."""

    model_type: str
    hf_architecture: str
    # Values the HF config class assumes when the key is absent from config.json.
    implicit_fields: Mapping[str, Any]
    # Keys written to config.json that are not architecture fields but that HF expects.
    extra_hf_fields: Mapping[str, Any]


MODEL_FAMILIES: Mapping[str, ModelFamily] = {
    "qwen3": ModelFamily(
        model_type="qwen3",
        hf_architecture="Qwen3ForCausalLM",
        implicit_fields={"qk_layernorm": True, "attention_bias": False},
        extra_hf_fields={"attention_dropout": 0.0, "rope_scaling": None, "sliding_window": None,
                         "use_sliding_window": False, "use_cache": True, "initializer_range": 0.02},
    ),
    "qwen2": ModelFamily(
        model_type="qwen2",
        hf_architecture="Qwen2ForCausalLM",
        # Qwen2 always has bias on q/k/v projections and never q/k layernorm; its config.json has no
        # attention_bias key, and head_dim is hidden_size // num_attention_heads.
        implicit_fields={"qk_layernorm": False, "attention_bias": True},
        extra_hf_fields={"attention_dropout": 0.0, "rope_scaling": None, "use_sliding_window": False,
                         "use_cache": True, "initializer_range": 0.02},
    ),
}


def get_model_family(model_type: str) -> ModelFamily:
    try:
        return MODEL_FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported model types: {sorted(MODEL_FAMILIES)}"
        ) from None


@dataclass(frozen=True)
class ParallelDefaults:
    """Default parallelism for a model of this size (overridable in the experiment config)."""

    actor_tensor_parallel: int = 1
    actor_pipeline_parallel: int = 1
    rollout_tensor_parallel: int = 1


# The fields compared against an HF config.json, in the order mismatches are reported.
ARCH_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "qk_layernorm",
)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one model, with HF field names."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_layernorm: bool
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Megatron pads the embedding rows to a multiple of this times the tensor-parallel size.
    make_vocab_size_divisible_by: int = 128
    defaults: ParallelDefaults = field(default_factory=ParallelDefaults)

    @property
    def family(self) -> ModelFamily:
        return get_model_family(self.model_type)

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        annotation = fields[name].type
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation.split(" |")[0])
        if value is None and "None" in annotation:
            kwargs[name] = None
            continue
        kwargs[name] = _expect_type(where, name, value, kind) if kind else value
    cfg = ModelConfig(**kwargs)
    family = get_model_family(cfg.model_type)
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
    if not 0 < cfg.rms_norm_eps < 1:
        raise ValueError(f"{where}: rms_norm_eps must be in (0, 1), got {cfg.rms_norm_eps}")
    for key, implied in family.implicit_fields.items():
        if getattr(cfg, key) != implied:
            raise ValueError(
                f"{where}: model_type {cfg.model_type!r} always has {key}={implied}, but the config says "
                f"{getattr(cfg, key)}; set {key}: {str(implied).lower()}"
            )
    if cfg.model_type == "qwen2" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(
            f"{where}: qwen2 derives head_dim from hidden_size/num_attention_heads = "
            f"{cfg.hidden_size // cfg.num_attention_heads}, but head_dim is {cfg.head_dim}; set head_dim: "
            f"{cfg.hidden_size // cfg.num_attention_heads}"
        )
    if cfg.hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported; allowed: ['silu']")
    return cfg


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
    family = get_model_family(hf_config.get("model_type", "<missing>"))
    hf_config = dict(hf_config)
    # transformers >= 5 writes rope_theta inside rope_parameters and torch_dtype as dtype.
    rope = hf_config.get("rope_parameters") or {}
    if "rope_theta" not in hf_config and "rope_theta" in rope:
        hf_config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" or hf_config.get("rope_scaling"):
        raise ValueError(f"HF config ({name}) uses rope scaling {rope or hf_config.get('rope_scaling')}; "
                         "only default RoPE is supported")
    if "torch_dtype" not in hf_config and "dtype" in hf_config:
        hf_config["torch_dtype"] = hf_config["dtype"]
    data: dict[str, Any] = {"name": name}
    for key in ARCH_FIELDS:
        if key in hf_config and key != "qk_layernorm":
            data[key] = hf_config[key]
        elif key in family.implicit_fields:
            data[key] = family.implicit_fields[key]
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
    family = model_cfg.family
    out: dict[str, Any] = {"architectures": [family.hf_architecture], "model_type": model_cfg.model_type}
    for key in ARCH_FIELDS:
        if key in ("model_type", "qk_layernorm"):
            continue
        if key == "attention_bias" and model_cfg.model_type == "qwen2":
            continue  # Qwen2Config has no such key; the bias is implied
        out[key] = getattr(model_cfg, key)
    out.update(hidden_act=model_cfg.hidden_act, torch_dtype=model_cfg.torch_dtype,
               bos_token_id=model_cfg.bos_token_id, eos_token_id=model_cfg.eos_token_id,
               max_window_layers=model_cfg.num_hidden_layers)
    out.update(family.extra_hf_fields)
    if model_cfg.model_type == "qwen2":
        out["sliding_window"] = model_cfg.max_position_embeddings
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


# ------------------------------------------------------------------------------------------ layouts
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_choices(cfg: ModelConfig) -> list[int]:
    """TP sizes this model can take: divisors of the attention heads, KV heads and FFN width alike."""
    return [t for t in _divisors(cfg.num_key_value_heads)
            if cfg.num_attention_heads % t == 0 and cfg.intermediate_size % t == 0]


def layout_errors(cfg: ModelConfig, tensor_parallel: int, pipeline_parallel: int, sequence_parallel: bool = False,
                  section: str = "actor") -> list[str]:
    """Problems of a TP/PP/SP layout for this model, each naming the key and the values that work."""
    errors = []
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

