"""A rollout group: several engines behind one async interface, with sticky per-prompt routing.

Engines may be local objects (`VllmEngine`, `ScriptedEngine`) or Ray actor handles of `VllmEngine`;
`EngineHandle` hides the difference (``await handle.call("generate", req)``).

Routing is sticky per prompt: `assign(prompt_key)` picks the engine with the fewest prompts currently
assigned (lowest index on ties) when a prompt starts, and every trajectory and branch of that prompt
goes there until `release(prompt_key)`. Branches then find their parent's KV blocks in that engine's
prefix cache.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

logger = logging.getLogger(__name__)

__all__ = ["EngineHandle", "RolloutGroup"]


class EngineHandle:
    def __init__(self, target: Any, index: int):
        self.target = target
        self.index = index
        # Policy version of the weights the engine holds (the trainer sets it after each sync); the token
        # version of an engine output that does not carry its own (SegmentOutput.token_versions).
        self.version = 0
        generate = getattr(target, "generate", None)
        self.is_actor = generate is not None and hasattr(generate, "remote")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.target, method)
        if self.is_actor:
            return await fn.remote(*args, **kwargs)
        return await fn(*args, **kwargs)

    async def generate(self, request: Any) -> Any:
        return await self.call("generate", request)


class RolloutGroup:
    def __init__(self, engines: Sequence[Any]):
        if not engines:
            raise ValueError("a rollout group needs at least one engine")
        self.engines = [EngineHandle(e, i) for i, e in enumerate(engines)]
        self._assigned: dict[Any, int] = {}
        self._load = [0] * len(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def set_version(self, version: int) -> None:
        """Every engine now holds the weights of policy ``version`` (after a weight sync)."""
        for engine in self.engines:
            engine.version = version

    def replace(self, index: int, target: Any, version: int) -> None:
        """Engine ``index`` is now ``target`` (a restarted engine actor) holding policy ``version``."""
        handle = EngineHandle(target, index)
        handle.version = version
        self.engines[index] = handle

    def assign(self, prompt_key: Any) -> EngineHandle:
        if prompt_key in self._assigned:
            return self.engines[self._assigned[prompt_key]]
        index = min(range(len(self.engines)), key=lambda i: (self._load[i], i))
        self._assigned[prompt_key] = index
        self._load[index] += 1
        return self.engines[index]

    def release(self, prompt_key: Any) -> None:
        index = self._assigned.pop(prompt_key, None)
        if index is not None:
            self._load[index] -= 1

    async def broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every engine concurrently; results in engine order."""
        return list(await asyncio.gather(*(e.call(method, *args, **kwargs) for e in self.engines)))

    async def reset_prefix_cache(self) -> list[Any]:
        return await self.broadcast("reset_prefix_cache")

    async def prefix_cache_stats(self) -> dict[str, float]:
        """Counters summed over engines."""
        total: dict[str, float] = {}
        for stats in await self.broadcast("prefix_cache_stats"):
            for key, value in stats.items():
                total[key] = total.get(key, 0.0) + float(value)
        return total

    async def health(self) -> list[dict]:
        return await self.broadcast("health")
