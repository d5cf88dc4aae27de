"""Rollout routing replay (R3) in the actor: MoE forwards use each token's recorded experts.

Variant: Megatron-Core's router replay hook (``megatron/core/transformer/moe/router_replay.py``: the
top-k of every ``TopKRouter`` goes through ``RouterReplay.get_replay_topk``), with one instance per
router of *this* model (not Megatron's process-wide list, which a second model in the process, the
reference, would extend). The replayed experts keep the router's gradient: the weights are the softmax
of the router's logits at the recorded experts (``moe_router_pre_softmax: false``), as in Megatron.

Recorded routing is per sequence, ``[num_tokens, num_layers, topk]`` integer expert ids (global ids,
global layer index), token-aligned with ``input_ids``: row ``t`` is the experts token ``t`` went to. A
row of ``-1`` means "not recorded" (a rollout never forwards the last sampled token, padding has no
token): such tokens are routed by the router itself, in the same forward.

A micro-batch carries its routing as ``[b, s, num_layers, topk]`` (:func:`gather_routing`, token ``t``
of a sequence at row position ``offset + t``, unlike the shifted target values). Before a forward,
:func:`set_routing` gives each router its layer's rows in the order the router sees the tokens
(``[s, b]`` flattened; with sequence parallelism this TP rank's chunk of ``s``), and
:func:`clear_routing` returns the routers to plain routing after it. :func:`record_routing` makes the
routers keep the experts they used (replayed or their own), for the stand-in recording and for tests. Activation recomputation would
run the router again in backward, after the next micro-batch's routing is set, so it is refused
together with replay (``megatron_arpo.config.validate``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

NOT_RECORDED = -1


def _replay_base() -> type:
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


def _routers(model: torch.nn.Module) -> list:
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _make_replay(layer: int):
    """A ``RouterReplay`` for the router of global layer ``layer`` (0-based), kept off Megatron's global list."""
    base = _replay_base()

    class _LayerReplay(base):
        def __init__(self) -> None:
            super().__init__()
            base.global_router_replay_instances.remove(self)
            self.layer = layer
            self.recorded_rows: list[torch.Tensor] = []

        def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                            group_topk: Optional[int] = None, default_compute_topk: Callable = None):
            if self.target_topk_idx is None:
                probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            else:
                idx = self.target_topk_idx.to(scores.device)
                if idx.shape != (scores.shape[0], topk):
                    raise ValueError(f"layer {self.layer}: recorded routing has shape {tuple(idx.shape)} but the "
                                     f"router routes {scores.shape[0]} tokens to {topk} experts")
                missing = (idx < 0).any(dim=-1)
                if bool(missing.any()):
                    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    idx = torch.where(missing[:, None], own, idx)
                probs = scores.gather(1, idx)
            if self.router_replay_action is not None:  # recording: the experts this forward used
                self.recorded_rows.append(idx.detach().cpu())
            return probs, idx

    return _LayerReplay()


def install(model: torch.nn.Module) -> int:
    """Give every MoE router of ``model`` (one pipeline stage) a replay hook; returns the number of routers."""
    routers = _routers(model)
    for router in routers:
        if router.layer_number is None:
            raise RuntimeError("an MoE router has no layer number; routing replay needs the global layer index")
        if router.config.moe_router_fusion:  # the fused top-k kernel bypasses the replay hook
            raise RuntimeError("moe_router_fusion is on: Megatron's fused top-k does not take replayed routing")
        router.router_replay = _make_replay(router.layer_number - 1)
    return len(routers)


def _hooks(model: torch.nn.Module) -> list:
    return [r.router_replay for r in _routers(model) if r.router_replay is not None]


def set_routing(model: torch.nn.Module, routing: torch.Tensor) -> None:
    """Force ``routing`` (``[b, s, num_layers, topk]``, -1 = not recorded) in the next forward of ``model``."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state

    routers = _routers(model)
    tokens = routing.transpose(0, 1)  # the router sees [s, b] flattened
    if routers and routers[0].config.sequence_parallel:  # each TP rank routes its chunk of s
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tokens = tokens.chunk(tp_size, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
    flat = tokens.reshape(-1, *routing.shape[2:]).long()
    for hook in _hooks(model):
        if hook.layer >= flat.shape[1]:
            raise ValueError(f"recorded routing covers {flat.shape[1]} layers; the model has MoE layer {hook.layer}")
        hook.target_topk_idx = flat[:, hook.layer]


def record_routing(model: torch.nn.Module) -> None:
    """The next forwards record the experts each router used (:func:`recorded_routing` reads them back)."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for hook in _hooks(model):
        hook.recorded_rows = []
        hook.router_replay_action = RouterReplayAction.RECORD


def recorded_routing(model: torch.nn.Module, forward: int, rows: int, row_length: int) -> torch.Tensor:
    """Forward ``forward``'s recorded routing of this stage's layers as ``[b, s, layers_here, topk]``."""
    per_layer = [h.recorded_rows[forward].reshape(row_length, rows, -1) for h in _hooks(model)]
    return torch.stack(per_layer, dim=2).transpose(0, 1)


def clear_routing(model: torch.nn.Module) -> None:
    """Back to plain routing (each router picks its own top-k); recording goes on until :func:`stop_recording`."""
    for hook in _hooks(model):
        hook.target_topk_idx = None
        hook.replay_backward_list = []


def stop_recording(model: torch.nn.Module) -> None:
    for hook in _hooks(model):
        hook.router_replay_action = None
        hook.recorded_rows = []


def gather_routing(plan: Any, per_sequence: Sequence[Any], num_layers: int, topk: int) -> torch.Tensor:
    """The micro-batch's routing ``[b, s, num_layers, topk]`` (int16): token ``t`` at ``offset + t``, -1 elsewhere."""
    out = torch.full((len(plan.rows), plan.row_length, num_layers, topk), NOT_RECORDED, dtype=torch.int16)
    for r, row in enumerate(plan.rows):
        for idx, off, length in zip(row.seq_indices, row.offsets, row.lengths):
            vals = per_sequence[idx]
            if vals is None:
                continue
            vals = torch.as_tensor(vals).to(torch.int16)
            if tuple(vals.shape) != (length, num_layers, topk):
                raise ValueError(f"sequence {idx}: routed_experts has shape {tuple(vals.shape)}; expected "
                                 f"({length}, {num_layers}, {topk}) = (tokens, MoE layers, experts per token)")
            out[r, off:off + length] = vals
    return out


def split_recorded(plan: Any, routing: torch.Tensor) -> dict[int, torch.Tensor]:
    """Inverse of :func:`gather_routing`: each sequence's ``[len, layers, topk]`` rows of a micro-batch."""
    out: dict[int, torch.Tensor] = {}
    for r, row in enumerate(plan.rows):
        for idx, off, length in zip(row.seq_indices, row.offsets, row.lengths):
            out[idx] = routing[r, off:off + length].clone()
    return out
