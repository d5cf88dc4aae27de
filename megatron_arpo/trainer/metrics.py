"""Per-step metrics of the RL loop: phase timers, rollout/reward/tool statistics, validation summaries.

Everything here is pure Python over plain data (trajectory records, tool counters, the actor's metric
dicts), so it is unit-tested without engines. Key names (the ``metrics.jsonl`` columns):

- ``reward/mean``, ``reward/std``, ``reward/accuracy``, ``reward/format_error_frac`` and the same under
  ``reward/<data_source>/``. **Accuracy** is the fraction of trajectories with reward >= 1.0
  (``ACCURACY_THRESHOLD``): a fully correct answer for every built-in reward (deep_research gives F1,
  plus 0.1 when both tools were used, so 1.0 or 1.1 means F1 = 1; math and qa_em give 1.0; qa_f1 gives
  1.0 only for an exact token match). A custom reward should keep 1.0 = correct to make it meaningful.
  **format_error_frac** counts rewards < 0 (deep_research's -1 for a broken answer format).
- ``tools/calls_per_traj`` (calls a trajectory's text contains, inherited ones included) and per tool
  ``tools/<tag>/calls_per_traj``; executed this step: ``tools/<tag>/calls``, ``errors``, ``timeouts``,
  ``cache_hits``; ``tools/errors``, ``tools/call_limit_hits``, ``tools/cache_hit_rate``.
- ``rollout/branches_per_prompt``, ``rollout/fills_per_prompt``, ``rollout/response_length{,_max}``,
  ``rollout/truncated_frac``, ``rollout/generated_tokens_per_s``, ``rollout/prefix_cache_hit_rate``,
  ``rollout/entropy_first_segment`` and ``rollout/entropy_after_tool`` (the scheduler's segment
  entropies from the engine's top-k log-probs: the quantity ARPO branches on; only segments whose
  entropy a decision read, unless ``rollout.entropy_metrics``),
  ``rollout/logprob_abs_diff`` (|engine log-prob - actor log-prob| of sampled tokens: the
  training/inference mismatch; it stays small only if every weight sync arrived). vLLM reports
  log-probs of the raw logits (its default ``logprobs_mode``) while the actor applies
  ``rollout.temperature``, so the value is a sync check only at temperature 1.
  ``rollout/logprob_ratio_out_frac``: the share of those tokens whose ratio exp(actor - engine) leaves
  [0.8, 1.25]. ``rollout/routing_recorded_frac`` (routing replay only): the share of the context positions
  an engine forward saw whose experts it recorded (the actor routes the rest itself).
  ``rollout/logprob_abs_diff_unreplayed`` and ``rollout/logprob_ratio_out_frac_unreplayed``
  (``actor.moe_replay_diagnostics``): the same two on the same tokens and weights, the actor routing
  itself: what replay removes, paired.
- ``actor/*``: the actor group's update metrics (loss, pg_loss, clip fractions, approx_kl, kl_loss,
  grad_norm, lr, padding_fraction, tokens_per_s), ``actor/entropy`` and ``actor/entropy_after_tool``
  (per-token entropy of the policy on response tokens, and on the first ``rollout.entropy_window``
  tokens after each tool result), ``actor/ref_kl`` (mean log pi_old - log pi_ref on response tokens,
  when a reference model runs), ``actor/logprob_padding_fraction``.
- ``sync/seconds`` (wall time of the whole sync), ``sync/send_s`` (the slowest sender),
  ``sync/gb_per_s``, ``sync/bytes``, ``sync/buckets``, ``sync/driver_bytes`` (metadata through the
  driver), ``sync/driver_weight_bytes`` (weight bytes through the driver: 0), ``sync/verified``.
- ``time/<phase>_s`` for rollout, reward, advantage, logprob, ref_logprob, update, sync, validate,
  ``time/step_s`` (the row is written before the step's checkpoint, so neither holds the save: its time
  is in the log) and ``time/outside_model_frac``: the share of the step's wall time outside model
  compute, i.e. not in rollout, log-prob, update or validation phases. Rollout time includes waiting
  for tools when no generation overlaps it, so this share is a lower bound.
- ``val/reward``, ``val/accuracy``, ``val/<data_source>/reward``, ``val/<data_source>/accuracy``.

``METRIC_KEYS`` lists every key a row can hold; docs/metrics.md explains each, and a unit test keeps the
list, the page and the keys these functions emit in step.
"""

from __future__ import annotations

import math
import re
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

ACCURACY_THRESHOLD = 1.0
MODEL_PHASES = ("rollout", "logprob", "ref_logprob", "update", "validate")

# Every key of a metrics.jsonl row; <source> stands for a data source, <tool> for a tool tag, <phase> for a
# step phase (PhaseTimer), <switch> for a colocated phase switch (trainer/phases.py) and <lag> for a policy
# version lag (off-policy mode).
_SUMMARY = ("mean", "std", "accuracy", "format_error_frac")
RATIO_BAND = (0.8, 1.25)   # rollout/logprob_ratio_out_frac: an importance ratio outside it counts
_VAL = ("reward", "accuracy", "format_error_frac")
METRIC_KEYS: tuple[str, ...] = (
    "step",
    *(f"reward/{k}" for k in _SUMMARY), *(f"reward/<source>/{k}" for k in _SUMMARY),
    *(f"val/{k}" for k in _VAL), *(f"val/<source>/{k}" for k in _VAL),
    "val/response_length", "val/tool_calls_per_traj",
    *(f"rollout/{k}" for k in (
        "num_trajectories", "branches_per_prompt", "fills_per_prompt", "response_length", "response_length_max",
        "truncated_frac", "generated_tokens", "generated_tokens_per_s", "prefix_cache_hit_rate",
        "entropy_first_segment", "entropy_after_tool", "logprob_abs_diff", "logprob_ratio_out_frac",
        "logprob_abs_diff_unreplayed", "logprob_ratio_out_frac_unreplayed",
        "routing_recorded_frac")),
    "tools/calls_per_traj", "tools/errors", "tools/call_limit_hits", "tools/cache_hit_rate",
    *(f"tools/<tool>/{k}" for k in ("calls_per_traj", "calls", "errors", "timeouts", "cache_hits")),
    *(f"actor/{k}" for k in (  # the actor's update (actor/worker.py), then token_statistics
        "loss", "pg_loss", "kl_loss", "clip_frac", "low_clip_frac", "high_clip_frac", "dual_clip_frac", "approx_kl",
        "loss_tokens", "loss_last", "grad_norm", "grad_norm_max", "lr", "padding_fraction", "tokens",
        "tokens_per_s", "num_optimizer_steps", "logprob_padding_fraction", "entropy", "entropy_after_tool",
        "ref_kl")),
    *(f"sync/{k}" for k in ("seconds", "send_s", "bytes", "gb_per_s", "buckets", "senders", "driver_bytes",
                            "driver_weight_bytes", "verified")),
    "phase/<switch>_s", "phase/offload_optimizer_gib", "phase/offload_grad_gib",
    "time/<phase>_s", "time/step_s", "time/outside_model_frac",
    "preempt/needed_lead_s",
    "data/epoch", "data/position", "data/prompt_uids",
    "train/zero_signal", "train/zero_signal_steps",
    *(f"offpolicy/{k}" for k in (  # trainer.mode: off_policy (trainer/off_policy.py); <lag>: a version lag
        "policy_version", "buffer_depth", "dropped_stale", "dropped_stale_total", "dropped_in_flight_total",
        "engine_restarts_total", "staleness/<lag>", "token_share/<lag>", "is_weight_mean", "is_weight_max", "is_weight_clipped_frac",
        "engine_idle_s", "engine_idle_frac", "actor_idle_s", "actor_idle_frac")),
)


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("".join(r"[^/]+" if part.startswith("<") else re.escape(part)
                              for part in re.split(r"(<\w+>)", pattern) if part) + "$")


_KEY_REGEXES = tuple((p, _pattern_regex(p)) for p in METRIC_KEYS)


def metric_pattern(key: str) -> str | None:
    """The ``METRIC_KEYS`` entry ``key`` is an instance of (the exact key first), or None."""
    if key in METRIC_KEYS:
        return key
    return next((p for p, regex in _KEY_REGEXES if regex.match(key)), None)


class PhaseTimer:
    """Wall time per named phase of one step; optionally advances a progress bar per phase."""

    def __init__(self, bar: Any = None) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.bar = bar

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.bar is not None:
            self.bar.set_postfix_str(phase)
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - begin
            if self.bar is not None:
                self.bar.update(1)

    def metrics(self) -> dict[str, float]:
        total = time.perf_counter() - self.start
        out = {f"time/{phase}_s": s for phase, s in self.seconds.items()}
        out["time/step_s"] = total
        model = sum(self.seconds.get(p, 0.0) for p in MODEL_PHASES)
        out["time/outside_model_frac"] = max(0.0, total - model) / total if total > 0 else 0.0
        return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0 if values else float("nan")
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _reward_summary(rewards: Sequence[float], prefix: str) -> dict[str, float]:
    return {f"{prefix}mean": _mean(rewards), f"{prefix}std": _std(rewards),
            f"{prefix}accuracy": _mean([float(r >= ACCURACY_THRESHOLD) for r in rewards]),
            f"{prefix}format_error_frac": _mean([float(r < 0) for r in rewards])}


def reward_metrics(trajectories: Sequence[Any], data_sources: Mapping[str, str], prefix: str = "reward/") -> dict[str, float]:
    """Reward statistics overall and per data source; ``data_sources`` maps prompt id -> data source."""
    out = _reward_summary([float(t.reward) for t in trajectories], prefix)
    by_source: dict[str, list[float]] = {}
    for t in trajectories:
        by_source.setdefault(data_sources[t.prompt_id], []).append(float(t.reward))
    for source, rewards in sorted(by_source.items()):
        out.update(_reward_summary(rewards, f"{prefix}{source}/"))
    return out


def validation_metrics(trajectories: Sequence[Any], data_sources: Mapping[str, str]) -> dict[str, float]:
    """``val/reward`` and ``val/accuracy`` overall and per data source (greedy, one trajectory per prompt)."""
    out: dict[str, float] = {}
    for key, value in reward_metrics(trajectories, data_sources, prefix="val/").items():
        name = key.replace("/mean", "/reward") if key.endswith("/mean") else key
        if name.endswith(("/reward", "/accuracy", "/format_error_frac")):
            out[name] = value
    out["val/response_length"] = _mean([len(t.response_ids) for t in trajectories])
    out["val/tool_calls_per_traj"] = _mean([len(t.tool_calls) for t in trajectories])
    return out


def rollout_metrics(result: Any, seconds: float) -> dict[str, float]:
    """Branching, length, entropy and throughput statistics of one rollout call."""
    trajs = result.trajectories()
    stats = result.stats
    num_prompts = max(len(result.groups), 1)
    lengths = [len(t.response_ids) for t in trajs]
    first, after = [], []
    for t in trajs:
        for seg in t.segments:
            if seg.owner != t.traj_id:
                continue  # inherited from the parent: counted there
            (first if seg.index == 0 and t.origin != "branch" else after).append(seg.entropy)
    prompt_tokens = stats.get("engine_prompt_tokens", 0.0)
    return {
        "rollout/num_trajectories": float(len(trajs)),
        "rollout/branches_per_prompt": stats.get("branches", 0.0) / num_prompts,
        "rollout/fills_per_prompt": stats.get("fills", 0.0) / num_prompts,
        "rollout/response_length": _mean(lengths),
        "rollout/response_length_max": float(max(lengths)) if lengths else float("nan"),
        "rollout/truncated_frac": _mean([float(t.finish_reason in ("length", "max_model_len")) for t in trajs]),
        "rollout/generated_tokens": stats.get("generated_tokens", 0.0),
        "rollout/generated_tokens_per_s": stats.get("generated_tokens", 0.0) / seconds if seconds > 0 else float("nan"),
        "rollout/prefix_cache_hit_rate": stats.get("engine_cached_tokens", 0.0) / prompt_tokens if prompt_tokens else 0.0,
        "rollout/entropy_first_segment": _mean([h for h in first if h is not None and math.isfinite(h)]),
        "rollout/entropy_after_tool": _mean([h for h in after if h is not None and math.isfinite(h)]),
    }


def tool_metrics(trajectories: Sequence[Any], rollout_stats: Mapping[str, float], before: Mapping[str, Mapping],
                 after: Mapping[str, Mapping], tags: Sequence[str]) -> dict[str, float]:
    """Per-trajectory tool use from the records, plus this step's executor counters (``after - before``
    of ``ToolExecutor.stats()``)."""
    n = max(len(trajectories), 1)
    out = {"tools/calls_per_traj": sum(len(t.tool_calls) for t in trajectories) / n,
           "tools/errors": float(rollout_stats.get("tool_errors", 0.0)),
           "tools/call_limit_hits": float(rollout_stats.get("call_limit_hits", 0.0))}
    for tag in tags:
        out[f"tools/{tag}/calls_per_traj"] = sum(1 for t in trajectories for c in t.tool_calls if c.tool == tag) / n
        now, then = after.get(tag, {}), before.get(tag, {})
        for counter in ("calls", "errors", "timeouts", "cache_hits"):
            out[f"tools/{tag}/{counter}"] = float(now.get(counter, 0) - then.get(counter, 0))
    cache_now, cache_then = after.get("cache"), before.get("cache")
    if cache_now is not None:
        cache_then = cache_then or {}
        hits = sum(cache_now.get(k, 0) - cache_then.get(k, 0) for k in ("hits", "inflight_hits"))
        lookups = hits + cache_now.get("misses", 0) - cache_then.get("misses", 0)
        out["tools/cache_hit_rate"] = hits / lookups if lookups else 0.0
    return out


def actor_metrics(update: Mapping[str, float], logprob_padding: float | None = None) -> dict[str, float]:
    out = {f"actor/{k}": float(v) for k, v in update.items()}
    if logprob_padding is not None:
        out["actor/logprob_padding_fraction"] = float(logprob_padding)
    return out


def sync_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """One weight sync (``ActorGroup.sync_weights``' report): wall time, the senders' share, bytes, checks."""
    seconds = float(report["seconds"])
    return {"sync/seconds": seconds, "sync/send_s": float(report["send_s"]), "sync/bytes": float(report["bytes"]),
            "sync/gb_per_s": report["bytes"] / 1e9 / seconds if seconds > 0 else 0.0,
            "sync/buckets": float(report["buckets"]), "sync/senders": float(report.get("senders", 0)),
            "sync/driver_bytes": float(report["driver_bytes"]),
            "sync/driver_weight_bytes": float(report["driver_weight_bytes"]),
            "sync/verified": float(len(report.get("verified_after_load", [])))}


def _add_mismatch(diffs: list, out_of_band: list, engine_lp: float, actor_lp: float) -> None:
    diffs.append(abs(engine_lp - actor_lp))
    out_of_band.append(not RATIO_BAND[0] <= math.exp(actor_lp - engine_lp) <= RATIO_BAND[1])


def token_statistics(batch: Mapping[str, Any], trajectories: Sequence[Any], entropy_window: int) -> dict[str, float]:
    """Policy entropy and train/inference log-prob mismatch on response tokens.

    ``batch`` holds per sequence ``input_ids``, ``loss_mask``, ``old_logprobs`` (token-aligned), optional
    ``entropy`` and ``ref_logprobs``; ``trajectories`` are in the same order.
    """
    diff, out_of_band, ent, ent_after, ref_kl = [], [], [], [], []
    own_diff, own_out = [], []  # actor.moe_replay_diagnostics: the same tokens on the actor's own routing
    routing = batch.get("routed_experts")
    unreplayed = batch.get("unreplayed_logprobs")
    seen = recorded = 0
    for i, t in enumerate(trajectories):
        p = len(t.prompt_token_ids)
        old = batch["old_logprobs"][i]
        entropy = batch.get("entropy", [None] * len(trajectories))[i]
        ref = batch.get("ref_logprobs", [None] * len(trajectories))[i]
        last = len(t.response_ids) - (1 if t.call_limit_hit else 0)  # the appended EOS has no engine log-prob
        if routing is not None:  # the engine's forwards saw every position before its last sampled token
            sampled = [j for j in range(last) if t.loss_mask[j]]
            upto = p + sampled[-1] if sampled else 0
            seen += upto
            recorded += sum(1 for row in routing[i][:upto] if row[0][0] >= 0)
        for j, (mask, engine_lp) in enumerate(zip(t.loss_mask, t.response_logprobs)):
            if not mask:
                continue
            actor_lp = float(old[p + j])
            if j < last and math.isfinite(engine_lp):
                _add_mismatch(diff, out_of_band, engine_lp, actor_lp)
                if unreplayed is not None:
                    _add_mismatch(own_diff, own_out, engine_lp, float(unreplayed[i][p + j]))
            if entropy is not None:
                ent.append(float(entropy[p + j]))
            if ref is not None:
                ref_kl.append(actor_lp - float(ref[p + j]))
        if entropy is not None:
            for call in t.tool_calls:
                start = call.result_offset + call.num_result_tokens
                window = [float(entropy[p + j]) for j in range(start, min(start + entropy_window, len(t.response_ids)))
                          if t.loss_mask[j]]
                ent_after.extend(window)
    out = {"rollout/logprob_abs_diff": _mean(diff), "rollout/logprob_ratio_out_frac": _mean(out_of_band)}
    if routing is not None:  # routing replay: rows of -1 were not recorded
        out["rollout/routing_recorded_frac"] = recorded / seen if seen else float("nan")
    if unreplayed is not None:
        out["rollout/logprob_abs_diff_unreplayed"] = _mean(own_diff)
        out["rollout/logprob_ratio_out_frac_unreplayed"] = _mean(own_out)
    if ent:
        out["actor/entropy"] = _mean(ent)
        out["actor/entropy_after_tool"] = _mean(ent_after)
    if ref_kl:
        out["actor/ref_kl"] = _mean(ref_kl)
    return out


def data_metrics(prompt_uids: Sequence[str], sampler_state: Mapping[str, int]) -> dict[str, Any]:
    """Where the sampler stands, and which prompts this step used (for auditing the data order)."""
    return {"data/epoch": sampler_state["epoch"], "data/position": sampler_state["position"],
            "data/prompt_uids": list(prompt_uids)}
