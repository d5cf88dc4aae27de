"""Datasets (ARPO parquet, JSONL) and the checkpointable sampler."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_arpo.data.datasets import DatasetError, load_prompt_files, load_prompts, filter_by_length
from megatron_arpo.data.sampler import EpochSampler

CORRUPT_SYSTEM = "Think first. Put the answer in \x08oxed{answer here} as \x08oxed{}."


def _row(i, question="What is 2+2?", truth="4"):
    return {
        "data_source": "DR_grpo_mix",
        "prompt": [{"role": "system", "content": CORRUPT_SYSTEM}, {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"index": i, "question": question, "split": "train"},
        "metadata": None,
    }


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_arpo_parquet_loads_and_repairs_boxed(tmp_path):
    path = tmp_path / "train.parquet"
    _write_parquet(path, [_row(i) for i in range(3)])
    records, stats = load_prompts(path)
    assert [r.uid for r in records] == ["DR_grpo_mix-0", "DR_grpo_mix-1", "DR_grpo_mix-2"]
    system = records[0].messages[0]["content"]
    assert "\x08" not in system and system.count("\\boxed{") == 2
    assert stats.repaired_boxed == 3 and stats.rows == 3 and stats.loaded == 3
    assert records[0].ground_truth == "4" and records[0].question == "What is 2+2?"
    assert records[0].ability == "math"


def test_corrupt_parquet_row_names_file_and_row(tmp_path):
    rows = [_row(0), _row(1), _row(2)]
    rows[1]["reward_model"] = {"ground_truth": "", "style": "rule"}
    path = tmp_path / "bad.parquet"
    _write_parquet(path, rows)
    with pytest.raises(DatasetError, match=r"bad\.parquet row 2: reward_model\.ground_truth is empty.*on_bad_row: skip"):
        load_prompts(path)
    records, stats = load_prompts(path, on_bad_row="skip")
    assert len(records) == 2 and stats.skipped_bad == 1


def test_parquet_prompt_must_end_with_user(tmp_path):
    row = _row(0)
    row["prompt"] = [{"role": "system", "content": "s"}]
    path = tmp_path / "p.parquet"
    _write_parquet(path, [row, _row(1)])
    with pytest.raises(DatasetError, match="row 1: the last prompt message must be the user"):
        load_prompts(path)


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match="not a readable parquet file"):
        load_prompts(path)


def test_jsonl_rows_and_bad_lines(tmp_path):
    path = tmp_path / "qa.jsonl"
    lines = [json.dumps({"question": "Capital of France?", "answer": "Paris"}), "{not json",
             json.dumps({"question": "", "answer": "x"}), json.dumps({"question": "1+1?", "answer": 2})]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"qa\.jsonl row 2: invalid JSON"):
        load_prompts(path)
    records, stats = load_prompts(path, on_bad_row="skip", system_prompt="SYS")
    # A number is written as a string for the built-in rewards (the evaluation loader does the same).
    assert stats.skipped_bad == 2 and [r.ground_truth for r in records] == ["Paris", "2"]
    assert records[0].messages[0] == {"role": "system", "content": "SYS"}
    assert records[0].data_source == "qa"
    records, stats = load_prompts(path, on_bad_row="skip", strict_answers=False)  # a custom reward's choice
    assert stats.skipped_bad == 2 and [r.ground_truth for r in records] == ["Paris", 2]
    (tmp_path / "empty.jsonl").write_text(json.dumps({"question": "q", "answer": []}) + "\n")
    with pytest.raises(DatasetError, match="'answer' is \\[\\] \\(list\\)"):
        load_prompts(tmp_path / "empty.jsonl")


def test_missing_file_and_duplicate_ids(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    _write_parquet(a, [_row(0)])
    _write_parquet(b, [_row(0)])
    records, _ = load_prompt_files([a, b])
    assert len({r.uid for r in records}) == 2


def test_length_filter_counts(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": "a"}) for i in range(3)))
    records, _ = load_prompts(path)
    keep, dropped = filter_by_length(records, [[1] * 5, [1] * 50, [1] * 10], max_prompt_tokens=10)
    assert keep == [0, 2] and dropped == 1
    with pytest.raises(DatasetError, match="raise the limit"):
        filter_by_length(records, [[1] * 50] * 3, max_prompt_tokens=10)


def test_sampler_covers_each_epoch_exactly_once_across_boundary():
    s = EpochSampler(num_items=10, batch_size=4, seed=3)
    batches = [s.next_batch() for _ in range(5)]  # 20 items = 2 epochs exactly
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new permutation per epoch
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 0


def test_sampler_resume_mid_epoch_continues_with_next_prompt():
    full = EpochSampler(num_items=7, batch_size=3, seed=11)
    expected = [full.next_batch() for _ in range(6)]
    first = EpochSampler(num_items=7, batch_size=3, seed=11)
    got = [first.next_batch() for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = EpochSampler(num_items=7, batch_size=3, seed=11)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(4)]
    assert got == expected


def test_sampler_rejects_state_for_other_dataset():
    s = EpochSampler(num_items=7, batch_size=3, seed=1)
    with pytest.raises(ValueError, match="saved for 8 prompts"):
        s.load_state_dict({"epoch": 0, "position": 1, "num_items": 8, "seed": 1})


def test_named_system_prompts_and_the_rows_own(tmp_path):
    from megatron_arpo.config import load_config
    from megatron_arpo.data.system_prompts import ARPO_SYSTEM_PROMPT, DEFAULT_SYSTEM_PROMPT
    from megatron_arpo.errors import InputError

    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n"
                    + json.dumps({"question": "q2?", "answer": "b", "system": "Own prompt."}) + "\n")
    for name, text in (("arpo", ARPO_SYSTEM_PROMPT), ("default", DEFAULT_SYSTEM_PROMPT), ("Literal text.", "Literal text.")):
        records, _ = load_prompts(path, system_prompt=name)
        assert records[0].messages[0] == {"role": "system", "content": text}
        assert records[1].messages[0] == {"role": "system", "content": "Own prompt."}
    with pytest.raises(InputError, match="'arp0' is not a built-in prompt \\(default, arpo, none\\)"):
        load_prompts(path, system_prompt="arp0")
    records, _ = load_prompts(path, system_prompt="none")
    assert [m["role"] for m in records[0].messages] == ["user"]
    assert "\\boxed{answer here}" in ARPO_SYSTEM_PROMPT and "\x08" not in ARPO_SYSTEM_PROMPT
    for recipe in ("qwq-32b-arpo-deepsearch", "qwen3-32b-arpo-reasoning"):
        cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / f"{recipe}.yaml")
        assert cfg.data.system_prompt == "arpo"
