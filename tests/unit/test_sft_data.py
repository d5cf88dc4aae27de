"""ShareGPT SFT data: parsing, rendering with the checkpoint's chat format, assistant-only loss mask with
tool results spliced and masked as in RL (the rollout's TagProtocol), truncation and errors."""

import json

import pytest

from megatron_arpo.data import sft
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

RESULT_TEXT = " <result>\n42\n</result>"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint("tiny-qwen3")))


@pytest.fixture(scope="module")
def chat(tokenizer):
    from megatron_arpo.data.chat import load_chat_format

    return load_chat_format(tokenizer, tiny_checkpoint("tiny-qwen3"))


def _row(answer: str, system: str | None = "Be brief.", keys=("from", "value"), roles=("human", "gpt")):
    row = {"conversations": [{keys[0]: roles[0], keys[1]: "What is 6*7?"}, {keys[0]: roles[1], keys[1]: answer}]}
    if system is not None:
        row["system"] = system
    return row


def test_normalize_both_key_styles_and_errors():
    a = sft.normalize_conversation(_row("x"), "f:1")
    b = sft.normalize_conversation(_row("x", keys=("role", "content"), roles=("user", "assistant")), "f:1")
    assert a == b == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"},
                      {"role": "assistant", "content": "x"}]
    with pytest.raises(sft.SFTDataError, match="f:3.*role 'robot'"):
        sft.normalize_conversation({"conversations": [{"from": "robot", "value": "x"}]}, "f:3")
    with pytest.raises(sft.SFTDataError, match="no assistant"):
        sft.normalize_conversation({"conversations": [{"from": "human", "value": "x"}]}, "f:4")
    with pytest.raises(sft.SFTDataError, match="non-empty"):
        sft.normalize_conversation({"conversations": []}, "f:5")


def test_written_results_are_spliced_like_the_rollout(chat):
    protocol = chat.protocol([])
    text = "<python>print(6*7)</python>" + RESULT_TEXT + " So <answer>42</answer>"
    ids, mask, blocks = protocol.encode_written_response(text)
    assert blocks == 1
    head = protocol.encode_text("<python>print(6*7)</python>")
    assert ids[:len(head)] == head and mask[:len(head)] == [1] * len(head)
    block = protocol.encode_result("42")
    assert ids[len(head):len(head) + len(block)] == block and not any(mask[len(head):len(head) + len(block)])
    assert protocol.tokenizer.decode(ids) == text
    # Another layout of the same result is re-spliced in the rollout's layout.
    other, _, _ = protocol.encode_written_response("<python>print(6*7)</python>\n<result>\n42\n</result> So <answer>42</answer>")
    assert other == ids
    ids, mask, _ = protocol.encode_written_response("a <result>\nno end")
    assert protocol.tokenizer.decode(ids) == "a <result>\nno end" and mask[0] == 1 and mask[-1] == 0


def test_prompt_tokens_match_chat_template_and_mask_is_assistant_only(tokenizer, chat):
    answer = "<think>t</think><python>print(6*7)</python>" + RESULT_TEXT + "<answer>\\boxed{42}</answer>"
    messages = sft.normalize_conversation(_row(answer), "row")
    ex, counts = sft.tokenize_conversation(chat, messages, 4096)
    assert counts == {"result_spans": 1, "prefix_stripped": 0}
    prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ex.input_ids[:len(prompt_ids)] == prompt_ids == chat.render(messages[:2])
    assert not any(ex.loss_mask[:len(prompt_ids)])
    # The trained tokens decode to the assistant text without the tool result, plus <|im_end|>.
    trained = [t for t, m in zip(ex.input_ids, ex.loss_mask) if m]
    assert tokenizer.decode(trained) == answer.replace(RESULT_TEXT, "") + "<|im_end|>"
    # The masked tool result is the block the rollout splices for that payload.
    masked_after_prompt = [t for t, m in zip(ex.input_ids[len(prompt_ids):], ex.loss_mask[len(prompt_ids):]) if not m]
    assert masked_after_prompt == chat.protocol([]).encode_result("42") + tokenizer.encode("\n", add_special_tokens=False)
    assert ex.input_ids[-2] == tokenizer.convert_tokens_to_ids("<|im_end|>") and ex.loss_mask[-2] == 1


def test_tool_turn_and_multi_turn(tokenizer, chat):
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a1"},
                             {"from": "observation", "value": "obs"}, {"from": "gpt", "value": "a2"}]}
    ex, _ = sft.tokenize_conversation(chat, sft.normalize_conversation(row, "r"), 4096)
    trained = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert trained == "a1<|im_end|>a2<|im_end|>"
    # The tool turn is rendered by the checkpoint's own template (the tiny one writes a plain tool turn; the
    # published Qwen templates' merged <tool_response> turns: tests/unit/test_sft_templates.py).
    assert tokenizer.decode(ex.input_ids) == tokenizer.apply_chat_template(
        sft.normalize_conversation(row, "r"), tokenize=False)
    assert "<|im_start|>tool\nobs<|im_end|>" in tokenizer.decode(ex.input_ids)
    with pytest.raises(sft.SFTDataError, match="starts with an assistant turn"):
        sft.tokenize_conversation(chat, [{"role": "assistant", "content": "x"}], 64)


def test_load_files_truncation_and_drop(chat, tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(_row("short answer")) for _ in range(2)) + "\n")
    js = tmp_path / "b.json"
    js.write_text(json.dumps([_row("x " * 200, system=None)]))
    examples, stats = sft.load_sft_examples([jsonl, js], chat, max_tokens=40)
    assert stats.rows == 3 and stats.kept == 3 and stats.truncated == 1
    assert all(len(e.input_ids) <= 40 and len(e.input_ids) == len(e.loss_mask) for e in examples)
    long_system = tmp_path / "c.jsonl"
    long_system.write_text(json.dumps(_row("answer", system="word " * 100)) + "\n")
    with pytest.raises(sft.SFTDataError, match="no usable"):
        sft.load_sft_examples([long_system], chat, max_tokens=20)
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"conversations": [\n')
    with pytest.raises(sft.SFTDataError, match="d.jsonl:1: invalid JSON"):
        sft.load_sft_examples([bad], chat, max_tokens=20)
    txt = tmp_path / "e.txt"
    txt.write_text("")
    with pytest.raises(sft.SFTDataError, match="cannot tell the format"):
        sft.load_sft_examples([txt], chat, max_tokens=20)
