"""LLM-as-judge over an OpenAI-compatible chat endpoint, with a concurrency limit, retries and a cache.

The judge is asked whether a predicted answer matches the gold answer of a question and replies with
``<judgment>Correct</judgment>`` or ``<judgment>Incorrect</judgment>`` (our prompt wording). The verdict
is parsed as in the ARPO evaluation code (docs/design/arpo_reference.md §9): take the last ``<judgment>...</judgment>``
span if there is one, else the whole reply; lowercase; any of ``incorrect`` / ``wrong`` /
``not correct`` -> incorrect, else ``correct`` -> correct, else no verdict (counted as incorrect and as
``unparsed``). As in the reference, evaluation then counts a sample as judged correct when the judge says
so OR the rule metric already matched (see evaluation.report).

Transport: ``POST <base>/v1/chat/completions`` with aiohttp; temperature 0. At most ``max_concurrency``
requests in flight. Connection errors, timeouts, HTTP 408/429/5xx are retried ``retries`` times with
exponential backoff (``backoff_s`` doubling up to ``backoff_max_s``). HTTP 401/403/404 are permanent.
When a request still fails the endpoint is declared unavailable: later calls return None without any
request, and `status()` reports ``{"status": "unavailable", "reason": ...}`` so evaluation falls back to
rule metrics and says so. Differences from the reference: it retried 3 times per sample and silently
fell back per sample; a judge that is down here stops being asked.

Cache: a SQLite file keyed by sha256 of (prompt version, model, question, gold, prediction). Only parsed
replies of a successful request are stored; a rerun with the same inputs makes no request.

The API key comes only from the environment variable whose NAME is configured (``api_key_env``); with
the variable unset no Authorization header is sent (local vLLM servers need none). It is never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["JudgeCache", "JudgeClient", "JudgeVerdict", "build_judge_messages", "parse_verdict"]

PROMPT_VERSION = "v1"
_JUDGMENT = re.compile(r"<judgment>(.*?)</judgment>", re.DOTALL | re.IGNORECASE)
_NEGATIVE = ("incorrect", "wrong", "not correct")
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_FATAL_STATUS = {401, 403, 404}

_SYSTEM = "You are a strict but fair grader of short answers."
_TEMPLATE = """Decide whether the predicted answer to the question below means the same thing as the reference answer.

Question: {question}
Reference answer: {gold}
Predicted answer: {prediction}

Differences in capitalisation, formatting, number formatting, or extra words that do not change the meaning are fine. An empty prediction, or one that lists several different candidate answers, does not match.
Reply with exactly one of <judgment>Correct</judgment> or <judgment>Incorrect</judgment>."""


def _gold_text(gold: str | Sequence[str]) -> str:
    if isinstance(gold, str):
        return gold
    return " OR ".join(str(g) for g in gold) + (" (any one of these)" if len(gold) > 1 else "")


def build_judge_messages(question: str, gold: str | Sequence[str], prediction: str) -> list[dict[str, str]]:
    user = _TEMPLATE.format(question=question.strip(), gold=_gold_text(gold), prediction=prediction.strip() or "(empty)")
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


def parse_verdict(reply: str) -> Optional[bool]:
    """True (correct), False (incorrect) or None (no verdict words) for a judge reply."""
    spans = _JUDGMENT.findall(reply or "")
    text = (spans[-1] if spans else reply or "").lower()
    if any(word in text for word in _NEGATIVE):
        return False
    if "correct" in text:
        return True
    return None


@dataclass(frozen=True)
class JudgeVerdict:
    correct: bool          # the judge said correct (an unparsed reply counts as incorrect)
    parsed: bool           # the reply contained a verdict
    reply: str
    cached: bool = False


class _Unavailable(Exception):
    """The endpoint failed after all retries, or refused permanently."""


class _RequestFailed(Exception):
    """This one request was rejected (e.g. HTTP 400); the endpoint itself works."""


# ------------------------------------------------------------------------------------------------ cache
class JudgeCache:
    """Persistent verdict cache (SQLite, WAL; safe to share between processes)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=30.0, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, model TEXT, "
                           "correct INTEGER, parsed INTEGER, reply TEXT, created REAL)")

    @staticmethod
    def key(model: str, question: str, gold: str | Sequence[str], prediction: str) -> str:
        gold_norm = gold if isinstance(gold, str) else list(gold)
        blob = json.dumps([PROMPT_VERSION, model, question, gold_norm, prediction], ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def get(self, key: str) -> Optional[JudgeVerdict]:
        with self._lock:
            row = self._conn.execute("SELECT correct, parsed, reply FROM verdicts WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return JudgeVerdict(correct=bool(row[0]), parsed=bool(row[1]), reply=row[2], cached=True)

    def put(self, key: str, model: str, verdict: JudgeVerdict) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?, ?, ?, ?)",
                               (key, model, int(verdict.correct), int(verdict.parsed), verdict.reply, time.time()))

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()


# ----------------------------------------------------------------------------------------------- client
def chat_completions_url(base_url: str) -> str:
    """``http://h:p`` -> ``http://h:p/v1/chat/completions``; ``.../v1`` and full URLs are kept sensible."""
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class JudgeClient:
    """Async judge client (see module docstring). Use one per event loop; call `close()` at the end."""

    def __init__(
        self,
        url: str,
        model: Optional[str] = None,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        backoff_max_s: float = 16.0,
        max_tokens: int = 256,
        cache_path: Optional[str | os.PathLike] = None,
    ):
        if not url:
            raise ValueError("judge url is empty; set eval.judge.url (e.g. http://127.0.0.1:8001) or disable the judge")
        if max_concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ValueError(f"judge: max_concurrency={max_concurrency} must be >= 1, retries={retries} >= 0, "
                             f"timeout_s={timeout_s} > 0")
        self.url = chat_completions_url(url)
        self.model = model
        self.api_key_env = api_key_env
        self.max_concurrency = max_concurrency
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_tokens = int(max_tokens)
        self.cache = JudgeCache(cache_path) if cache_path is not None else None
        self.unavailable_reason: Optional[str] = None
        self.counts = {"requests": 0, "http_attempts": 0, "retries": 0, "cache_hits": 0, "judged": 0,
                       "unparsed": 0, "failed": 0, "skipped": 0}
        self._semaphore: Optional[asyncio.Semaphore] = None
        self._session: Any = None
        self._model_lock: Optional[asyncio.Lock] = None

    # ------------------------------------------------------------------ public
    async def judge(self, question: str, gold: str | Sequence[str], prediction: str) -> Optional[JudgeVerdict]:
        """The verdict, or None when the judge is unavailable or rejected this request."""
        if self.unavailable_reason is not None:
            self.counts["skipped"] += 1
            return None
        try:
            model = await self._resolve_model()
        except _Unavailable as exc:
            self._mark_unavailable(str(exc))
            self.counts["skipped"] += 1
            return None
        key = JudgeCache.key(model, question, gold, prediction)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                self.counts["cache_hits"] += 1
                self.counts["judged"] += 1
                return hit
        if self.unavailable_reason is not None:
            self.counts["skipped"] += 1
            return None
        body = {"model": model, "messages": build_judge_messages(question, gold, prediction),
                "temperature": 0.0, "max_tokens": self.max_tokens}
        try:
            reply = await self._request_chat(body)
        except _Unavailable as exc:
            self._mark_unavailable(str(exc))
            self.counts["skipped"] += 1
            return None
        except _RequestFailed as exc:
            logger.warning("judge: request rejected: %s", exc)
            self.counts["failed"] += 1
            return None
        verdict_value = parse_verdict(reply)
        verdict = JudgeVerdict(correct=bool(verdict_value), parsed=verdict_value is not None, reply=reply)
        if not verdict.parsed:
            self.counts["unparsed"] += 1
        self.counts["judged"] += 1
        if self.cache is not None:
            self.cache.put(key, model, verdict)
        return verdict

    async def judge_many(self, items: Sequence[tuple[str, str | Sequence[str], str]]) -> list[Optional[JudgeVerdict]]:
        return list(await asyncio.gather(*(self.judge(q, g, p) for q, g, p in items)))

    def status(self) -> dict[str, Any]:
        state = "unavailable" if self.unavailable_reason is not None else "ok"
        out: dict[str, Any] = {"status": state, "url": self.url, "model": self.model, **self.counts}
        if self.unavailable_reason is not None:
            out["reason"] = self.unavailable_reason
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    # ------------------------------------------------------------------ transport
    def _mark_unavailable(self, reason: str) -> None:
        if self.unavailable_reason is None:
            self.unavailable_reason = reason
            logger.warning("judge at %s is unavailable (%s); falling back to rule metrics", self.url, reason)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def _get_session(self) -> Any:
        # deferred: pulls in aiohttp (heavy; this module imports without it)
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._session

    async def _resolve_model(self) -> str:
        """The configured model, or the first one the server lists under /v1/models."""
        if self.model:
            return self.model
        if self._model_lock is None:
            self._model_lock = asyncio.Lock()
        async with self._model_lock:
            if self.model:
                return self.model
            models_url = self.url[: -len("/chat/completions")] + "/models"
            data = await self._with_retries("GET", models_url, None)
            try:
                self.model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as exc:
                raise _Unavailable(f"{models_url} lists no model; set eval.judge.model") from exc
            logger.info("judge: using model %s from %s", self.model, models_url)
            return self.model

    async def _request_chat(self, body: dict[str, Any]) -> str:
        self.counts["requests"] += 1
        data = await self._with_retries("POST", self.url, body)
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise _RequestFailed(f"reply is not a chat completion: {str(data)[:200]}") from exc
        return content or ""

    async def _with_retries(self, method: str, url: str, body: Optional[dict]) -> Any:
        # deferred: pulls in aiohttp (heavy; this module imports without it)
        import aiohttp

        session = await self._get_session()
        delay = self.backoff_s
        last = ""
        for attempt in range(self.retries + 1):
            if self.unavailable_reason is not None:
                raise _Unavailable(self.unavailable_reason)
            if attempt:
                self.counts["retries"] += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2.0, self.backoff_max_s)
            try:
                async with self._semaphore:
                    self.counts["http_attempts"] += 1
                    async with session.request(method, url, json=body, headers=self._headers()) as resp:
                        text = await resp.text()
                        if resp.status == 200:
                            try:
                                return json.loads(text)
                            except json.JSONDecodeError as exc:
                                raise _RequestFailed(f"HTTP 200 with a non-JSON body: {text[:200]!r}") from exc
                        if resp.status in _FATAL_STATUS:
                            raise _Unavailable(f"HTTP {resp.status} from {url}: {text[:200]} (check the URL, "
                                               f"eval.judge.model and the key in ${self.api_key_env})")
                        if resp.status not in _RETRY_STATUS:
                            raise _RequestFailed(f"HTTP {resp.status} from {url}: {text[:200]}")
                        last = f"HTTP {resp.status}: {text[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            logger.info("judge: %s %s failed (%s), attempt %d/%d", method, url, last, attempt + 1, self.retries + 1)
        raise _Unavailable(f"{method} {url} failed after {self.retries + 1} attempts; last error: {last}")
