"""docs/metrics.md explains every key the trainer writes to metrics.jsonl.

Three sources of keys are checked against ``METRIC_KEYS`` (megatron_arpo/trainer/metrics.py), and every
entry of that list against the page: the rows of a real demo run (tests/support/demo_metrics.jsonl: the
actor's update keys come from Megatron ranks, which a unit test cannot start), a row built by the trainer's
own metric functions on small records (every optional key switched on), and the key literals in the
trainer's source (a key added anywhere in the loop shows up here before any run)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from megatron_arpo.trainer import metrics as m
from megatron_arpo.trainer.signals import LeadTimeAdvisor

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "metrics.md").read_text()
FIXTURE = ROOT / "tests" / "support" / "demo_metrics.jsonl"
FAMILIES = ("reward", "val", "rollout", "tools", "actor", "sync", "time", "phase", "preempt", "data", "train",
            "offpolicy")


def _undocumented(keys) -> list[str]:
    return sorted(k for k in keys if m.metric_pattern(k) is None)


def test_every_listed_key_is_explained_on_the_page():
    documented = set(re.findall(r"`([^`\s]+)`", DOC))
    missing = [key for key in m.METRIC_KEYS if key not in documented]
    assert not missing, f"add these keys to docs/metrics.md (meaning and healthy values): {missing}"
    table_keys = {k for k in documented if k.split("/")[0] in FAMILIES and "/" in k} | {"step"}
    stale = sorted(k for k in table_keys if m.metric_pattern(k) is None and not k.endswith(("/", "/*")))
    assert not stale, f"docs/metrics.md explains keys the trainer no longer writes: {stale}"


def test_a_real_runs_keys_are_all_listed():
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    keys = {k for r in rows for k in r}
    assert len(keys) > 80
    assert _undocumented(keys) == []


def _traj(pid: str, reward: float, tool_calls: int = 1):
    call = SimpleNamespace(tool="search", owner="t", error=None, result_offset=1, num_result_tokens=2)
    seg = SimpleNamespace(owner="t", index=0, entropy=0.7)
    return SimpleNamespace(prompt_id=pid, reward=reward, response_ids=[1, 2, 3, 4, 5, 6], traj_id="t", origin="init",
                           segments=[seg, SimpleNamespace(owner="t", index=1, entropy=0.9)],
                           finish_reason="stop", tool_calls=[call] * tool_calls, prompt_token_ids=[9, 9],
                           loss_mask=[1, 0, 0, 1, 1, 1], response_logprobs=[-0.5] * 6, call_limit_hit=False)


def test_the_trainers_metric_functions_emit_listed_keys_only():
    trajs = [_traj("0:a", 1.0), _traj("0:a", -1.0), _traj("1:b", 0.3, 2)]
    result = SimpleNamespace(trajectories=lambda: trajs, groups=[trajs[:2], trajs[2:]],
                             stats={"branches": 2, "fills": 1, "generated_tokens": 18, "engine_prompt_tokens": 10,
                                    "engine_cached_tokens": 4, "tool_errors": 0, "call_limit_hits": 0})
    sources = {"0:a": "hotpotqa", "1:b": "gaia"}
    batch = {"old_logprobs": [[-0.4] * 8] * 3, "entropy": [[1.0] * 8] * 3, "ref_logprobs": [[-0.6] * 8] * 3}
    counters = {"calls": 3, "errors": 1, "timeouts": 0, "cache_hits": 1}
    timer = m.PhaseTimer()
    for phase in ("rollout", "reward", "advantage", "logprob", "ref_logprob", "update", "sync", "validate"):
        with timer(phase):
            pass
    update_keys = ("loss", "pg_loss", "kl_loss", "clip_frac", "approx_kl", "grad_norm", "lr", "tokens_per_s")
    row = {"step": 1, **m.reward_metrics(trajs, sources), **m.validation_metrics(trajs, sources),
           **m.rollout_metrics(result, 2.0),
           **m.tool_metrics(trajs, result.stats, {"search": {}, "cache": {"hits": 0, "misses": 0}},
                            {"search": counters, "cache": {"hits": 2, "inflight_hits": 1, "misses": 3}}, ["search"]),
           **m.token_statistics(batch, trajs, entropy_window=2),
           **m.actor_metrics(dict.fromkeys(update_keys, 0.1), 0.05),
           **m.sync_metrics({"seconds": 1.0, "send_s": 0.8, "bytes": 1e9, "buckets": 4, "driver_bytes": 500,
                             "driver_weight_bytes": 0, "verified_after_load": ["a"]}),
           **timer.metrics(), **LeadTimeAdvisor(60).observe(timer.seconds),
           **m.data_metrics(["a", "b"], {"epoch": 0, "position": 2})}
    for expected in ("reward/gaia/accuracy", "val/hotpotqa/reward", "tools/search/cache_hits", "actor/ref_kl",
                     "tools/cache_hit_rate", "time/ref_logprob_s", "sync/verified", "preempt/needed_lead_s"):
        assert expected in row, expected
    assert _undocumented(row) == []


def test_key_literals_in_the_trainer_source_are_listed():
    """``"family/name"`` literals and f-string keys (``{x}`` a placeholder) in the loop, its phases and metrics."""
    sources = [ROOT / "megatron_arpo" / "train.py", *sorted((ROOT / "megatron_arpo" / "trainer").glob("*.py"))]
    literal = re.compile(r'f?"((?:%s)/[\w{}/]+)"' % "|".join(FAMILIES))
    unlisted = []
    for path in sources:
        text = path.read_text()
        if path.name == "metrics.py":  # the list itself
            text = re.sub(r"\nMETRIC_KEYS: .*?\n\)\n", "\n", text, flags=re.S)
        for key in literal.findall(text):
            if key.endswith("/") or key == "actor/{k}":  # a prefix; the actor's update keys (checked above)
                continue
            if "{" in key:  # an f-string: some listed key must be an instance of it
                wild = re.compile(re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(key)) + "$")
                ok = any(wild.match(p) for p in m.METRIC_KEYS)
            else:
                ok = m.metric_pattern(key) is not None
            if not ok:
                unlisted.append(f"{path.relative_to(ROOT)}: {key}")
    assert not unlisted, f"list these keys in METRIC_KEYS and explain them in docs/metrics.md: {unlisted}"
    # The check bites: a key the list does not know is reported.
    assert m.metric_pattern("actor/zero_advantage_steps") is None and m.metric_pattern("reward/gaia/mean")
