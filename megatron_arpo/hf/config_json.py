"""``config.json`` carried over exactly: the user's file plus only the fields a conversion must change.

``hf-to-megatron`` stores the source ``config.json`` byte for byte as ``OUT/hf_extra/config.json``
(:data:`ORIGINAL_CONFIG`; checkpoints converted before this existed have a re-serialised copy in
``hf_config.json``, same fields). ``megatron-to-hf`` starts from that file and changes only:

- an architecture field (:data:`megatron_arpo.model_config.ARCH_FIELDS`) on which the file disagrees with
  the model config the weights were read with (the weights' shapes decide; e.g. a training checkpoint
  whose YAML changed vocab size). Fields the file leaves implicit and that agree are not added;
- the dtype key (``torch_dtype``, or ``dtype`` as transformers >= 5 writes it) when the exported tensors
  have another dtype (``hf-to-megatron --dtype``, or training in another precision).

Everything else (``sliding_window``, ``max_window_layers``, ``transformers_version``, ``rope_scaling``,
key order, ...) comes back as it went in; with no change the file is copied byte for byte. Each change
is a :class:`FieldChange`, listed in the conversion report. Without a recorded original (a training
checkpoint) the file is generated from the model config, and the report says so.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_arpo.hf.checkpoint_io import write_json
from megatron_arpo.model_config import ARCH_FIELDS, ModelConfig, hf_config_dict, model_config_from_hf

ORIGINAL_CONFIG = "hf_extra/config.json"
LEGACY_CONFIG = "hf_config.json"


@dataclass(frozen=True)
class FieldChange:
    field: str
    old: Any  # None with present=False: the key was absent
    new: Any
    reason: str
    present: bool = True

    def describe(self) -> str:
        old = json.dumps(self.old) if self.present else "(absent)"
        return f"{self.field}: {old} -> {json.dumps(self.new)} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "old": self.old if self.present else None, "old_present": self.present,
                "new": self.new, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FieldChange:
        return cls(data["field"], data["old"], data["new"], data["reason"], data["old_present"])


def store_original_config(hf_dir: str | os.PathLike, megatron_dir: Path) -> None:
    """Keep the source ``config.json`` (bytes unchanged) with the Megatron checkpoint."""
    dest = megatron_dir / ORIGINAL_CONFIG
    dest.parent.mkdir(exist_ok=True)
    shutil.copyfile(Path(hf_dir) / "config.json", dest)


def find_original_config(ckpt: Path) -> Path | None:
    for name in (ORIGINAL_CONFIG, LEGACY_CONFIG):
        if (ckpt / name).is_file():
            return ckpt / name
    return None


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the recorded original config.json is not valid JSON ({exc}); restore it from "
                         f"the source checkpoint's config.json") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _set(config: dict[str, Any], key: str, value: Any, reason: str, changes: list[FieldChange]) -> None:
    present = key in config
    if present and config[key] == value and type(config[key]) is type(value):
        return
    changes.append(FieldChange(key, config.get(key), value, reason, present))
    config[key] = value


def carry_over_config(original: dict[str, Any], model_cfg: ModelConfig, dtype_name: str,
                      where: str = "config.json") -> tuple[dict[str, Any], list[FieldChange]]:
    """``original`` with the fields that must change for ``model_cfg`` weights in ``dtype_name``."""
    config = dict(original)
    changes: list[FieldChange] = []
    try:
        recorded = model_config_from_hf(original, name=where)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: cannot read the architecture from the recorded config.json ({exc}); pass "
                         f"--model-config and remove {where} to generate config.json instead") from exc
    generated = hf_config_dict(model_cfg)
    for key in ARCH_FIELDS:
        want = getattr(model_cfg, key)
        if getattr(recorded, key) == want:
            continue
        reason = f"the weights have {key}={want!r}"
        if key == "rope_theta" and "rope_theta" not in config and isinstance(config.get("rope_parameters"), dict):
            rope = dict(config["rope_parameters"])
            changes.append(FieldChange("rope_parameters.rope_theta", rope.get("rope_theta"), want, reason))
            rope["rope_theta"] = want
            config["rope_parameters"] = rope
        elif key in generated:
            _set(config, key, generated[key], reason, changes)
        else:  # implied by the family (qk_layernorm, qwen2's attention_bias): a model_type change covers it
            raise ValueError(f"{where}: {key} is {getattr(recorded, key)!r} but the weights need {want!r}, which "
                             f"config.json cannot express for model_type {model_cfg.model_type!r}")
    dtype_key = "torch_dtype" if "torch_dtype" in config or "dtype" not in config else "dtype"
    _set(config, dtype_key, dtype_name, f"the exported tensors are {dtype_name}", changes)
    return config, changes


def write_config_json(out_dir: Path, ckpt: Path, model_cfg: ModelConfig, dtype_name: str) -> dict[str, Any]:
    """Write ``out_dir/config.json``; returns the report entry (origin and changes)."""
    source = find_original_config(ckpt)
    if source is None:
        config = hf_config_dict(model_cfg)
        config["torch_dtype"] = dtype_name
        write_json(out_dir / "config.json", config)
        return {"origin": "generated from the model config (the checkpoint records no original config.json)",
                "changed": []}
    original = _load(source)
    config, changes = carry_over_config(original, model_cfg, dtype_name, where=str(source))
    if not changes and source.name == "config.json":
        shutil.copyfile(source, out_dir / "config.json")  # byte for byte
    else:
        with open(out_dir / "config.json", "w") as fh:
            json.dump(config, fh, indent=2)
            fh.write("\n")
    return {"origin": str(source), "changed": [c.to_dict() for c in changes]}
