"""The rollout of a seed before and after issue 30 (top-k log-probs only where a decision reads them).

``data/rollout_before_issue30.json`` was recorded with the scheduler as it was before the change (commit
c1d4e71: every non-probe segment asked for top-k in one request). The scripted policy samples from the
request's seed, so a request split differently changes the tokens, as vLLM's per-request generator does.
The same scenarios now must give the same trajectories: tokens, sampled log-probs, loss masks, tool calls,
branch decisions (entropies, draws, scores) and AEPO's pre-monitoring. Regenerate (only with the code
before the change): ``python tests/unit/test_rollout_before_after.py --record``.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler
from megatron_arpo.tools.base import ToolExecutor
from support.rollout_record import load_record, record_differences, rollout_record, save_record
from support.scripted import ScriptedEngine, ScriptedStep

sys.path.insert(0, str(Path(__file__).parent))
from scheduler_helpers import CODEC, PROMPT, RESULT, ScriptedSearch, run  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "rollout_before_issue30.json"
WINDOW = 8
SCENARIOS = {
    "arpo-after_result": dict(branch_timing="after_result"),
    "arpo-reference": dict(branch_timing="reference"),
    "aepo-premonitoring": dict(variant="aepo", branch_threshold=0.4, dynamic_initial_rollouts=True,
                               initial_entropy_tokens=12),
    "grpo": dict(initial_rollouts=6),
}


def seeded_script(context, request):
    """Segments of 9 to 40 tokens (mostly longer than the window) drawn from the request's seed; the top-k
    table of each position depends on the seed too, so every entropy is specific to its request."""
    rnd = random.Random(request.seed)
    body = "".join(rnd.choice("abcdefgh ") for _ in range(rnd.randint(4, 30)))
    if context.count(RESULT) < 3 and rnd.random() < 0.75:
        text = f"<think>{body}</think><search>{body[:6]}</search>"
    else:
        text = f"<think>{body}</think><answer>\\boxed{{{rnd.randint(0, 9)}}}</answer><EOS>"
    tables = []
    for _ in text:
        p = rnd.uniform(0.3, 0.99)
        tables.append({1000: math.log(p), 1001: math.log((1 - p) * 0.7), 1002: math.log((1 - p) * 0.3)})
    return ScriptedStep(CODEC.encode(text), tables)


def scenario_rollout(name: str):
    engine = ScriptedEngine(seeded_script)
    executor = ToolExecutor([ScriptedSearch(latency=lambda q: 0.001 * (len(q) % 3))], timeout_s=10, retries=0)
    protocol = TagProtocol(CODEC, ["search", "python"], vocab_size=98)
    options = dict(n=6, initial_rollouts=2, beam_size=3, branch_threshold=0.5, entropy_weight=0.3,
                   entropy_window=WINDOW, call_limit=3, response_length=300, seed=11)
    options.update(SCENARIOS[name])
    scheduler = RolloutScheduler(RolloutGroup([engine]), executor, protocol, RolloutOptions(**options))
    result = run(scheduler, [RolloutPrompt("p", PROMPT), RolloutPrompt("q", CODEC.encode("Q2: which?"))])
    return result, engine


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_rollout_of_a_seed_is_unchanged(name):
    result, _ = scenario_rollout(name)
    before = load_record(GOLDEN)[name]
    assert sum(len(t["decisions"]) for t in before["trajectories"]) >= (0 if name == "grpo" else 3)
    assert record_differences(before, rollout_record(result)) == []


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    save_record(GOLDEN, {name: rollout_record(scenario_rollout(name)[0]) for name in SCENARIOS})
    print(f"wrote {GOLDEN}")
