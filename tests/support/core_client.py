"""A `VllmEngine` on vLLM's real client classes with the engine core's socket replaced (no engine process).

vLLM's own ``LLM``, ``LLMEngine`` and ``SyncMPClient`` run; `EncodingCoreClient.call_utility` msgpack-encodes
exactly what the real client sends to its core subprocess (refusing functions and classes as it does),
records the call and answers as a one-worker engine would. `bare_engine` builds the engine's state the way
``VllmEngine.__init__`` leaves it after vLLM started.
"""

from __future__ import annotations

import concurrent.futures

from vllm import LLM
from vllm.v1.engine.core_client import SyncMPClient
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.serial_utils import MsgpackEncoder

from megatron_arpo.rollout.engine import EngineConfig, VllmEngine

REPORT = {"loaded": 2, "duplicates": 0, "verified": ["model.norm.weight"], "sync_ids": [1]}


class EncodingCoreClient(SyncMPClient):
    """vLLM's multiprocessing client with the socket replaced: each utility call is encoded, recorded and
    answered as a one-worker engine would answer it."""

    def __init__(self) -> None:  # no engine process
        self.encoder = MsgpackEncoder()
        self.calls: list[tuple] = []

    def call_utility(self, method: str, *args):
        self.encoder.encode((0, 0, method, args))  # what SyncMPClient.call_utility sends (raises TypeError)
        self.calls.append((method, args))
        if method == "collective_rpc":
            name = args[0]
            return [{"arpo_sync_report": REPORT, "arpo_param_checksums": {"model.norm.weight": None}}.get(name)]
        return None


def bare_engine(core: EncodingCoreClient) -> VllmEngine:
    llm = object.__new__(LLM)
    llm.llm_engine = object.__new__(LLMEngine)
    llm.llm_engine.engine_core = core
    eng = object.__new__(VllmEngine)
    eng.cfg, eng.engine_index, eng._llm, eng._engine = EngineConfig(model="unused", weight_transfer="gloo"), 0, llm, \
        llm.llm_engine
    eng._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    eng._futures, eng._top_positions, eng._to_add, eng._to_abort = {}, {}, [], []
    eng._wake = eng._loop = eng._loop_task = eng._error = None
    eng._asleep, eng._updating, eng._paused, eng._version = set(), None, False, 0
    eng._stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "steps": 0,
                  "max_in_flight": 0}
    return eng
