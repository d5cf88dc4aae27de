"""Named built-in system prompts: ``data.system_prompt`` is one of these names or the prompt text itself.

- ``default``: the project's own wording of the tool-use instruction (the tag protocol of
  docs/design/arpo_reference.md §1).
- ``arpo``: the system prompt of ARPO's released RL parquet rows (train_10k, valid, gaia_test, hle_test;
  docs/design/arpo_reference.md §7), with its ``\\boxed`` written correctly. The 32B recipes use it for
  training and evaluation alike, so a policy trained on ARPO's rows is evaluated on the prompt it saw.
- ``none``: no system prompt.

A row that carries its own system prompt (a parquet ``prompt`` with a system message, a ``system`` field)
keeps it; the configured prompt is used for rows without one.
"""

from __future__ import annotations

import re
from typing import Optional

from megatron_arpo.errors import InputError

__all__ = ["ARPO_SYSTEM_PROMPT", "DEFAULT_SYSTEM_PROMPT", "SYSTEM_PROMPTS", "resolve_system_prompt"]

# Our own wording of the tool-use instruction (same tag protocol as ARPO's system prompt, §1).
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant that solves the user's question step by step. You may use two tools "
    "while you think: a search engine and a python interpreter. Put your reasoning inside <think> "
    "</think>. To search, write a query inside <search> </search>; to run code, write python inside "
    "<python> </python>. The tool output is returned to you inside <result> </result>. When you are "
    "done, give the final answer inside <answer> </answer>, with the exact answer written as "
    "\\boxed{answer}."
)

# Verbatim data: the system message of every row of ARPO's RL parquet files (the text the released
# policies were trained on), with the backspace-corrupted "\boxed" repaired (Q13). Kept exact on purpose.
ARPO_SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help of the wikipedia "
    "search tool and python interpreter tool. Given a question, you need to first think about the reasoning process "
    "in the mind and then provide the answer. During thinking, you can invoke the wikipedia search tool to search "
    "and python interpreter tool to calculate the math problem for fact information about specific topics if "
    "needed. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags "
    "respectively, and the search query and result are enclosed within <search> </search> and <result> </result> "
    "tags respectively. For example, <think> This is the reasoning process. </think> <search> search query here "
    "</search> <result> search result here </result> <think> This is the reasoning process. </think> <python> "
    "python code here </python> <result> python interpreter result here </result> <think> This is the reasoning "
    "process. </think> <answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last part of the "
    "answer, the final exact answer is enclosed within \\boxed{} with latex format."
)

SYSTEM_PROMPTS: dict[str, str] = {"default": DEFAULT_SYSTEM_PROMPT, "arpo": ARPO_SYSTEM_PROMPT, "none": ""}


def resolve_system_prompt(value: Optional[str]) -> Optional[str]:
    """The prompt text of ``data.system_prompt``: a built-in name (``default``, ``arpo``, ``none``), the
    text itself, or null / "" for ``default``. Returns None for ``none``. A single word that is no built-in
    in lower case (a misspelt name) is refused: a prompt's text is a sentence."""
    if value is None or value == "":
        return DEFAULT_SYSTEM_PROMPT
    key = value.strip().lower()
    if key in SYSTEM_PROMPTS:
        return SYSTEM_PROMPTS[key] or None
    if re.fullmatch(r"[a-z0-9_.-]+", value.strip()):  # a lower-case word: meant as a name
        raise InputError(f"data.system_prompt {value!r} is not a built-in prompt ({', '.join(SYSTEM_PROMPTS)}); give "
                         "one of those names or the prompt's text")
    return value
