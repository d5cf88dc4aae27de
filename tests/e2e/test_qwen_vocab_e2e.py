"""Published-checkpoint layout end to end: `sft`, two `train` steps and `eval` on the real-vocabulary tiny
Qwen3 and QwQ-style checkpoints (the real Qwen BPE tokenizer: tags are several tokens, the chat template
is the release's, QwQ's generation prompt opens ``<think>``, EOS ids come from generation_config.json),
with the python sandbox and BM25 search on.

Each stage is a CLI subprocess as a user runs it. QwQ runs the whole chain: SFT from the tiny checkpoint
(2 steps, its ``<think>`` prefixes stripped) -> ARPO from the SFT export (2 steps, Megatron actor + vLLM
engine on the shared 2-raylet Ray cluster, validation at step 2) -> evaluation of the trained export (the
responses open with the prefix). Qwen3 has no response prefix, so its SFT and evaluation would repeat
QwQ's; it runs the ARPO stage only, from the tiny checkpoint, for the Qwen3 family's actor and engine on
the real vocabulary. The rollout's kept tokens re-scored by the actor match the engine's log-probs within
the tolerance of tests/e2e/test_train_e2e.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from train_helpers import CONFIG, REPO, log_tail, read_rows, run_train, train_command, train_env, write_task  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MODELS = {"qwen3": ("tiny-qwen3-qwen-vocab", "qwen3_checkpoint", ""),
          "qwq": ("tiny-qwq-qwen-vocab", "qwq_checkpoint", "<think>\n")}
SYSTEM = "Think, use <search> or <python> if needed, answer in <answer>\\boxed{}</answer>."  # test-e2e.yaml's
# The sizes that keep a 152k-row LM head cheap on 2 cores (the logits dominate every step).
LEAN = ["actor.tensor_parallel=1", "actor.micro_batch_tokens=512", "rollout.response_length=48", "trainer.save_every=0",
        "rollout.logprobs_topk=2", "logging.wandb.mode=disabled"]


def sft_rows() -> list[dict]:
    """Written as a thinking model writes them: the answer opens with <think> (QwQ's prompt already holds it)."""
    rows = []
    for a, b in ((2, 3), (4, 5), (6, 7), (8, 9)):
        rows.append({"system": SYSTEM, "conversations": [
            {"from": "human", "value": f"What is {a} + {b}?"},
            {"from": "gpt", "value": f"<think>\nUse python.</think><python>print({a}+{b})</python> <result>\n{a + b}\n"
                                     f"</result><answer>\\boxed{{{a + b}}}</answer>"}]})
        rows.append({"system": SYSTEM, "conversations": [
            {"from": "human", "value": f"Who founded town {a}{b}?"},
            {"from": "gpt", "value": f"<think>\nSearch it.</think><search>founder of town {a}{b}</search> <result>\n"
                                     f"Town {a}{b} was founded by Ada.\n</result><answer>\\boxed{{Ada}}</answer>"}]})
    return rows


def run_cli(args: list[str], log: Path, env: dict, timeout: float) -> None:
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "megatron_arpo", *args], cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args[:1])} exited {proc.returncode}\n{log_tail(log)}"


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.mark.parametrize("flavour", sorted(MODELS))
def test_sft_train_eval_on_the_real_qwen_tokenizer(flavour, request, _ray_two_node_cluster, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    from megatron_arpo.data.chat import load_chat_format

    config_name, fixture, prefix = MODELS[flavour]
    full_chain = bool(prefix)  # QwQ: SFT -> train -> eval; Qwen3 (no prefix): train from the tiny checkpoint
    ckpt = request.getfixturevalue(fixture)
    data = write_task(tmp_path)
    env = train_env(data)
    common = [f"model.config={config_name}", *LEAN]

    start = ckpt
    if full_chain:
        # 1. SFT from the tiny checkpoint: 8 conversations, 2 steps, HF export.
        sft_file = tmp_path / "sft.jsonl"
        sft_file.write_text("".join(json.dumps(r) + "\n" for r in sft_rows()))
        sft_dir = tmp_path / "sft"
        run_cli(["sft", "--config", str(CONFIG), *sets(*common, f"model.hf_checkpoint={ckpt}",
                                                       f"sft.train_files=[{sft_file}]", "sft.epochs=1",
                                                       "sft.global_batch_size=4", "sft.lr=1e-3",
                                                       f"sft.output_dir={sft_dir}",
                                                       f"trainer.run_dir={tmp_path / 'sft-run'}")],
                tmp_path / "sft.log", env, timeout=600)
        text = (tmp_path / "sft.log").read_text()
        assert "8 tool results masked" in text and "8 thinking prefixes stripped" in text
        start = sft_dir / "hf"
    tok = AutoTokenizer.from_pretrained(str(start))
    assert len(tok) == 151669 and load_chat_format(tok, start).response_prefix == prefix

    # 2. Two ARPO steps, python and search on.
    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    cmd = train_command(str(start), data, run_dir, *common, "trainer.placement=colocated")
    run_train(cmd, data, log, _ray_two_node_cluster.address, timeout=900)
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert "tools/python/calls_per_traj" in row and "tools/search/calls_per_traj" in row
        # The kept tokens re-scored by the actor: the engine's log-probs (step 2 runs on synced weights).
        assert row["rollout/logprob_abs_diff"] < 1e-3, row["rollout/logprob_abs_diff"]
    assert "val/reward" in rows[1]
    if not full_chain:
        return

    # 3. Evaluation of the trained policy with both tools.
    out_dir = tmp_path / "eval"
    run_cli(["eval", "--config", str(CONFIG), *sets(*common), "--model",
             str(run_dir / "hf"), "--datasets", "gsm8k,hotpotqa", "--data-dir", str(REPO / "evaluation/data/mini"),
             "--max-samples", "2", "--greedy", "--out", str(out_dir)], tmp_path / "eval.log", env, timeout=600)
    results = json.loads((out_dir / "results.json").read_text())
    assert set(results["datasets"]) == {"gsm8k", "hotpotqa"}
    assert results["settings"]["python_tool"] and results["settings"]["search_tool"]
    for name in ("gsm8k", "hotpotqa"):
        for line in (out_dir / name / "samples.jsonl").read_text().splitlines():
            record = json.loads(line)
            assert record["response_text"].startswith(prefix)  # what the reward read
