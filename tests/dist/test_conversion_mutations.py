"""Mutation tests of the mapping tables: every injected mapping fault must fail the parity checks.

A round trip HF -> Megatron -> HF cannot see most mapping faults (a swapped pair comes back swapped
again), so the checks that matter are the ones ``verify`` and ``tests/dist/test_conversion_live.py`` run:
Megatron logits against transformers' on the same weights, and the exported tensors against the
originals. Each mutation below replaces one rule of the table inside the worker processes, then runs
:func:`conversion.parity.parity_worker` at TP=2 (so sharding faults show too) and records whether the
fault was caught (a validation error, logits off by >= 1e-4, or a mismatching export). The unmutated
table runs first, as the control that must pass. The tiny checkpoints have random norm weights and
biases (:mod:`megatron_arpo.tiny.checkpoint`); with unit norms the two norm swaps below went unnoticed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_arpo.hf import mapping

TOKENS = torch.tensor([[1, 5, 17, 300, 999, 42, 7, 8], [3, 4, 900, 12, 13, 14, 15, 16]])
TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class ConcatQKV(mapping.FusedQKV):
    """The classic fault: ``linear_qkv`` as plain ``[q; k; v]`` instead of interleaved per query group."""

    def read_shard(self, read, cfg, tp_rank, tp_size):
        full = torch.cat([read(self.q), read(self.k), read(self.v)])
        return mapping.shard_full(self.shard, full, tp_rank, tp_size)

    def to_hf(self, full, cfg):
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        q, k, v = torch.split(full, [q_dim, kv_dim, kv_dim])
        return {self.q: q.contiguous(), self.k: k.contiguous(), self.v: v.contiguous()}


def _replace(rules, match, fn):
    hits = [r for r in rules if match(r)]
    assert hits, "mutation matched no rule: the table changed, update the mutation"
    return tuple(fn(r) if match(r) else r for r in rules)


def _is(cls, suffix):
    return lambda r: isinstance(r, cls) and r.megatron.endswith(suffix)


def _swap_copies(rules, a, b):
    ra = next(r for r in rules if r.megatron.endswith(a))
    rb = next(r for r in rules if r.megatron.endswith(b))
    return tuple(dataclasses.replace(r, hf=rb.hf) if r is ra else dataclasses.replace(r, hf=ra.hf) if r is rb else r
                 for r in rules)


QKV_W = "linear_qkv.weight"
QKV_B = "linear_qkv.bias"
MUTATIONS = {
    "q_norm <-> k_norm": ("qwen3", lambda t: _swap_copies(t, "q_layernorm.weight", "k_layernorm.weight")),
    "input_layernorm <-> post_attention_layernorm": (
        None, lambda t: _swap_copies(t, "input_layernorm.weight", "pre_mlp_layernorm.weight")),
    "QKV weight de-interleaved": (None, lambda t: _replace(
        t, _is(mapping.FusedQKV, QKV_W), lambda r: ConcatQKV(**dataclasses.asdict(r)))),
    "QKV bias de-interleaved": ("qwen2", lambda t: _replace(
        t, _is(mapping.FusedQKV, QKV_B), lambda r: ConcatQKV(**dataclasses.asdict(r)))),
    "k_proj <-> v_proj": (None, lambda t: _replace(
        t, _is(mapping.FusedQKV, QKV_W), lambda r: dataclasses.replace(r, k=r.v, v=r.k))),
    "gate_proj <-> up_proj": (None, lambda t: _replace(
        t, _is(mapping.FusedGateUp, "linear_fc1.weight"), lambda r: dataclasses.replace(r, gate=r.up, up=r.gate))),
    "linear_fc1 split as one column block at TP>1": (None, lambda t: _replace(
        t, _is(mapping.FusedGateUp, "linear_fc1.weight"), lambda r: dataclasses.replace(r, shard=mapping.Shard.COLUMN))),
    "QKV bias dropped": ("qwen2", lambda t: tuple(r for r in t if not r.megatron.endswith(QKV_B)))
}


def mutation_worker(rank, world_size, hf_dir, name, tp, mutations):
    from megatron.core import parallel_state

    from conversion.parity import parity_worker

    pristine = mapping.get_table  # what bind_table reads the family's table through
    outcomes = {}
    for label in [None, *mutations]:
        if label is not None:
            wanted, mutate = MUTATIONS[label]

            def mutated_table(model_type, wanted=wanted, mutate=mutate):
                table = pristine(model_type)
                return mutate(table) if wanted in (None, model_type) else table

            mapping.get_table = mutated_table
        try:
            result = parity_worker(rank, world_size, hf_dir, name, tp, 1, TOKENS)
            outcomes[label] = {"error": None, "max_abs_diff": result["max_abs_diff"],
                               "mismatches": len(result["mismatches"])}
        except (ValueError, KeyError, RuntimeError) as exc:
            outcomes[label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        finally:
            mapping.get_table = pristine
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
    return outcomes


def _caught(per_rank: list[dict]) -> bool:
    for outcome in per_rank:
        if outcome["error"] or outcome["mismatches"]:
            return True
        if outcome["max_abs_diff"] is not None and outcome["max_abs_diff"] >= TOLERANCE:
            return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("name,model_type", [("tiny-qwen3", "qwen3"), ("tiny-qwq", "qwen2")])
def test_every_mapping_fault_fails_parity(name, model_type):
    from megatron_arpo.device.local_ranks import run_distributed
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    mutations = [label for label, (wanted, _) in MUTATIONS.items() if wanted in (None, model_type)]
    results = run_distributed(mutation_worker, 2, str(tiny_checkpoint(name)), name, 2, mutations, timeout=600)
    control = [r[None] for r in results]
    assert not _caught(control), f"the unmutated table must pass: {control}"
    missed = [label for label in mutations if not _caught([r[label] for r in results])]
    assert not missed, f"mapping faults the parity checks did not catch: {missed}\n" + "\n".join(
        f"  {label}: {[r[label] for r in results]}" for label in mutations)
