"""`eval` on ARPO-schema parquet files (gaia_test / hle_test, built here): ``--datasets`` takes the files,
no data dir is needed, and each question is rendered with the row's own system prompt, not the default;
rows without one get ``data.system_prompt`` (a built-in name such as ``arpo``, or the text).

The generator records the prompt the checkpoint's chat template renders (what the engine would get) and
answers with a fixed boxed answer; everything else (CLI settings, loading, scoring, results) is real.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from evaluation.cli import build_parser, prepare
from evaluation.runner import Generation, run_evaluation
from megatron_arpo.data.system_prompts import ARPO_SYSTEM_PROMPT, DEFAULT_SYSTEM_PROMPT
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

# ARPO's shipped rows: the system prompt with "\boxed" corrupted into a backspace + "oxed" (Q13).
ROW_SYSTEM = ARPO_SYSTEM_PROMPT.replace("\\boxed", "\x08oxed")


def arpo_rows(source: str, questions: list[tuple[str, str]]) -> list[dict]:
    return [{"data_source": source,
             "prompt": [{"role": "system", "content": ROW_SYSTEM}, {"role": "user", "content": q}],
             "ability": None, "reward_model": {"ground_truth": a, "style": "rule"},
             "extra_info": {"index": i, "question": q, "split": "test"}, "metadata": None}
            for i, (q, a) in enumerate(questions)]


class RecordingGenerator:
    """Renders the prompt with the checkpoint's chat format and answers ``\\boxed{6}``."""

    def __init__(self, chat):
        self.chat = chat
        self.prompts: dict[str, str] = {}

    async def generate(self, sample, run, messages):
        self.prompts[f"{sample.dataset}/{sample.sample_id}"] = self.chat.tokenizer.decode(self.chat.render(messages))
        return Generation(trajectory={}, response_text="<answer>\\boxed{6}</answer>", finish_reason="stop",
                          num_response_tokens=3, tool_calls=[])


def _run(argv: list[str]) -> tuple[dict, RecordingGenerator]:
    settings, engine, _ = prepare(build_parser().parse_args(argv))
    generator = RecordingGenerator(engine.chat)
    return asyncio.run(run_evaluation(settings, generator)), generator


def test_eval_on_arpo_parquet_uses_the_rows_prompt(tmp_path):
    gaia, hle = tmp_path / "gaia_test.parquet", tmp_path / "hle_test.parquet"
    pq.write_table(pa.Table.from_pylist(arpo_rows("DR_gaia", [("How many legs has a spider?", "8"),
                                                              ("Sides of a hexagon?", "6")])), gaia)
    pq.write_table(pa.Table.from_pylist(arpo_rows("DR_hle_100", [("Faces of a cube?", "6")])), hle)
    model = str(tiny_checkpoint("tiny-qwen3"))
    results, gen = _run(["--model", model, "--datasets", f"{gaia},{hle}:qa", "--out", str(tmp_path / "out"),
                         "--greedy", "--no-python"])
    assert set(results["datasets"]) == {"gaia_test", "hle_test"}
    assert results["datasets"]["gaia_test"]["num_samples"] == 2
    assert len(gen.prompts) == 3
    for prompt in gen.prompts.values():
        # The row's system prompt, with its \boxed repaired as in training; not the project default.
        assert ARPO_SYSTEM_PROMPT in prompt and DEFAULT_SYSTEM_PROMPT not in prompt and "\x08" not in prompt
    assert "How many legs has a spider?" in gen.prompts["gaia_test/0"]
    records = [json.loads(line) for line in (tmp_path / "out" / "gaia_test" / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["metrics"]["em"] for r in records) == [0.0, 1.0]   # "6" is right for the hexagon only


def test_rows_without_a_system_prompt_get_the_named_builtin(tmp_path):
    data = tmp_path / "mydata.jsonl"
    data.write_text(json.dumps({"question": "Sides of a hexagon?", "answer": 6}) + "\n")
    config = tmp_path / "eval.yaml"
    config.write_text("name: t\nmodel:\n  config: tiny-qwen3\ndata:\n  system_prompt: arpo\n  max_prompt_tokens: 512\n"
                      "rollout:\n  response_length: 512\ntools:\n  search:\n    enabled: false\n")
    model = str(tiny_checkpoint("tiny-qwen3"))
    results, gen = _run(["--model", model, "--config", str(config), "--datasets", f"{data}:qa",
                         "--out", str(tmp_path / "out"), "--greedy", "--no-python"])
    (prompt,) = gen.prompts.values()
    assert ARPO_SYSTEM_PROMPT in prompt and DEFAULT_SYSTEM_PROMPT not in prompt
    assert results["datasets"]["mydata"]["num_samples"] == 1
    assert results["settings"]["system_prompt"] == ARPO_SYSTEM_PROMPT


def test_enforce_eager_flag_reaches_the_engine_config(tmp_path):
    from megatron_arpo.rollout.engine import EngineConfig

    data = tmp_path / "mydata.jsonl"
    data.write_text(json.dumps({"question": "Sides of a hexagon?", "answer": 6}) + "\n")
    base = ["--model", str(tiny_checkpoint("tiny-qwen3")), "--datasets", f"{data}:qa", "--out", str(tmp_path / "o")]
    for extra, eager in (([], False), (["--enforce-eager"], True)):
        _, engine, _ = prepare(build_parser().parse_args(base + extra))
        assert EngineConfig.from_rollout_section(engine.model_dir, engine.rollout_section).enforce_eager is eager
