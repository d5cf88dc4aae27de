"""SFT renders every turn with the checkpoint's own chat template, per family (Qwen3, QwQ, Llama 3).

The templates are the published ones (tests/support/chat_templates/, origins in its README). For a
multi-turn conversation with tool results inside assistant turns and consecutive tool turns, our token
ids decode to exactly what the template's ``apply_chat_template`` renders for the same conversation, and
only the assistant text and its end-of-turn token are trained. The Llama 3 tokenizer is the real Qwen BPE
with Llama 3's header tokens added (no Llama tokenizer is available offline); the template is Llama's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megatron_arpo.data import sft
from megatron_arpo.data.chat import ChatFormat, load_chat_format, thinking_prefix

TEMPLATES = Path(__file__).resolve().parents[1] / "support" / "chat_templates"
RESULT = " <result>\n2.1 million\n</result>"
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def conversation(prefix: str = "", final: str = "The result is <answer>4.2 million</answer>") -> list[dict]:
    """system, two user turns, a tool result inside an assistant turn, two consecutive tool turns."""
    return [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "How many people live in Paris?"},
        {"role": "assistant", "content": prefix + "I search. <search>Paris population</search>" + RESULT
                                         + " <answer>2.1 million</answer>"},
        {"role": "user", "content": "And twice that?"},
        {"role": "assistant", "content": prefix + "<python>print(2.1 * 2)</python>"},
        {"role": "tool", "content": "4.2"},
        {"role": "tool", "content": "exit code 0"},
        {"role": "assistant", "content": prefix + final},
    ]


def _qwen_chat(checkpoint: Path, template: str) -> ChatFormat:
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    return load_chat_format(tok, checkpoint, chat_template_file=TEMPLATES / template)


@pytest.fixture(scope="module")
def qwen3_chat(qwen3_checkpoint):
    return _qwen_chat(qwen3_checkpoint, "qwen3.jinja")


@pytest.fixture(scope="module")
def qwq_chat(qwq_checkpoint):
    return _qwen_chat(qwq_checkpoint, "qwq-32b.jinja")


@pytest.fixture(scope="module")
def llama_chat(qwen3_checkpoint):
    tok = AutoTokenizer.from_pretrained(str(qwen3_checkpoint))
    tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
    return ChatFormat(tokenizer=tok, eos_token_ids=[tok.convert_tokens_to_ids("<|eot_id|>")],
                      response_prefix=thinking_prefix(tok, {}))


def _cases(request):
    family = request.param
    chat = request.getfixturevalue(f"{family}_chat")
    if family == "qwen3":
        # The final turn in the template's own think layout (Qwen3 writes an empty think block otherwise).
        return family, chat, conversation(final="<think>\nDouble it.\n</think>\n\n<answer>4.2 million</answer>")
    if family == "qwq":
        return family, chat, conversation(prefix="<think>\n")  # the model's text starts with the prompt's <think>
    return family, chat, conversation()


@pytest.fixture(params=["qwen3", "qwq", "llama"])
def case(request):
    return _cases(request)


def test_rendering_is_the_templates_own(case):
    family, chat, messages = case
    tok = chat.tokenizer
    example, counts = sft.tokenize_conversation(chat, messages, max_tokens=10_000)
    reference = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(example.input_ids) == reference
    assert counts["result_spans"] == 1
    # The first turn's context is exactly the RL prompt.
    prompt = chat.render(messages[:2])
    assert example.input_ids[:len(prompt)] == prompt and not any(example.loss_mask[:len(prompt)])
    # Trained: the assistant text (tool result and the prompt's thinking prefix left out) and one end-of-turn
    # token per turn; nothing else.
    eot = "<|eot_id|>" if family == "llama" else "<|im_end|>"
    expected = "".join(m["content"].replace(RESULT, "")[len(chat.response_prefix):] + eot
                       for m in messages if m["role"] == "assistant")
    assert tok.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m]) == expected
    if family == "llama":
        assert reference.count("<|start_header_id|>ipython<|end_header_id|>") == 2 and "<|im_start|>" not in reference
        assert "<|start_header_id|>user<|end_header_id|>\n\nAnd twice that?<|eot_id|>" in reference
    else:  # Qwen merges consecutive tool turns into one user turn
        assert "<|im_start|>user\n<tool_response>\n4.2\n</tool_response>\n<tool_response>\nexit code 0\n" \
               "</tool_response><|im_end|>" in reference


def test_qwq_prompt_prefix_and_later_turn_headers(qwq_chat):
    messages = conversation(prefix="<think>\n")
    example, counts = sft.tokenize_conversation(qwq_chat, messages, max_tokens=10_000)
    assert qwq_chat.response_prefix == "<think>\n" and counts["prefix_stripped"] == 3
    text = qwq_chat.tokenizer.decode(example.input_ids)
    assert text.count("<|im_start|>assistant\n<think>\n") == 3   # every turn opens as the generation prompt does


def test_earlier_reasoning_is_trained_as_written(qwen3_chat):
    """The documented difference: Qwen3's template drops the reasoning of turns before the last user turn
    from the history; SFT keeps the assistant text as written (mask 1)."""
    messages = conversation(final="<think>\nDouble it.\n</think>\n\n<answer>4.2 million</answer>")
    messages[2] = {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\n<answer>2.1 million</answer>"}
    example, _ = sft.tokenize_conversation(qwen3_chat, messages, max_tokens=10_000)
    tok = qwen3_chat.tokenizer
    assert "Look it up." not in tok.apply_chat_template(messages, tokenize=False)
    trained = tok.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])
    assert trained.startswith("<think>\nLook it up.\n</think>\n\n<answer>2.1 million</answer><|im_end|>")
