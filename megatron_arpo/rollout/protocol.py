"""The tool-tag protocol of a rollout: stop tokens, tool-query extraction and result tokenization.

Layout (ARPO_REFERENCE.md §1): the model writes ``<tag>query</tag>`` for tag in the enabled tools; the
closing tag stops generation; the environment appends ``" <result>\\n{payload}\\n</result>"``, tokenized
on its own exactly once (``encode(..., add_special_tokens=False)``, so no BOS sneaks in — Q10) and
spliced after the stop token. The context is never re-tokenized from text.

Differences from the reference:
- tool closing tags must be single tokens (they are stop *token ids*, exact and cheap; the project's
  tokenizers add them as tokens). A tokenizer that splits a closing tag is rejected with an error.
- the query is the text between the LAST opening tag and the closing tag inside the current segment
  (the tokens generated since the last tool result or the prompt), never in the prompt or in an
  earlier tool result (Q5: the reference searched the whole decoded context, prompt included). A
  closing tag without an opening tag gives an empty query, which the tool executor answers with an
  error result; the trajectory continues.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["RESULT_TEMPLATE", "TagProtocol", "ToolCallRequest", "checkpoint_eos_token_ids"]

RESULT_TEMPLATE = " <result>\n{payload}\n</result>"


@dataclass
class ToolCallRequest:
    tag: str
    query: str


class TagProtocol:
    """Binds a tokenizer (anything with ``encode``/``decode``/``eos_token_id``) to the enabled tool tags.

    ``vocab_size`` is |V| for the entropy normaliser; default ``len(tokenizer)`` (the reference uses
    ``len(tokenizer.get_vocab())``, the same for the project's tokenizers).
    """

    def __init__(self, tokenizer: Any, tool_tags: Sequence[str], *, eos_token_id: Optional[int] = None,
                 extra_eos_token_ids: Sequence[int] = (), vocab_size: Optional[int] = None,
                 result_template: str = RESULT_TEMPLATE):
        self.tokenizer = tokenizer
        self.tool_tags = list(tool_tags)
        eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id= explicitly")
        self.eos_token_id = int(eos)
        # Every id that ends an episode. Checkpoints list several (Qwen3's generation_config.json has
        # <|im_end|> and <|endoftext|>) and vLLM stops on all of them; eos_token_id is the one appended
        # when a trajectory hits its call limit.
        self.end_token_ids = frozenset({self.eos_token_id, *(int(i) for i in extra_eos_token_ids)})
        self.vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))
        if "{payload}" not in result_template:
            raise ValueError(f"result_template {result_template!r} must contain '{{payload}}'")
        self.result_template = result_template
        self.open_ids: dict[int, str] = {}
        self.close_ids: dict[int, str] = {}
        for tag in self.tool_tags:
            self.open_ids[self._single_token(f"<{tag}>")] = tag
            self.close_ids[self._single_token(f"</{tag}>")] = tag

    def _single_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"tool tag {text!r} encodes to {len(ids)} tokens {ids}; the rollout stops on tool tags by "
                "token id, so every <tag>/</tag> must be a single token: add them to the tokenizer as "
                "added tokens (megatron_arpo.tiny.tokenizer does)")
        return int(ids[0])

    @property
    def stop_token_ids(self) -> list[int]:
        """Closing tags plus EOS (vLLM without a tokenizer does not know EOS by itself)."""
        return list(self.close_ids) + sorted(self.end_token_ids)

    def tool_call(self, segment_ids: Sequence[int]) -> Optional[ToolCallRequest]:
        """The call a segment ends with, or None. ``segment_ids``: tokens since the last tool result."""
        if not segment_ids or segment_ids[-1] not in self.close_ids:
            return None
        tag = self.close_ids[segment_ids[-1]]
        open_id = next(i for i, t in self.open_ids.items() if t == tag)
        body = segment_ids[:-1]
        start = None
        for pos in range(len(body) - 1, -1, -1):
            if body[pos] == open_id:
                start = pos + 1
                break
        if start is None:
            return ToolCallRequest(tag=tag, query="")
        return ToolCallRequest(tag=tag, query=self.tokenizer.decode(list(body[start:])).strip())

    def is_end(self, token_id: Any) -> bool:
        return token_id in self.end_token_ids

    def encode_result(self, payload: str) -> list[int]:
        return list(self.tokenizer.encode(self.result_template.format(payload=payload), add_special_tokens=False))


def checkpoint_eos_token_ids(model_dir: str | os.PathLike) -> list[int]:
    """EOS ids an HF checkpoint declares (config.json and generation_config.json), in file order."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.exists():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
