"""One table of accepted row shapes, fed to the three loaders that share megatron_arpo/data/fields.py:
the RL loader (megatron_arpo.data.datasets), the evaluation loader (evaluation.datasets) and the SFT
loader (megatron_arpo.data.sft). Each shape resolves to the same prompt and answer everywhere (SFT: the
prompt plus the answer as the assistant turn), or is refused with a message naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evaluation.datasets import DatasetError as EvalDatasetError
from evaluation.datasets import load_dataset, resolve_dataset
from evaluation.runner import build_messages
from megatron_arpo.data.datasets import DatasetError, load_prompts
from megatron_arpo.data.fields import FieldKeys
from megatron_arpo.data.sft import SFTDataError, iter_conversations

SYS = "Configured system prompt."


def user(text):
    return {"role": "user", "content": text}


def system(text):
    return {"role": "system", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# (id, row, file format, keys, expected prompt (None = refused by RL and eval), expected gold,
#  expected SFT conversation or the error it raises)
CASES = [
    ("question/answer", {"question": "Q?", "answer": "A"}, "jsonl", FieldKeys(),
     [user("Q?")], "A", [user("Q?"), assistant("A")]),
    ("question/answer parquet", {"question": "Q?", "answer": "A"}, "parquet", FieldKeys(),
     [user("Q?")], "A", [user("Q?"), assistant("A")]),
    ("GAIA Question/Final answer", {"task_id": "t1", "Question": "Q?", "Final answer": "A"}, "jsonl", FieldKeys(),
     [user("Q?")], "A", [user("Q?"), assistant("A")]),
    ("MATH problem", {"problem": "Q?", "answer": "A"}, "jsonl", FieldKeys(),
     [user("Q?")], "A", [user("Q?"), assistant("A")]),
    ("FlashRAG golden_answers", {"question": "Q?", "golden_answers": ["A", "B"]}, "jsonl", FieldKeys(),
     [user("Q?")], ["A", "B"], "one non-empty string"),
    ("number answer", {"question": "Q?", "answer": 42}, "jsonl", FieldKeys(),
     [user("Q?")], "42", [user("Q?"), assistant("42")]),
    ("query/ground_truth", {"query": "Q?", "ground_truth": "A"}, "jsonl", FieldKeys(),
     [user("Q?")], "A", [user("Q?"), assistant("A")]),
    ("row's own system", {"question": "Q?", "answer": "A", "system": "Own."}, "jsonl", FieldKeys(),
     [system("Own."), user("Q?")], "A", [system("Own."), user("Q?"), assistant("A")]),
    ("alpaca", {"instruction": "Add.", "input": "2 and 3", "output": "5"}, "jsonl", FieldKeys(),
     [user("Add.\n2 and 3")], "5", [user("Add.\n2 and 3"), assistant("5")]),
    ("alpaca with history and system", {"instruction": "And 4?", "output": "9", "system": "Own.",
                                        "history": [["Add 2 and 3.", "5"]]}, "jsonl", FieldKeys(),
     [system("Own."), user("Add 2 and 3."), assistant("5"), user("And 4?")], "9",
     [system("Own."), user("Add 2 and 3."), assistant("5"), user("And 4?"), assistant("9")]),
    ("ARPO parquet", {"data_source": "DR_gaia", "prompt": [system("Think \x08oxed{}."), user("Q?")], "ability": "qa",
                      "reward_model": {"ground_truth": "A", "style": "rule"}, "extra_info": {"index": 3}}, "parquet",
     FieldKeys(), [system("Think \\boxed{}."), user("Q?")], "A",
     [system("Think \\boxed{}."), user("Q?"), assistant("A")]),
    ("prompt_key / dotted answer_key", {"q": "Q?", "gold": {"text": "A"}}, "jsonl",
     FieldKeys(prompt_key="q", answer_key="gold.text"), [user("Q?")], "A", [user("Q?"), assistant("A")]),
    ("ShareGPT conversation", {"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A"}],
                               "system": "Own."}, "jsonl", FieldKeys(),
     None, None, [system("Own."), user("Q?"), assistant("A")]),
    ("OpenAI messages with a tool turn", {"messages": [user("Q?"), assistant("Let me run it."),
                                                       {"role": "tool", "content": "out"}, assistant("A")]},
     "jsonl", FieldKeys(), None, None,
     [user("Q?"), assistant("Let me run it."), {"role": "tool", "content": "out"}, assistant("A")]),
    ("LLaMA-Factory function_call / observation",
     {"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "I search."},
                        {"from": "function_call", "value": json.dumps({"name": "search", "arguments": {"query": "q1"}})},
                        {"from": "observation", "value": "r1"},
                        {"from": "function_call", "value": json.dumps({"name": "python", "arguments": {"code": "1+1"}})},
                        {"from": "observation", "value": "2"},
                        {"from": "gpt", "value": " <answer>A</answer>"}]}, "jsonl", FieldKeys(), None, None,
     [user("Q?"), assistant("I search.<search>q1</search> <result>\nr1\n</result><python>1+1</python> <result>\n2\n"
                            "</result> <answer>A</answer>")]),
]


def _write(tmp_path: Path, row: dict, fmt: str) -> Path:
    path = tmp_path / f"rows.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist([row]), path)
    else:
        path.write_text(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("name, row, fmt, keys, prompt, gold, conversation", CASES, ids=[c[0] for c in CASES])
def test_every_row_shape_in_every_loader(tmp_path, name, row, fmt, keys, prompt, gold, conversation):
    path = _write(tmp_path, row, fmt)
    spec = resolve_dataset(f"{path}:qa")
    if prompt is None:
        with pytest.raises(DatasetError, match="SFT data"):
            load_prompts(path, system_prompt=SYS, prompt_key=keys.prompt_key, answer_key=keys.answer_key)
        with pytest.raises(EvalDatasetError, match="SFT data"):
            load_dataset(spec, None, keys=keys)
    else:
        expected = prompt if prompt[0]["role"] == "system" else [system(SYS)] + prompt
        (record,), _ = load_prompts(path, system_prompt=SYS, prompt_key=keys.prompt_key, answer_key=keys.answer_key)
        assert list(record.messages) == expected and record.ground_truth == gold
        (sample,) = load_dataset(spec, None, keys=keys)
        assert build_messages(sample, SYS) == expected and sample.gold == gold
        assert sample.question == prompt[-1]["content"]
    if isinstance(conversation, str):
        with pytest.raises(SFTDataError, match=conversation):
            list(iter_conversations([path], keys=keys))
    else:
        (messages,) = iter_conversations([path], keys=keys)
        assert messages == conversation


@pytest.mark.parametrize("fmt, suffix, match", [
    ("jsonl", "parquet", "data.format is jsonl but .* is a parquet file .*set data.format: parquet"),
    ("auto", "jsonl", "ends in .jsonl but holds parquet data .*rename it to .parquet"),
    ("parquet", "jsonl", "data.format is parquet but .* holds JSON text.*set data.format: jsonl"),
])
def test_format_and_suffix_mismatch_is_named(tmp_path, fmt, suffix, match):
    path = tmp_path / f"rows.{suffix}"
    if fmt == "parquet":
        path.write_text(json.dumps({"question": "Q?", "answer": "A"}) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist([{"question": "Q?", "answer": "A"}]), path)
    with pytest.raises(DatasetError, match=match):
        load_prompts(path, fmt=fmt)
    with pytest.raises(SFTDataError, match=match):
        list(iter_conversations([path], fmt=fmt))
    if fmt == "auto":
        with pytest.raises(EvalDatasetError, match=match):
            load_dataset(resolve_dataset(f"{path}:qa"), None)


def test_missing_fields_name_the_keys_to_set(tmp_path):
    path = _write(tmp_path, {"text": "Q?", "label": "A"}, "jsonl")
    with pytest.raises(DatasetError, match="no question.*data.prompt_key"):
        load_prompts(path)
    with pytest.raises(DatasetError, match="no field 'body' \\(data.prompt_key\\)"):
        load_prompts(path, prompt_key="body")
    with pytest.raises(DatasetError, match="no gold answer.*data.answer_key"):
        load_prompts(path, prompt_key="text")
    (record,), _ = load_prompts(path, prompt_key="text", answer_key="label")
    assert record.ground_truth == "A"
