"""Search tool with pluggable backends: local BM25, a FlashRAG-style HTTP retriever, Bing via Bright Data.

`SearchTool` normalises the query the way the reference's training tool does (strip, then drop every
double quote: docs/design/arpo_reference.md §6.2, V14); the normalised query is both the cache key and what the
backend receives. Passages are rendered one per line as `Page {i}: {title}: {text}` (`Page {i}: {text}`
when a passage has no title), each cut to `result_chars`; no passages gives `No search results found.`
The reference shows web snippets without titles; titles are kept here because local corpora (wiki
chunks) carry much of their meaning in them.

Backends implement `async search(query, topk) -> list[Passage]` and signal retryable failures with
`TransportError` (connection errors, timeouts, HTTP 5xx) and permanent ones with `ToolError` (HTTP 4xx,
missing key). The executor retries only the former.

- `LocalBM25Backend(corpus_path)`: bm25s over a JSONL corpus with `id`, `title` and `contents` or `text`
  fields. The index is built once on first use, in a worker thread; retrieval is deterministic.
- `HttpRetrieverBackend(url)`: the retrieval server of FlashRAG/Search-R1: POST
  `{"queries": [q], "topk": k, "return_scores": true}`, answer `{"result": [[{"document": doc,
  "score": s}, ...]]}` (bare documents are accepted too); a document's `contents` is `"Title"\ntext`.
- `WebSearchBackend`: Bing through the Bright Data request API, as the reference: the key comes only
  from an environment variable (default `BRIGHT_DATA_API_KEY`) and never reaches a log line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
import urllib.parse
from typing import Optional

from megatron_arpo.redaction import redact_url
from megatron_arpo.tools.base import Tool, ToolError, ToolResult, TransportError

logger = logging.getLogger(__name__)

NO_RESULTS = "No search results found."


def normalize_query(query: str, style: str = "train") -> str:
    """Cache key of a search query.

    `train` (default, V14): strip, then remove every double quote; otherwise case and inner whitespace
    are kept. `eval` (V13): strip, lowercase, drop every character that is neither a word character
    nor whitespace.
    """
    if style == "train":
        return query.strip().replace('"', "")
    if style == "eval":
        return re.sub(r"[^\w\s]", "", query.strip().lower())
    raise ValueError(f"normalize_query: style={style!r}; use 'train' or 'eval'")


@dataclasses.dataclass(frozen=True)
class Passage:
    title: str
    text: str
    score: Optional[float] = None
    doc_id: Optional[str] = None


def format_passages(passages: list[Passage], result_chars: int = 1000) -> str:
    if not passages:
        return NO_RESULTS
    lines = []
    for i, passage in enumerate(passages, start=1):
        body = " ".join(passage.text.split())[:result_chars]
        title = passage.title.strip()
        lines.append(f"Page {i}: {title}: {body}" if title else f"Page {i}: {body}")
    return "\n".join(lines)


def _split_contents(contents: str) -> tuple[str, str]:
    """FlashRAG wiki chunks store `"Title"\\ntext` in one field."""
    head, sep, rest = contents.partition("\n")
    if sep and head.strip():
        return head.strip().strip('"'), rest.strip()
    return "", contents.strip()


def passage_from_doc(doc: dict, score: Optional[float] = None) -> Passage:
    doc_id = doc.get("id")
    doc_id = None if doc_id is None else str(doc_id)
    if "text" in doc or "title" in doc:
        text = doc.get("text", doc.get("contents", ""))
        return Passage(str(doc.get("title", "")), str(text), score, doc_id)
    if "contents" in doc:
        title, text = _split_contents(str(doc["contents"]))
        return Passage(title, text, score, doc_id)
    raise ToolError(f"retriever document has none of the fields title/text/contents: keys {sorted(doc)}")


class SearchTool(Tool):
    """The `search` tool: normalises the query and formats the backend's passages.

    Cache key: `<settings digest>|<normalised query>`, where the digest covers topk, result_chars, the
    normalisation and the backend's identity (the local corpus's content hash, the retriever URL and
    index version, the web search market), so a changed setting or corpus never meets stale entries.
    An answer without passages is returned but marked not cacheable: it may be a transient failure of
    the retriever.
    """

    cacheable = True

    def __init__(self, backend, *, topk: int = 3, result_chars: int = 1000, tag: str = "search"):
        if topk < 1:
            raise ValueError(f"search: topk={topk} must be >= 1")
        self.backend = backend
        self.topk = int(topk)
        self.result_chars = int(result_chars)
        self.tag = tag
        identity = {"topk": self.topk, "result_chars": self.result_chars, "normalize": "train",
                    "backend": backend.identity() if hasattr(backend, "identity") else type(backend).__name__}
        self.cache_namespace = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def cache_key(self, query: str) -> str:
        return f"{self.cache_namespace}|{normalize_query(query)}"

    async def execute(self, query: str) -> ToolResult:
        passages = (await self.backend.search(normalize_query(query), self.topk))[: self.topk]
        return ToolResult(text=format_passages(passages, self.result_chars), cacheable=bool(passages))

    async def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            await close()


class LocalBM25Backend:
    """BM25 (bm25s, Lucene variant, English stopwords, no stemming) over a JSONL corpus."""

    def __init__(self, corpus_path: str):
        self.corpus_path = os.fspath(corpus_path)
        if not os.path.isfile(self.corpus_path):
            raise ValueError(f"search: corpus {self.corpus_path} does not exist; set search.corpus to a JSONL file")
        self._passages: list[Passage] = []
        self._retriever = None
        self._lock = threading.Lock()
        digest = hashlib.sha256()
        with open(self.corpus_path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        self.corpus_sha256 = digest.hexdigest()

    def identity(self) -> dict:
        """What the results depend on: the corpus content (not its path) and the retrieval method."""
        return {"kind": "local-bm25", "corpus_sha256": self.corpus_sha256}

    def _load(self) -> None:
        # deferred: pulls in bm25s (heavy; this module imports without it)
        import bm25s  # heavy-ish (numpy/scipy); imported only when a local index is used

        passages = []
        with open(self.corpus_path, encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"search: {self.corpus_path}:{lineno} is not valid JSON: {exc}") from exc
                try:
                    passages.append(passage_from_doc(doc))
                except ToolError as exc:
                    raise ValueError(f"search: {self.corpus_path}:{lineno}: {exc}") from exc
        if not passages:
            raise ValueError(f"search: corpus {self.corpus_path} holds no documents")
        tokens = bm25s.tokenize(
            [f"{p.title}\n{p.text}" for p in passages], stopwords="en", show_progress=False
        )
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        self._passages, self._retriever = passages, retriever
        logger.info("search: indexed %d passages from %s", len(passages), self.corpus_path)

    def ensure_index(self) -> None:
        with self._lock:
            if self._retriever is None:
                self._load()

    def search_sync(self, query: str, topk: int) -> list[Passage]:
        # deferred: pulls in bm25s (heavy; this module imports without it)
        import bm25s

        self.ensure_index()
        query_tokens = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)
        if not query_tokens[0]:
            return []
        k = min(topk, len(self._passages))
        with self._lock:  # bm25s retrievers are not documented as thread-safe
            docs, scores = self._retriever.retrieve(query_tokens, k=k, show_progress=False, n_threads=1)
        out = []
        for index, score in zip(docs[0].tolist(), scores[0].tolist()):
            if score <= 0.0:
                continue
            passage = self._passages[index]
            out.append(dataclasses.replace(passage, score=float(score)))
        return out

    async def search(self, query: str, topk: int) -> list[Passage]:
        return await asyncio.to_thread(self.search_sync, query, topk)


DEFAULT_MAX_RESPONSE_BYTES = 16 << 20  # a retriever answer of topk passages is kilobytes


class _HttpBackend:
    """Shared aiohttp session handling; the session is created in the loop that uses it. An answer body
    larger than ``max_response_bytes`` is refused (a tool error) without being read further."""

    def __init__(self, timeout_s: float, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
        self.timeout_s = float(timeout_s)
        self.max_response_bytes = int(max_response_bytes)
        self._session = None
        self._session_loop = None

    def _get_session(self):
        # deferred: pulls in aiohttp (heavy; this module imports without it)
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # A session belongs to one event loop; a session of a finished loop is simply dropped.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._session_loop = loop
        return self._session

    async def _post_json(self, url: str, payload: dict, headers: Optional[dict] = None, what: str = "") -> object:
        # deferred: pulls in aiohttp (heavy; this module imports without it)
        import aiohttp

        session = self._get_session()
        try:
            async with session.post(url, json=payload, headers=headers) as response:
                body = await self._read_capped(response, what)
                if response.status >= 500 or response.status == 429:
                    raise TransportError(f"{what} answered HTTP {response.status}")
                if response.status >= 400:
                    raise ToolError(f"{what} rejected the request with HTTP {response.status}: {body[:200]}")
        except (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, asyncio.TimeoutError) as exc:
            raise TransportError(f"{what} unreachable: {type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientPayloadError as exc:
            raise TransportError(f"{what} sent a broken response: {exc}") from exc
        try:
            return json.loads(body)
        except ValueError as exc:
            raise ToolError(f"{what} answered with non-JSON: {body[:200]!r}") from exc

    async def _read_capped(self, response, what: str) -> str:
        cap = self.max_response_bytes
        too_big = (f"{what} answered more than {cap} bytes (tools.search.max_response_bytes); the answer was not "
                   f"read. Ask for fewer passages (tools.search.topk) or raise the cap")
        if response.content_length is not None and response.content_length > cap:
            raise ToolError(too_big)
        body = bytearray()
        async for chunk in response.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > cap:
                raise ToolError(too_big)
        return bytes(body).decode(response.charset or "utf-8", errors="replace")

    async def close(self) -> None:
        if self._session is not None and not self._session.closed and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None


class HttpRetrieverBackend(_HttpBackend):
    """Client of a FlashRAG/Search-R1 style retrieval service (`POST /retrieve`)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, index_version: Optional[str] = None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
        super().__init__(timeout_s, max_response_bytes)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"search: retriever url {redact_url(url)!r} must start with http:// or https://")
        self.url = url
        self.index_version = index_version
        self.shown_url = redact_url(url)  # for messages: a password in the URL never reaches them

    def identity(self) -> dict:
        # The index behind a URL is invisible from here: `index_version` names it (set it when it changes).
        return {"kind": "http", "url": self.url, "index_version": self.index_version}

    async def search(self, query: str, topk: int) -> list[Passage]:
        payload = {"queries": [query], "topk": topk, "return_scores": True}
        answer = await self._post_json(self.url, payload, what=f"retriever {self.shown_url}")
        try:
            hits = answer["result"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise ToolError(f"retriever {self.shown_url} answer has no result[0]: {str(answer)[:200]}") from exc
        passages = []
        for hit in hits:
            if isinstance(hit, dict) and "document" in hit:
                passages.append(passage_from_doc(hit["document"], hit.get("score")))
            elif isinstance(hit, dict):
                passages.append(passage_from_doc(hit))
            else:
                raise ToolError(f"retriever {self.shown_url} returned a non-object hit: {str(hit)[:200]}")
        return passages


_CJK = re.compile(r"[\u4e00-\u9fff]")


class WebSearchBackend(_HttpBackend):
    """Bing results through the Bright Data request API (needs network and a key in the environment)."""

    endpoint = "https://api.brightdata.com/request"

    def __init__(
        self,
        *,
        api_key_env: str = "BRIGHT_DATA_API_KEY",
        zone: Optional[str] = None,
        location: str = "us",
        timeout_s: float = 60.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ):
        super().__init__(timeout_s, max_response_bytes)
        self.api_key_env = api_key_env
        self.zone = zone
        self.location = location
        if not os.environ.get(api_key_env):
            raise ValueError(
                f"search: the web backend needs a Bright Data API key in the environment variable "
                f"{api_key_env}; export it (it is never read from config files)"
            )

    def identity(self) -> dict:
        return {"kind": "bing-brightdata", "endpoint": self.endpoint, "zone": self.zone, "location": self.location}

    def bing_url(self, query: str) -> str:
        market, language = ("zh-CN", "zh") if _CJK.search(query) else ("en-US", "en")
        params = {"q": query, "mkt": market, "setLang": language, "brd_json": "1", "cc": self.location}
        return "https://www.bing.com/search?" + urllib.parse.urlencode(params)

    async def search(self, query: str, topk: int) -> list[Passage]:
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ToolError(f"web search: environment variable {self.api_key_env} is not set")
        payload = {"url": self.bing_url(query), "format": "raw"}
        if self.zone:
            payload["zone"] = self.zone
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        answer = await self._post_json(self.endpoint, payload, headers=headers, what="Bright Data")
        return parse_bing_results(answer, topk)


def parse_bing_results(answer, topk: int) -> list[Passage]:
    """Organic results of a Bright Data Bing JSON answer: unique non-empty descriptions, in order."""
    if not isinstance(answer, dict):
        raise ToolError(f"Bright Data answer is not a JSON object: {str(answer)[:200]}")
    seen, passages = set(), []
    for item in answer.get("organic") or []:
        description = str(item.get("description") or "").strip()
        if not description or description in seen:
            continue
        seen.add(description)
        passages.append(Passage(str(item.get("title") or ""), description))
        if len(passages) == topk:
            break
    return passages
