"""``shared_prefix_tokens`` (a per-rollout statistic) against the pairwise definition on random trees.

The statistic: per trajectory, the longest common prefix (prompt + response) with any earlier trajectory
of its prompt. The implementation compares each trajectory with its two lexicographic neighbours among
the earlier ones; the reference below compares every pair.
"""

from __future__ import annotations

import random

import pytest

from megatron_arpo.rollout.trajectory import Trajectory, shared_prefix_tokens


def pairwise_shared_prefix_tokens(trajectories) -> int:
    by_prompt: dict[int, list] = {}
    for t in trajectories:
        by_prompt.setdefault(t.prompt_index, []).append(t)
    saved = 0
    for group in by_prompt.values():
        seqs = [t.context() for t in sorted(group, key=lambda t: t.index)]
        for i in range(1, len(seqs)):
            best = 0
            for j in range(i):
                k = 0
                while k < min(len(seqs[i]), len(seqs[j])) and seqs[i][k] == seqs[j][k]:
                    k += 1
                best = max(best, k)
            saved += best
    return saved


def random_rollout(rng: random.Random, vocab: int, prompts_differ: bool = False) -> list[Trajectory]:
    """Trees of roots and branches forked at random offsets, with short random continuations (a small
    vocabulary makes chance agreements beyond the fork points common)."""
    out = []
    for p in range(rng.randint(1, 3)):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        group: list[Trajectory] = []
        for i in range(rng.randint(1, 14)):
            if group and rng.random() < 0.6:
                parent = rng.choice(group)
                child = parent.fork(f"{p}/{i}", i, rng.randint(0, len(parent.response_ids)))
            else:
                own = prompt + [i] if prompts_differ and i % 3 == 2 else list(prompt)
                child = Trajectory(prompt_id=str(p), prompt_index=p, traj_id=f"{p}/{i}", index=i, origin="initial",
                                   parent_id=None, branch_offset=None, prompt_token_ids=own)
            k = rng.randint(0, 9)
            child.append([rng.randrange(vocab) for _ in range(k)], [0.0] * k, 1)
            group.append(child)
        rng.shuffle(group)
        out.extend(group)
    return out


@pytest.mark.parametrize("vocab", [2, 3, 50])
def test_equals_the_pairwise_definition_on_random_trees(vocab):
    rng = random.Random(vocab)
    for _ in range(300):
        trajs = random_rollout(rng, vocab)
        assert shared_prefix_tokens(trajs) == pairwise_shared_prefix_tokens(trajs)


def test_groups_whose_prompts_differ_compare_whole_contexts():
    rng = random.Random(7)
    for _ in range(200):
        trajs = random_rollout(rng, 2, prompts_differ=True)
        assert shared_prefix_tokens(trajs) == pairwise_shared_prefix_tokens(trajs)


def test_a_branch_shares_its_fork_offset_and_chance_agreements_count_too():
    root = Trajectory(prompt_id="p", prompt_index=0, traj_id="p/0", index=0, origin="initial", parent_id=None,
                      branch_offset=None, prompt_token_ids=[9, 9, 9])
    root.append([1, 2, 3, 4, 5], [0.0] * 5, 1)
    child = root.fork("p/0/b1.0", 1, 2)
    child.append([3, 4, 7], [0.0] * 3, 1)       # re-samples 3, 4 as the parent did, then differs
    other = Trajectory(prompt_id="p", prompt_index=0, traj_id="p/1", index=2, origin="initial", parent_id=None,
                       branch_offset=None, prompt_token_ids=[9, 9, 9])
    other.append([8], [0.0], 1)
    assert shared_prefix_tokens([other, child, root]) == (3 + 4) + 3
