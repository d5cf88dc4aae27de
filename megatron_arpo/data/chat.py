"""A checkpoint's chat format: its chat template, its EOS ids and its thinking prefix (training, eval, SFT).

Published checkpoints are used unchanged:

- **Prompts** are rendered with the checkpoint's own chat template (``tokenizer_config.json``'s
  ``chat_template``, or ``data.chat_template``) with the generation prompt, then encoded without BOS.
  ``enable_thinking`` (``data.enable_thinking``) is passed to the template when set: Qwen3's hybrid template
  then writes an empty ``<think>\\n\\n</think>\\n\\n`` block into the generation prompt (no-think mode).
- **Thinking prefix.** Some templates open the assistant turn with part of the response: QwQ-32B's (and
  Qwen3-*-Thinking's) generation prompt ends in ``<think>\\n``, so the model writes only the closing
  ``</think>``. ``response_prefix`` is the generation prompt from its ``<think>`` on (empty when it has none,
  as Qwen3's default); rewards and evaluation read ``response_prefix + response`` so the reference's format
  check (balanced ``<think>``/``</think>``) holds, and SFT strips it from the written answer because the
  prompt already holds it.
- **EOS ids** come from ``generation_config.json`` (``eos_token_id``: Qwen3 and QwQ list ``<|im_end|>`` and
  ``<|endoftext|>``), with the tokenizer's eos first (the id appended at the call limit). A missing file or
  field, or a list without the tokenizer's eos, is an error naming the file and the field to add: vLLM
  would otherwise not stop at the end of the assistant turn.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_arpo.errors import InputError
from megatron_arpo.rollout.protocol import TagProtocol

logger = logging.getLogger(__name__)

__all__ = ["ChatFormat", "ChatFormatError", "generation_eos_token_ids", "load_chat_format", "require_chat_template"]

THINK_OPEN = "<think>"
_PROBE = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]


class ChatFormatError(InputError):
    """A tokenizer or checkpoint that cannot render prompts or end episodes; names the file and the fix."""


@dataclass
class ChatFormat:
    tokenizer: Any
    eos_token_ids: list[int]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    response_prefix: str = ""

    def render_text(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def render(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt token ids: the chat template with the generation prompt, encoded without BOS."""
        return list(self.tokenizer.encode(self.render_text(messages), add_special_tokens=False))

    def protocol(self, tool_tags: Sequence[str], **kwargs: Any) -> Any:
        """The `TagProtocol` of this format for the enabled tool tags."""
        return TagProtocol(self.tokenizer, tool_tags, eos_token_ids=self.eos_token_ids,
                           response_prefix=self.response_prefix, **kwargs)


def require_chat_template(tokenizer: Any, tokenizer_dir: str | os.PathLike) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatFormatError(
            f"the tokenizer in {tokenizer_dir} has no chat template; prompts are rendered with the checkpoint's own "
            f"template. Add a \"chat_template\" field to {Path(tokenizer_dir) / 'tokenizer_config.json'} (or a "
            "chat_template.jinja file) from the chat model this checkpoint came from, or set data.chat_template to a "
            "Jinja file")


def generation_eos_token_ids(model_dir: str | os.PathLike, tokenizer: Any) -> list[int]:
    """The episode-ending ids of ``model_dir/generation_config.json``, the tokenizer's eos first."""
    path = Path(model_dir) / "generation_config.json"
    eos = getattr(tokenizer, "eos_token_id", None)
    eos_name = getattr(tokenizer, "eos_token", None)
    suggestion = f"\"eos_token_id\": [{eos}]" if eos is not None else "\"eos_token_id\": [<id of the end-of-turn token>]"
    if not path.exists():
        raise ChatFormatError(f"{path} is missing; the rollout stops generation on its eos_token_id list. Add the file "
                              f"with {suggestion} (Qwen3 and QwQ ship [151645, 151643]: <|im_end|>, <|endoftext|>)")
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ChatFormatError(f"{path} is not a JSON object ({exc}); fix the file") from exc
    ids = value if isinstance(value, list) else [value]
    if value is None or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ChatFormatError(f"{path} has no usable eos_token_id (got {value!r}); add {suggestion}")
    if eos is None:
        raise ChatFormatError(f"the tokenizer of {model_dir} has no eos_token; set \"eos_token\" in its "
                              "tokenizer_config.json to the end-of-turn token (<|im_end|> for Qwen chat models)")
    if eos not in ids:
        raise ChatFormatError(
            f"{path}: eos_token_id {value!r} does not include the tokenizer's eos_token {eos_name!r} (id {eos}), so "
            f"generation would not stop at the end of the assistant turn; add {eos} to eos_token_id in {path}")
    return [eos] + [i for i in dict.fromkeys(ids) if i != eos]


def thinking_prefix(tokenizer: Any, template_kwargs: dict[str, Any]) -> str:
    """The part of the template's generation prompt from ``<think>`` on ("" when it opens no think block)."""
    try:
        probe = list(_PROBE)
        with_prompt = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception:  # noqa: BLE001 - a template without a system role (jinja raises its own error types)
        probe = _PROBE[1:]
        with_prompt = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **template_kwargs)
    without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False, **template_kwargs)
    if not with_prompt.startswith(without):
        logger.warning("the chat template's generation prompt does not extend the rendered conversation; "
                       "no thinking prefix is taken from it")
        return ""
    generation = with_prompt[len(without):]
    at = generation.find(THINK_OPEN)
    return generation[at:] if at >= 0 else ""


def load_chat_format(tokenizer: Any, model_dir: str | os.PathLike, *, tokenizer_dir: Optional[str | os.PathLike] = None,
                     chat_template_file: Optional[str | os.PathLike] = None,
                     enable_thinking: Optional[bool] = None) -> ChatFormat:
    """Check and bind a checkpoint's tokenizer (see the module docstring). ``chat_template_file`` replaces the
    tokenizer's template; ``enable_thinking`` (None = the template's default) is passed to the template."""
    if chat_template_file:
        path = Path(chat_template_file)
        if not path.exists():
            raise ChatFormatError(f"data.chat_template: {path} does not exist; give a Jinja file or null for the "
                                  "tokenizer's own template")
        tokenizer.chat_template = path.read_text()
    require_chat_template(tokenizer, tokenizer_dir or model_dir)
    kwargs = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
    eos_ids = generation_eos_token_ids(model_dir, tokenizer)
    fmt = ChatFormat(tokenizer=tokenizer, eos_token_ids=eos_ids, template_kwargs=kwargs,
                     response_prefix=thinking_prefix(tokenizer, kwargs))
    logger.info("chat format of %s: eos ids %s, response prefix %r", model_dir, eos_ids, fmt.response_prefix)
    return fmt
