"""A scripted engine with `VllmEngine`'s interface, and a one-character-per-token codec for it.

Used by the scheduler's bookkeeping tests (docs/design/arpo_reference.md §11.7) and by benchmarks/rollout.py, where
the comparison must be deterministic. The "policy" is a function of the context: ``script(context_ids,
request) -> ScriptedStep`` gives the intended continuation and, per position, the top-k log-probs the
engine reports. The engine then behaves like vLLM 0.32: it emits that continuation until a token in
``stop_token_ids`` (included in the output), a stop string (``request.stop``: after each token the
decoded output, special tokens skipped, is searched, and the output ends with the token that completed
the string, as vLLM's detokenizer does) or ``max_tokens``, and returns the log-prob of each emitted token
(from the step's table; the sampled token is not added to the top-k pool, so a scripted pool is exactly
what the entropy sees). ``tokenizer`` decodes for the stop strings (default: a `CharCodec`).

A seeded request samples as vLLM's per-request generator does: the same context and seed give the same
tokens (the script's step is kept per context and seed until the weights or the cache change), so a
request repeated with a smaller ``max_tokens`` repeats the leading tokens, and a request split in two
(a new seed for the second part) samples something else after the split.

It also simulates a block prefix cache (``num_cached_tokens`` per request, hit counters) and keeps a
dict of HF-named "weights" that the weight sync fills through the real receiver: the engine speaks the
same four weight-transfer phases as `VllmEngine`, with this project's gloo receiver
(``weight_receiver.GlooWeightTransferEngine``) loading into the dict instead of a vLLM model, so the
sender, the transport and the verify checks run for real without vLLM. ``latency_s`` (a number
or a function of the request) plus ``per_token_latency_s`` per emitted token is awaited per request,
so concurrent requests overlap as in a continuously batched engine.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from megatron_arpo.rollout.engine import SegmentOutput, SegmentRequest

logger = logging.getLogger(__name__)

__all__ = ["CharCodec", "ScriptedEngine", "ScriptedStep"]

DEFAULT_SPECIAL_TOKENS = ("<think>", "</think>", "<search>", "</search>", "<python>", "</python>",
                          "<result>", "</result>", "<answer>", "</answer>", "<EOS>")


class CharCodec:
    """One character = one token (ids 0-255, Latin-1); each special token is one id from 256 on.

    Implements the tokenizer subset the rollout uses: ``encode(text, add_special_tokens=False)``,
    ``decode(ids)``, ``eos_token_id``, ``len()``.
    """

    def __init__(self, special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS, eos_token: str = "<EOS>"):
        if eos_token not in special_tokens:
            raise ValueError(f"eos_token {eos_token!r} must be one of the special tokens {list(special_tokens)}")
        self.special_tokens = tuple(special_tokens)
        self._special_ids = {tok: 256 + i for i, tok in enumerate(self.special_tokens)}
        self._by_id = {i: tok for tok, i in self._special_ids.items()}
        # Longest first, so "</search>" is not read as "<" + "/search>" when tags share prefixes.
        self._match_order = sorted(self.special_tokens, key=len, reverse=True)
        self.eos_token = eos_token
        self.eos_token_id = self._special_ids[eos_token]

    def __len__(self) -> int:
        return 256 + len(self.special_tokens)

    def token_id(self, token: str) -> int:
        return self._special_ids[token]

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        """``split_special_tokens=True`` encodes special-token text character by character (plain text)."""
        ids, i = [], 0
        while i < len(text):
            for tok in () if split_special_tokens else self._match_order:
                if text.startswith(tok, i):
                    ids.append(self._special_ids[tok])
                    i += len(tok)
                    break
            else:
                code = ord(text[i])
                if code > 255:
                    raise ValueError(f"CharCodec encodes Latin-1 only; {text[i]!r} at {i} is not")
                ids.append(code)
                i += 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """``skip_special_tokens`` drops EOS only: like the project's tokenizers, tool tags are added tokens
        that are not "special" and stay in the text the reward parses."""
        out = []
        for i in ids:
            if i in self._by_id:
                if not (skip_special_tokens and i == self.eos_token_id):
                    out.append(self._by_id[i])
            else:
                out.append(chr(i))
        return "".join(out)


@dataclass
class ScriptedStep:
    """The policy's intended continuation and, per position, the top-k log-probs reported.

    ``top_logprobs`` is one table per position, or a single table used at every position.
    """

    token_ids: list[int]
    top_logprobs: Any = None


ScriptFn = Callable[[list[int], SegmentRequest], ScriptedStep]


class ScriptedEngine:
    """Deterministic engine with the same async interface as `VllmEngine` (see module docstring)."""

    def __init__(
        self,
        script: ScriptFn,
        *,
        engine_index: int = 0,
        latency_s: float | Callable[[SegmentRequest], float] = 0.0,
        per_token_latency_s: float = 0.0,
        block_size: int = 16,
        max_model_len: int = 1 << 20,
        event_log: Optional[list] = None,
        tokenizer: Any = None,
    ):
        self.script = script
        self.tokenizer = tokenizer if tokenizer is not None else CharCodec()
        self.engine_index = engine_index
        self.latency_s = latency_s
        self.per_token_latency_s = per_token_latency_s
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.event_log = event_log
        self.weights: dict[str, Any] = {}
        self.requests: list[SegmentRequest] = []
        self._blocks: set[int] = set()
        self._seeded: dict[tuple, ScriptedStep] = {}   # (context, seed) -> the step sampled for it
        self._in_flight = 0
        self.version = 0   # the policy version (finish_weight_update), stamped on every token
        self._stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                       "max_in_flight": 0, "queries": 0, "hits": 0, "weight_updates": 0}

    # ------------------------------------------------------------------ generation
    async def generate(self, request: SegmentRequest) -> SegmentOutput:
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_tokens={request.max_tokens} must be >= 1")
        self.requests.append(request)
        self._in_flight += 1
        self._stats["max_in_flight"] = max(self._stats["max_in_flight"], self._in_flight)
        self._log("gen_start", request.request_id)
        try:
            context = list(request.prompt_token_ids)
            cached = self._lookup_prefix(context)
            step = self._sample(context, request)
            version = self.version   # every token is sampled here, before the latency: this policy's version
            tokens, top = [], []
            stops = set(request.stop_token_ids)
            finish, stop_reason, text = "length", None, ""
            for pos, tok in enumerate(step.token_ids):
                if len(tokens) >= request.max_tokens:
                    break
                tokens.append(int(tok))
                top.append(self._table(step.top_logprobs, pos))
                if tok in stops:
                    finish, stop_reason = "stop", int(tok)
                    break
                text, matched = self._stop_string(text, int(tok), request.stop)
                if matched is not None:
                    finish, stop_reason = "stop", matched
                    break
            if not tokens:
                raise ValueError(f"script produced no tokens for request {request.request_id}")
            sampled = [t.get(tok, max(t.values()) if t else 0.0) for tok, t in zip(tokens, top)]
            if request.top_logprobs_positions is not None:  # as VllmEngine: top-k for the leading positions only
                top = top[:request.top_logprobs_positions]
            latency = self.latency_s(request) if callable(self.latency_s) else self.latency_s
            latency += self.per_token_latency_s * len(tokens)
            await asyncio.sleep(latency)
            self._insert_blocks(context + tokens)
            self._stats["requests"] += 1
            self._stats["prompt_tokens"] += len(context)
            self._stats["cached_tokens"] += cached
            self._stats["generated_tokens"] += len(tokens)
            self._log("gen_finish", request.request_id)
            return SegmentOutput(
                request_id=request.request_id, token_ids=tokens, logprobs=sampled, top_logprobs=top,
                finish_reason=finish, stop_reason=stop_reason, num_prompt_tokens=len(context),
                num_cached_tokens=cached, token_versions=[version] * len(tokens),
            )
        finally:
            self._in_flight -= 1

    def _sample(self, context: list[int], request: SegmentRequest) -> ScriptedStep:
        if request.seed is None:
            return self.script(context, request)
        key = (hash(tuple(context)), len(context), request.seed)
        step = self._seeded.get(key)
        if step is None:
            step = self._seeded[key] = self.script(context, request)
        return step

    def _stop_string(self, text: str, token: int, stop: Sequence[str]) -> tuple[str, Optional[str]]:
        """(output text, the stop string this token completed or None); the string ending first wins.

        Token-by-token decoding: a byte-level token that is part of a multi-byte character decodes to a
        replacement character on its own, which never forms (ASCII) tag text."""
        if not stop:
            return text, None
        new = self.tokenizer.decode([token], skip_special_tokens=True)
        text += new
        window = text[-(len(new) + max(len(s) for s in stop)):]
        ends = [(window.find(s) + len(s), i, s) for i, s in enumerate(stop) if s in window]
        return text, (min(ends)[2] if ends else None)

    @staticmethod
    def _table(spec: Any, pos: int) -> dict[int, float]:
        if spec is None:
            return {}
        if isinstance(spec, dict):
            return {int(k): float(v) for k, v in spec.items()}
        table = spec[min(pos, len(spec) - 1)]
        return {int(k): float(v) for k, v in table.items()}

    def _log(self, kind: str, request_id: str) -> None:
        if self.event_log is not None:
            self.event_log.append((kind, request_id))

    # ------------------------------------------------------------------ simulated prefix cache
    def _block_hashes(self, tokens: Sequence[int]) -> list[int]:
        hashes, prev = [], 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            prev = hash((prev, tuple(tokens[start:start + self.block_size])))
            hashes.append(prev)
        return hashes

    def _lookup_prefix(self, tokens: Sequence[int]) -> int:
        # vLLM never serves the last prompt token from the cache (it must compute its logits).
        hashes = self._block_hashes(tokens[:-1])
        self._stats["queries"] += len(tokens)
        hit = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hit += 1
        self._stats["hits"] += hit * self.block_size
        return hit * self.block_size

    def _insert_blocks(self, tokens: Sequence[int]) -> None:
        self._blocks.update(self._block_hashes(tokens))

    # ------------------------------------------------------------------ weights and caches
    def _store(self, name: str, tensor: Any) -> None:
        """Where a received tensor lands (tests override it to model a broken load).

        As a real model's parameters: the first sync allocates each tensor, later syncs copy into it in
        place (the received tensor is a view of the receiver's reused buffer, never kept)."""
        held = self.weights.get(name)
        if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
            held.copy_(tensor)
        else:
            self.weights[name] = tensor.detach().clone()

    async def _off_loop(self, fn, *args):
        # The receiver blocks in its gloo broadcast until the sender sends: keep the event loop free.
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def weight_transfer_info(self) -> dict[str, Any]:
        return {"engine_index": self.engine_index, "world_size": 1, "transport": "gloo"}

    async def init_weight_transfer_engine(self, init_info: dict, keep_in_flight: bool = False) -> None:
        self._receiver = _dict_receiver(self)
        await self._off_loop(self._receiver.init_transfer_engine, self._receiver.parse_init_info(init_info))

    async def start_weight_update(self, keep_in_flight: bool = False, clear_cache: bool = False) -> None:
        # A scripted request samples all its tokens when it starts: there is no step to pause at, so
        # keep_in_flight changes nothing here (the real pause: VllmEngine).
        self._seeded.clear()
        self._receiver.start_weight_update()

    async def update_weights(self, update_info: dict) -> int:
        info = self._receiver.parse_update_info(update_info)
        await self._off_loop(self._receiver.receive_weights, info)
        self._stats["weight_updates"] += 1
        return len(info.names)

    async def finish_weight_update(self, version: Optional[int] = None) -> dict[str, Any]:
        report = dict(self._receiver._end())
        self.version = self.version + 1 if version is None else int(version)
        return {"engine_index": self.engine_index, "workers": 1, "loaded": report["loaded"],
                "duplicates": report["duplicates"], "verified": report["verified"]}

    async def policy_version(self) -> int:
        return self.version

    async def reset_prefix_cache(self) -> bool:
        self._blocks.clear()
        self._seeded.clear()
        return True

    async def prefix_cache_stats(self) -> dict[str, float]:
        out = {f"engine_{k}": float(v) for k, v in self._stats.items() if k not in ("queries", "hits")}
        out["prefix_cache_queries"] = float(self._stats["queries"])
        out["prefix_cache_hits"] = float(self._stats["hits"])
        return out

    async def health(self) -> dict[str, Any]:
        return {"engine_index": self.engine_index, "ok": True, "error": None,
                "in_flight": self._in_flight, "max_model_len": self.max_model_len}

    async def shutdown(self) -> None:
        return None


def _dict_receiver(engine: "ScriptedEngine") -> Any:
    """The gloo receiver over the engine's weight dict (no vLLM model, no layerwise reload)."""
    from types import SimpleNamespace

    import torch

    from megatron_arpo.weight_sync.receivers import GlooWeightTransferEngine

    class DictModel:
        def load_weights(self, weights):
            for name, tensor in weights:
                engine._store(name, tensor)

        def named_parameters(self):
            return iter(engine.weights.items())

    class DictReceiver(GlooWeightTransferEngine):
        def start_weight_update(self) -> None:
            self._begin()

        def finish_weight_update(self) -> None:
            self._end()

    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                             model_config=SimpleNamespace(dtype=None))
    return DictReceiver(SimpleNamespace(backend="arpo_gloo"), config, torch.device("cpu"), DictModel())

