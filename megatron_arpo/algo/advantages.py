"""GRPO outcome advantages, one value per trajectory.

Variant: verl's ``compute_grpo_outcome_advantage`` as the ARPO/AEPO reference uses it
(docs/design/arpo_reference.md §3.1):

    A_i = (r_i - mean_g) / (std_g + eps)      std_g unbiased (N - 1)
    A_i = r_i - mean_g                         when ``norm_by_std`` is False

where g is the group of trajectory i (all trajectories of one prompt, branched or not).
A group of one trajectory uses mean 0 and std 1, so it keeps its reward, exactly as the
reference does.

Differences from the reference: none in value. The reference loops over trajectories in
Python and returns a per-token tensor (advantage times response mask); here the result is
one value per trajectory, computed with scatter operations, and the caller broadcasts it
over tokens (``losses.policy_loss`` accepts ``[batch]`` advantages directly). The paper's
"hard" advantage attribution on shared prefixes is not implemented (nor is it in the
reference): a shared prefix token is trained once per branch copy.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["grpo_advantages"]


def _group_index(group_ids: torch.Tensor | Sequence[Hashable], num: int) -> torch.Tensor:
    """Map arbitrary group ids to dense indices 0..G-1 (a [num] long tensor)."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.numel() != num:
            raise ValueError(
                f"group_ids has shape {tuple(group_ids.shape)} but rewards has {num} entries; "
                "pass one group id per trajectory"
            )
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(
                f"group_ids tensor has dtype {group_ids.dtype}; use an integer tensor "
                "or a list of hashable ids (e.g. prompt uid strings)"
            )
        _, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse
    ids = list(group_ids)
    if len(ids) != num:
        raise ValueError(
            f"group_ids has {len(ids)} entries but rewards has {num}; "
            "pass one group id per trajectory"
        )
    dense: dict[Hashable, int] = {}
    try:
        index = [dense.setdefault(g, len(dense)) for g in ids]
    except TypeError as exc:
        raise ValueError(f"group_ids must be hashable (ints or strings): {exc}") from exc
    return torch.tensor(index, dtype=torch.long)


def grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[Hashable],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised advantages, one per trajectory.

    Args:
        rewards: ``[num_traj]`` scalar reward per trajectory.
        group_ids: ``[num_traj]`` group (prompt) id per trajectory; an integer tensor or a
            list of hashables such as uid strings.
        norm_by_std: divide by the group's unbiased std (+ ``eps``); otherwise only centre.
        eps: added to the std, as in the reference (1e-6).

    Returns:
        ``[num_traj]`` floating tensor (float32 unless ``rewards`` is float64) on the
        device of ``rewards``.
    """
    r = torch.as_tensor(rewards)
    if r.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D (one scalar per trajectory), got shape {tuple(r.shape)}"
        )
    if not r.is_floating_point():
        r = r.to(torch.float32)
    num = r.numel()
    index = _group_index(group_ids, num).to(r.device)
    if num == 0:
        return r.clone()
    if not torch.isfinite(r).all():
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise ValueError(f"rewards contain non-finite values at positions {bad[:10]}")

    num_groups = int(index.max().item()) + 1
    # Accumulate in float64 so large groups of similar rewards do not lose the variance.
    r64 = r.to(torch.float64)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
    counts.index_add_(0, index, torch.ones_like(r64))
    sums = torch.zeros_like(counts).index_add_(0, index, r64)
    mean = sums / counts
    centred = r64 - mean[index]
    sq = torch.zeros_like(counts).index_add_(0, index, centred * centred)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))

    singleton = counts[index] == 1
    # The reference treats a lone trajectory as mean 0, std 1: its advantage is its reward.
    centred = torch.where(singleton, r64, centred)
    if norm_by_std:
        denom = torch.where(singleton, torch.ones_like(r64), std[index])
        adv = centred / (denom + eps)
    else:
        adv = centred
    return adv.to(r.dtype)
