"""A rollout reduced to what training and the branch rule see, and a comparison of two such records.

Used to check that a change in how the scheduler asks the engines (issue 30: top-k only where a decision
reads it) leaves the rollout of a seed as it was: ``rollout_record`` keeps per trajectory its lineage,
tokens, sampled log-probs, loss mask, segments, tool calls and branch decisions; ``record_differences``
lists what differs between a record made before the change and one made after. Entropies that no
decision read may be absent (None) after; log-probs and entropies match within ``rel``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["load_record", "record_differences", "rollout_record", "save_record"]

_SEGMENT = ("owner", "index", "start", "num_tokens", "finish", "entropy")
_CALL = ("tool", "query", "call_offset", "result_offset", "num_result_tokens", "owner")
_DECISION = ("at_offset", "tool_call_index", "timing", "h_now", "h0", "u", "score", "consecutive", "branched",
             "child_id")


def rollout_record(result: Any) -> dict[str, Any]:
    trajs = []
    for t in result.trajectories():
        trajs.append({
            "traj_id": t.traj_id, "index": t.index, "origin": t.origin, "parent_id": t.parent_id,
            "branch_offset": t.branch_offset, "response_ids": list(t.response_ids),
            "response_logprobs": list(t.response_logprobs), "loss_mask": list(t.loss_mask),
            "finish_reason": t.finish_reason, "baseline_entropy": t.baseline_entropy,
            "segments": [{k: getattr(s, k) for k in _SEGMENT} for s in t.segments],
            "tool_calls": [{k: getattr(c, k) for k in _CALL} for c in t.tool_calls],
            "decisions": [{k: getattr(d, k) for k in _DECISION} for d in t.decisions],
        })
    return {"trajectories": trajs, "premonitor": [p.get("premonitor") for p in result.prompt_info]}


def save_record(path: str | Path, records: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(records, sort_keys=True, separators=(",", ":")) + "\n")


def load_record(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def _close(a: Any, b: Any, rel: float) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=rel, abs_tol=rel)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b))
    return a == b


def record_differences(before: dict[str, Any], after: dict[str, Any], rel: float = 1e-6) -> list[str]:
    """What differs, one line each (empty: the same rollout). An entropy not measured after (None) and
    measured before is allowed on a segment or a baseline (nothing read it), never in a decision."""
    out = []
    if not _close(before["premonitor"], after["premonitor"], rel):
        out.append(f"premonitor: {before['premonitor']} != {after['premonitor']}")
    ids_b = [t["traj_id"] for t in before["trajectories"]]
    ids_a = [t["traj_id"] for t in after["trajectories"]]
    if ids_b != ids_a:
        return out + [f"trajectories: {ids_b} != {ids_a}"]
    for tb, ta in zip(before["trajectories"], after["trajectories"]):
        for key in tb:
            if key == "segments":
                if len(tb[key]) != len(ta[key]):
                    out.append(f"{tb['traj_id']}: {len(tb[key])} segments != {len(ta[key])}")
                    continue
                for sb, sa in zip(tb[key], ta[key]):
                    sa = dict(sa)
                    if sa["entropy"] is None:
                        sa["entropy"] = sb["entropy"]  # not measured after: no decision read it
                    if not _close(sb, sa, rel):
                        out.append(f"{tb['traj_id']}: segment {sb} != {sa}")
            elif key == "baseline_entropy" and ta[key] is None:
                continue  # not measured after: no decision of the trajectory or its branches read it (h0 is compared)
            elif not _close(tb[key], ta[key], rel):
                out.append(f"{tb['traj_id']}: {key} differs: {str(tb[key])[:200]} != {str(ta[key])[:200]}")
    return out
