"""Deterministic tiny Qwen3/Qwen2 checkpoints with a locally trained tokenizer or the real Qwen one (no hub downloads).

The demo (``megatron-arpo demo``) builds its model with ``megatron_arpo.tiny.checkpoint.build_tiny_checkpoint``;
tests use the cached ``tiny_checkpoint`` (``megatron_arpo.tiny.checkpoint``). Importing this package is
cheap: the modules import torch, safetensors and tokenizers.
"""
