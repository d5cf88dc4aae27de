"""bf16 checkpoints with the published ``config.json`` field sets of real models, fewer layers, for tests.

The tiny checkpoints (:mod:`megatron_arpo.tiny.checkpoint`) are fp32, one file, with configs we generate.
Real checkpoints differ in what breaks conversions: they are bf16, sharded with a
``model.safetensors.index.json``, and their ``config.json`` carries fields our model config does not model
(QwQ-32B's ``sliding_window`` 32768 and ``max_window_layers`` 64, ``transformers_version``, ...), which a
conversion must bring back unchanged. :func:`build_real_shaped_checkpoint` writes such a checkpoint:

- ``config.json``: the published file of :data:`PUBLISHED_CONFIGS` (same keys, same order) with only
  ``num_hidden_layers`` reduced and, when ``width_divisor > 1``, ``hidden_size`` and ``intermediate_size``
  divided (Qwen3 keeps its explicit ``head_dim``; Qwen2 divides the head size, which it derives from
  ``hidden_size / num_attention_heads``). Head counts, GQA groups and the vocabulary stay real;
- weights from :func:`megatron_arpo.tiny.checkpoint.build_weights` (random norms and biases) in bf16, written
  in several shards with an index like a hub download.

No tokenizer is written: conversions copy tokenizer files only when present.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 40960, "model_type": "qwen3", "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    fields = {**_QWEN3_COMMON, "hidden_size": hidden, "intermediate_size": ffn, "max_window_layers": layers,
              "num_attention_heads": heads, "num_hidden_layers": layers, "tie_word_embeddings": tied}
    return dict(sorted(fields.items()))  # transformers writes config.json with sorted keys


# The config.json files as published on the Hugging Face hub (key order as there).
PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    "qwq-32b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
        "intermediate_size": 27648, "max_position_embeddings": 40960, "max_window_layers": 64,
        "model_type": "qwen2", "num_attention_heads": 40, "num_hidden_layers": 64, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 152064,
    },
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
}


def real_shaped_config(name: str, num_layers: int, width_divisor: int = 1) -> dict[str, Any]:
    """The published config.json of ``name`` with ``num_layers`` layers and widths divided."""
    try:
        config = dict(PUBLISHED_CONFIGS[name])
    except KeyError:
        raise ValueError(f"no published config for {name!r}; known: {sorted(PUBLISHED_CONFIGS)}") from None
    config["num_hidden_layers"] = num_layers
    for key in ("hidden_size", "intermediate_size"):
        if config[key] % width_divisor:
            raise ValueError(f"{name}: {key} {config[key]} is not divisible by width_divisor {width_divisor}")
        config[key] //= width_divisor
    return config


def build_real_shaped_checkpoint(name: str, out_dir: str | os.PathLike, num_layers: int = 2,
                                 width_divisor: int = 1, seed: int = 0, num_shards: int = 4) -> Path:
    """Write a bf16 checkpoint of ``name``'s field set into the new directory ``out_dir``; returns it."""
    import dataclasses

    import torch

    from megatron_arpo.hf.checkpoint_io import SafetensorsShardWriter, TensorSpec
    from megatron_arpo.model_config import model_config_from_hf
    from megatron_arpo.tiny.checkpoint import build_weights

    config = real_shaped_config(name, num_layers, width_divisor)
    cfg = dataclasses.replace(model_config_from_hf(config, name=f"{name}-{num_layers}l"), torch_dtype="bfloat16")
    out = Path(out_dir)
    out.mkdir(parents=True)
    weights = build_weights(cfg, seed)
    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in weights.items()]
    total = sum(s.nbytes for s in specs)
    writer = SafetensorsShardWriter(out, specs, -(-total // num_shards))
    for n, t in weights.items():
        writer.write(n, t)
    writer.close()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": [config["eos_token_id"], 151643],
         "pad_token_id": 151643}, indent=2) + "\n")
    return out
