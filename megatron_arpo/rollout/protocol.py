"""The tool-tag protocol: stop strings, tool-call detection, result splicing (rollout, evaluation and SFT).

Layout (docs/design/arpo_reference.md §1): the model writes ``<tag>query</tag>`` for a tag of the enabled tools; the
closing tag stops generation; the environment appends ``" <result>\\n{payload}\\n</result>"`` and
generation resumes right after it. Published Qwen tokenizers have no tokens for these tags: ``</python>``
is ``</``, ``python``, ``>`` and merges with its neighbours (``}</`` is one token, so is ``>\\n``). So
tool calls are detected on text, never by token id:

- **Stops.** The closing tags are stop *strings* (vLLM ``SamplingParams(stop=...)``, as the reference);
  EOS ids are stop token ids. vLLM 0.32 (``v1/engine/detokenizer.py``) checks stop strings on the
  incrementally decoded text after each token and keeps the token ids up to and including the token
  that completed the stop string (it truncates only its output *text*, which we do not use).
- **What is kept.** `find_call` decodes the current segment (tokens since the last result or the
  prompt; special tokens skipped, as vLLM's detokenizer does) and finds the closing tag that completes
  first. The trajectory keeps exactly the sampled tokens up to and including the token that completed
  it — never re-tokenized text, so log-probs and training tokens stay aligned. When the tag ends inside
  a token (``>\\n``), the whole token is kept: its trailing characters stay in the response and the
  result is spliced after them (``StopMatch.trailing_text`` records them). Sampled tokens after that one
  (an engine that overshot, or a tag split across two engine requests, which vLLM cannot see) are dropped.
- **Query.** The text between the last opening tag before the closing tag and the closing tag, inside
  the current segment only (never the prompt or an earlier tool result, fixes Q5), stripped. A closing
  tag without an opening one gives an empty query (the executor answers it with an error result).
- **Results.** The result block is tokenized on its own and spliced (never re-tokenized with the
  context), as the tokenizer encodes the whole block text, except that the tool's payload is *plain text*:
  no added token is matched inside it, so a tool that prints ``<|im_end|>``, ``<|im_start|>``, ``<think>``
  or ``</result>`` cannot forge an EOS or a control token (the reference encoded payloads with special
  tokens on, Q10). Only the template's own added tokens (``<result>``, where a tokenizer has one) are ids.
- **Response text** for rewards and evaluation: the response decoded with special tokens skipped, after
  ``response_prefix``, the part of the chat template's generation prompt from ``<think>`` on (QwQ opens
  the thinking block in the prompt; `megatron_arpo.data.chat`), so ``<think>``/``</think>`` balance.
- **SFT data** (`encode_written_response`): written assistant text is split at its result blocks; the
  text around them is trained, each block is re-spliced with `encode_result`, the same tokens a rollout
  produces for that payload.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["RESERVED_TAGS", "RESULT_TEMPLATE", "StopMatch", "TagProtocol", "ToolCallRequest", "plain_text_encoder"]

RESULT_TEMPLATE = " <result>\n{payload}\n</result>"
# Tags the protocol itself uses; a tool named like one would stop on its own result block or the answer.
RESERVED_TAGS = ("think", "result", "answer")
_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")
_RESULT_BLOCK = re.compile(r"\s*<result>(.*?)</result>", re.DOTALL)
_UNCLOSED_RESULT = re.compile(r"\s*<result>", re.DOTALL)


@dataclass(frozen=True)
class ToolCallRequest:
    tag: str
    query: str


@dataclass(frozen=True)
class StopMatch:
    """A tool call found in a generated segment."""

    tag: str
    query: str
    num_tokens: int        # segment tokens kept: up to and including the one that completed the closing tag
    trailing_text: str     # characters of that last token after the closing tag ("" when it ends the token)

    @property
    def request(self) -> ToolCallRequest:
        return ToolCallRequest(self.tag, self.query)


def plain_text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """``text -> ids`` with no added-token matching: every character sequence is ordinary BPE text.

    A fast tokenizer's own pipeline without its added-token pass: normalizer, pre-tokenizer, BPE model
    (``split_special_tokens=True`` alone would still match non-special added tokens such as Qwen3's
    ``<think>``). For text without added tokens this is exactly ``encode(text, add_special_tokens=False)``.
    Other tokenizers are asked for ``split_special_tokens=True``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.pre_tokenizer is not None:
        def encode(text: str) -> list[int]:
            if backend.normalizer is not None:
                text = backend.normalizer.normalize_str(text)
            return [token.id for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)
                    for token in backend.model.tokenize(piece)]

        return encode
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _added_token_ids(tokenizer: Any) -> dict[int, str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        return {int(i): str(getattr(t, "content", t)) for i, t in decoder.items()}
    specials = getattr(tokenizer, "special_tokens", ())
    return {tokenizer.token_id(t): t for t in specials} if hasattr(tokenizer, "token_id") else {}


def _split_at(text: str, added: dict[str, int]) -> list:
    """``text`` as [str, id, str, ..., str]: the added tokens in it (longest match first) as ids; strings at
    both ends (possibly empty), so the payload joins the last string before it and the first after it."""
    out: list = [""]
    i = 0
    order = sorted(added, key=len, reverse=True)
    while i < len(text):
        hit = next((tok for tok in order if tok and text.startswith(tok, i)), None)
        if hit is None:
            out[-1] += text[i]
            i += 1
        else:
            out += [added[hit], ""]
            i += len(hit)
    return out


class TagProtocol:
    """Binds a tokenizer (``encode``/``decode``, e.g. an HF tokenizer) to the enabled tool tags.

    ``eos_token_ids``: every id that ends an episode (a checkpoint's generation_config.json lists
    ``<|im_end|>`` and ``<|endoftext|>``); the first is the one appended when a trajectory hits its call
    limit. Default: the tokenizer's ``eos_token_id``. ``vocab_size`` is |V| for the entropy normaliser
    (default ``len(tokenizer)``). ``response_prefix``: see the module docstring.
    ``num_token_ids`` is ``len(tokenizer)`` whatever ``vocab_size`` says: a sampled id at or above it is
    a padded LM-head row (the scheduler refuses it).
    """

    def __init__(self, tokenizer: Any, tool_tags: Sequence[str], *, eos_token_ids: Optional[Sequence[int]] = None,
                 vocab_size: Optional[int] = None, result_template: str = RESULT_TEMPLATE,
                 response_prefix: str = ""):
        self.tokenizer = tokenizer
        self.tool_tags = list(tool_tags)
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids= explicitly")
            eos_token_ids = [eos]
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty; a rollout needs at least one EOS id")
        self.eos_token_id = int(eos_token_ids[0])
        self.end_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))
        if result_template.count("{payload}") != 1:
            raise ValueError(f"result_template {result_template!r} must contain '{{payload}}' exactly once")
        self.num_token_ids = len(tokenizer)  # sampled ids must be below it (the LM head may be padded)
        self.result_template = result_template
        self._result_before, self._result_after = result_template.split("{payload}")
        self.response_prefix = response_prefix
        self._encode_plain = plain_text_encoder(tokenizer)
        added = {content: token_id for token_id, content in _added_token_ids(tokenizer).items()}
        self._result_pieces = (_split_at(self._result_before, added), _split_at(self._result_after, added))
        for tag in self.tool_tags:
            self._check_tag(tag)
        if len(set(self.tool_tags)) != len(self.tool_tags):
            raise ValueError(f"tool tags {self.tool_tags} repeat a tag; each tool needs its own tag")
        self.close_tags = {f"</{tag}>": tag for tag in self.tool_tags}
        self._check_plain_encoding()

    # ------------------------------------------------------------------ validation
    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _check_tag(self, tag: str) -> None:
        if not isinstance(tag, str) or not _TAG_NAME.match(tag):
            raise ValueError(f"tool tag {tag!r} cannot be written as <{tag}>...</{tag}>: a tag name is a letter or _ "
                             "followed by letters, digits, '_', '.' or '-'")
        if tag in RESERVED_TAGS:
            raise ValueError(f"tool tag {tag!r} is reserved by the tag protocol ({', '.join(RESERVED_TAGS)}); "
                             "give the tool another tag")
        for text in (f"<{tag}>", f"</{tag}>", f"x}}</{tag}>\n"):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            back = self._decode(ids)
            if back != text:
                raise ValueError(
                    f"tool tag {tag!r} can never be produced: {text!r} encodes to {list(ids)}, which decodes "
                    f"(special tokens skipped, as the engine's stop-string check sees it) to {back!r}. Tool calls "
                    f"are detected on decoded text, so <{tag}>/</{tag}> must survive a round trip; if the tokenizer "
                    "registers them as special tokens, make them ordinary text (or non-special added tokens)")

    def _check_plain_encoding(self) -> None:
        added = _added_token_ids(self.tokenizer)
        for token_id, content in added.items():
            if token_id in self._encode_plain(content):
                raise ValueError(f"the tokenizer encodes {content!r} to its control id {token_id} even as plain text; "
                                 "tool output could forge it. Use a tokenizer whose added tokens are not in the BPE "
                                 "vocabulary")

    # ------------------------------------------------------------------ stops
    @property
    def stop_strings(self) -> list[str]:
        """The closing tags, in tool order (the engine's ``stop=``)."""
        return list(self.close_tags)

    @property
    def stop_token_ids(self) -> list[int]:
        return sorted(self.end_token_ids)

    def is_end(self, token_id: Any) -> bool:
        return token_id in self.end_token_ids

    def find_call(self, segment_ids: Sequence[int]) -> Optional[StopMatch]:
        """The first tool call in a segment (tokens since the last result or the prompt), or None."""
        ids = list(segment_ids)
        text = self._decode(ids)
        first = self._first_close(text)
        if first is None:
            return None
        # The shortest token prefix whose text holds a closing tag: the token that completed it is its last.
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._first_close(self._decode(ids[:mid])) is None:
                lo = mid + 1
            else:
                hi = mid
        kept_text = self._decode(ids[:lo])
        start, close = self._first_close(kept_text)
        tag = self.close_tags[close]
        opening = f"<{tag}>"
        body = kept_text[:start]
        open_at = body.rfind(opening)
        query = body[open_at + len(opening):].strip() if open_at >= 0 else ""
        return StopMatch(tag=tag, query=query, num_tokens=lo, trailing_text=kept_text[start + len(close):])

    def _first_close(self, text: str) -> Optional[tuple[int, str]]:
        """(start, closing tag) of the closing tag that ENDS first in ``text`` (vLLM's rule), or None."""
        best: Optional[tuple[int, str]] = None
        best_end = None
        for close in self.close_tags:
            at = text.find(close)
            if at >= 0 and (best_end is None or at + len(close) < best_end):
                best, best_end = (at, close), at + len(close)
        return best

    # ------------------------------------------------------------------ splicing
    def encode_text(self, text: str) -> list[int]:
        """Model-written text as the tokenizer encodes it (added tokens matched, no BOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def encode_result(self, payload: str) -> list[int]:
        """The result block for ``payload``, encoded as the tokenizer encodes the whole block, except that no
        added token is matched inside the payload: the template's own added tokens (``<result>`` where a
        tokenizer has it) are ids, the text between them, payload included, is plain text."""
        before, after = self._result_pieces
        pieces = before[:-1] + [before[-1] + payload + after[0]] + after[1:]
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            elif piece:
                ids.extend(self._encode_plain(piece))
        return ids

    def response_text(self, response_ids: Sequence[int]) -> str:
        """What rewards and evaluation read: ``response_prefix`` + the response, special tokens skipped."""
        return self.response_prefix + self._decode(response_ids)

    # ------------------------------------------------------------------ written responses (SFT)
    def result_payload(self, inner: str) -> str:
        """The payload of a written ``<result>inner</result>``: the template's newlines around it removed."""
        lead = self._result_before.split("<result>", 1)[-1]
        trail = self._result_after.rsplit("</result>", 1)[0]
        if lead and inner.startswith(lead):
            inner = inner[len(lead):]
        if trail and inner.endswith(trail):
            inner = inner[:-len(trail)]
        return inner

    def encode_written_response(self, text: str) -> tuple[list[int], list[int], int]:
        """(ids, loss mask, result blocks) of a written assistant response, spliced as a rollout would be.

        Text outside result blocks is trained (mask 1); each ``<result>...</result>`` block with the
        whitespace before it is replaced by ``encode_result(payload)`` (mask 0). An unclosed ``<result>``
        masks the rest, encoded as plain text.
        """
        ids: list[int] = []
        mask: list[int] = []
        pos = 0
        blocks = 0

        def add(piece: list[int], trained: int) -> None:
            ids.extend(piece)
            mask.extend([trained] * len(piece))

        for match in _RESULT_BLOCK.finditer(text):
            add(self.encode_text(text[pos:match.start()]), 1)
            add(self.encode_result(self.result_payload(match.group(1))), 0)
            blocks += 1
            pos = match.end()
        rest = text[pos:]
        unclosed = _UNCLOSED_RESULT.search(rest)
        if unclosed:
            add(self.encode_text(rest[:unclosed.start()]), 1)
            add(self._encode_plain(rest[unclosed.start():]), 0)
        else:
            add(self.encode_text(rest), 1)
        return ids, mask, blocks
