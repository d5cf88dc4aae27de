"""Test helpers: tiny locally built checkpoints and multi-process runners, under the names tests use.

- ``build_tiny_checkpoint(model_config, out_dir, seed=0)`` / ``tiny_checkpoint(name, seed=0)``: deterministic
  tiny Qwen3/Qwen2 HF checkpoints with a locally trained tokenizer, or with ``tokenizer="qwen3"|"qwq"`` the
  real Qwen BPE tokenizer (``megatron_arpo.tiny``, ``megatron_arpo.tiny.qwen_tokenizer``).
- ``megatron_arpo.testing.real_shaped``: bf16, sharded checkpoints with real models' published config.json
  field sets (fewer layers, optionally narrower) for conversion tests.
- ``megatron_arpo.testing.dist``: the gloo multi-process runner (``megatron_arpo.actor.local_ranks``).

The implementations are production modules (the demo and ``python -m conversion verify`` use them);
production code never imports this package.

Importing this package is cheap: the wrappers below import torch, safetensors and tokenizers on first call.
"""

from __future__ import annotations


def build_tiny_checkpoint(model_config, out_dir, seed: int = 0, overwrite: bool = False, tokenizer: str = "local"):
    """See :func:`megatron_arpo.tiny.checkpoint.build_tiny_checkpoint`."""
    from megatron_arpo.tiny.checkpoint import build_tiny_checkpoint as build

    return build(model_config, out_dir, seed=seed, overwrite=overwrite, tokenizer=tokenizer)


def tiny_checkpoint(name, seed: int = 0, root=None, tokenizer: str = "local"):
    """See :func:`megatron_arpo.tiny.checkpoint.tiny_checkpoint`."""
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint as cached

    return cached(name, seed=seed, root=root, tokenizer=tokenizer)
