"""Small experiment configs for the unit tests: the tiny model on CPU-only nodes, sections merged on top."""

from __future__ import annotations

from megatron_arpo.config import ExperimentConfig, build_config

TINY_CPU = {"model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 512},
            "data": {"max_prompt_tokens": 256}, "tools": {"search": {"enabled": False}},
            "launcher": {"gpus_per_node": 0}}


def tiny_config(**sections: dict) -> ExperimentConfig:
    """`TINY_CPU` with each given section's keys replaced (``actor={"tensor_parallel": 2}``), validated."""
    raw = {key: dict(value) for key, value in TINY_CPU.items()}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return build_config(raw)
