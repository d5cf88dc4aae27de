"""The demo's SFT rows carry the system prompt the RL prompts get: ``data.system_prompt`` is a built-in name or text."""

import json

import pytest

from megatron_arpo.data.datasets import load_prompts
from megatron_arpo.data.demo_tasks import DEMO_SYSTEM_PROMPT, build_sft_rows, generate_demo_tasks
from megatron_arpo.data.fields import resolve_conversation
from megatron_arpo.data.system_prompts import ARPO_SYSTEM_PROMPT, DEFAULT_SYSTEM_PROMPT
from megatron_arpo.demo import sft_system_prompt
from megatron_arpo.errors import InputError


def _rl_system(tmp_path, setting):
    """The system message of an RL prompt row, loaded as the trainer loads it (trainer/runtime.py)."""
    path = tmp_path / "rl.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "5"}) + "\n")
    records, _ = load_prompts(path, system_prompt=setting or DEFAULT_SYSTEM_PROMPT)
    messages = records[0].messages
    return messages[0]["content"] if messages[0]["role"] == "system" else None


def _sft_system(setting):
    task = generate_demo_tasks(seed=0)[0]["sft"][0]
    row = build_sft_rows([task], [None], sft_system_prompt(setting))[0]
    messages = resolve_conversation(row, "sft row 1")
    return messages[0]["content"] if messages[0]["role"] == "system" else None


@pytest.mark.parametrize("setting, text", [
    ("arpo", ARPO_SYSTEM_PROMPT),
    ("ARPO", ARPO_SYSTEM_PROMPT),
    ("default", DEFAULT_SYSTEM_PROMPT),
    (None, DEFAULT_SYSTEM_PROMPT),
    ("none", None),
    (DEMO_SYSTEM_PROMPT, DEMO_SYSTEM_PROMPT),
])
def test_sft_rows_get_the_system_prompt_the_rl_prompts_get(tmp_path, setting, text):
    assert _sft_system(setting) == text
    assert _rl_system(tmp_path, setting) == text


def test_a_misspelt_prompt_name_is_refused():
    with pytest.raises(InputError, match="'arpoo' is not a built-in prompt"):
        sft_system_prompt("arpoo")
