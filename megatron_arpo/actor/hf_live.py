"""Load HF weights into a live Megatron model and export HF-named full tensors from one, via the tables.

Used by the trainer (initial load with no pre-conversion step, weight sync to the rollout engines) and by
``verify``. Both functions take the model chunk(s) of *this* rank: a ``GPTModel`` (possibly wrapped in
DDP / Float16Module, whose ``module.`` prefixes are stripped) or a one-element list of them. Virtual
pipeline stages (several chunks per rank) are not supported yet and are rejected.

- :func:`load_hf_into_megatron` reads only the rows/columns of the HF tensors this (tp, pp) rank holds,
  lazily from safetensors (``safe_open`` + ``get_slice``): memory is this rank's shards, not the model.
  Before copying it checks the HF config against the model config, coverage of the HF tensors, their
  shapes, and that every parameter of the stage gets exactly one tensor of the right shape.
- :func:`stage_hf_buckets` streams one pipeline stage's HF tensors as packed buckets (whole decoder
  layers, about ``bucket_bytes`` each, the tensors back to back in one flat byte buffer): each tensor's
  TP shards are gathered (on one TP rank, the weight-sync sender, or on all), turned into HF tensors by
  the table (vocab trimmed, no ``lm_head`` when tied) and copied into the bucket. The weight sync sends
  these buckets to the rollout engines (megatron_arpo.weight_sync.senders). With expert parallelism
  each EP rank builds its own part of every bucket (its experts; EP rank 0 adds the rest), which the
  weight sync sends from every EP rank.
- :func:`export_hf_buckets` / :func:`export_hf_weights` give the whole model on every rank of the TP x
  PP grid, in lockstep and in the same order: the owning stage broadcasts each packed bucket to the
  other stages (metadata with every bucket: nothing is cached across calls). HF checkpoint writing and
  ``verify`` use them.
"""

from __future__ import annotations

import collections
import logging
import math
import os
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Sequence

import torch

from megatron_arpo.hf import mapping
from megatron_arpo.hf.mapping import check_hf_dtypes, validate_hf_checkpoint  # noqa: F401  (re-exported)
from megatron_arpo.hf.checkpoint_io import HFCheckpointReader
from megatron_arpo.model_config import ModelConfig
from megatron_arpo.weight_sync.protocol import BucketLayout, BufferPool, pack_in_order

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 2**20
# A stage's gathers run this many tensors ahead of the one being copied into the bucket (point-to-point
# transfers back to back instead of one round trip per tensor); costs this many tensors' pieces in memory.
GATHERS_IN_FLIGHT = 2


def _single_chunk(models) -> torch.nn.Module:
    if isinstance(models, torch.nn.Module):
        return models
    models = list(models)
    if len(models) != 1:
        raise NotImplementedError(
            f"got {len(models)} model chunks on this rank; virtual pipeline parallelism is not supported by "
            f"the converter yet, use one chunk per pipeline stage")
    return models[0]


def stage_parameters(models, cfg: ModelConfig, pp_rank: int, pp_size: int, ep_rank: int = 0,
                     ep_size: int = 1) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters keyed by canonical name (global layer and expert numbers, local-spec norm names)."""
    offset = mapping.stage_layers(cfg, pp_rank, pp_size).start
    expert_offset = ep_rank * mapping.experts_per_rank(cfg, ep_size) if cfg.is_moe else 0
    params = {}
    for name, param in _single_chunk(models).named_parameters():
        params[mapping.canonical_megatron_name(name, offset, expert_offset)] = param
    return params


def _optional_output(cfg: ModelConfig):
    # Tied models: the output layer shares the embedding on a single stage, so it has no parameter.
    return lambda rule: isinstance(rule.rule, mapping.VocabEmbedding) and rule.rule.is_tied(cfg) \
        and rule.megatron == "output_layer.weight"


@torch.no_grad()
def load_hf_into_megatron(models, model_cfg: ModelConfig, hf_dir: str | os.PathLike, tp_rank: int, tp_size: int,
                          pp_rank: int, pp_size: int, *, check_config: bool = True, ep_rank: int = 0,
                          ep_size: int = 1, etp_rank: int | None = None, etp_size: int | None = None) -> list[str]:
    """Copy this rank's shards of an HF checkpoint into the live model; returns the parameters loaded.

    MoE: this EP rank's experts only, split over the expert-TP group (``etp_*``; default: the TP group's).
    """
    reader = HFCheckpointReader(hf_dir)
    bound = validate_hf_checkpoint(reader, model_cfg, check_config)
    rules = [rule for rule in mapping.rules_for_stage(bound, model_cfg, pp_rank, pp_size)
             if mapping.expert_rank(rule, model_cfg, ep_size) in (None, ep_rank)]
    params = stage_parameters(models, model_cfg, pp_rank, pp_size, ep_rank, ep_size)
    where = f"Megatron model (tp_rank {tp_rank}/{tp_size}, pp_rank {pp_rank}/{pp_size}, ep_rank {ep_rank}/{ep_size})"
    mapping.check_megatron_coverage(rules, params, where, optional=_optional_output(model_cfg))
    loaded = []
    for rule in rules:
        param = params.get(rule.megatron)
        if param is None:
            continue
        if rule.expert is not None and etp_size is not None:
            shard = rule.read_shard(reader, model_cfg, etp_rank, etp_size)
        else:
            shard = rule.read_shard(reader, model_cfg, tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"{where}: {rule.megatron} has shape {list(param.shape)} but the mapping built {list(shard.shape)} "
                f"from {list(rule.hf_sources)}; the model was built with a different config than {model_cfg.name!r}")
        param.data.copy_(shard)
        loaded.append(rule.megatron)
    logger.info("loaded %d tensors from %s into tp_rank %d pp_rank %d", len(loaded), hf_dir, tp_rank, pp_rank)
    return loaded


def _gather_full(rule: mapping.BoundRule, param: torch.Tensor, tp_group, tp_size: int,
                 dst: int | None, out: torch.Tensor | None = None, tag: int = 0) -> Callable[[], torch.Tensor | None]:
    """Start gathering the full (TP-unsharded) tensor of ``rule`` on the receiving ranks (``dst``, or all
    when None); returns a function that waits for it and returns it (None on the other ranks).

    Row-concatenated shards (column, vocab) are gathered straight into the full tensor's row blocks, so
    the only memory is the full tensor; the others (row, gated) gather into pieces and are unsharded.
    With a ``dst`` the shards travel point to point (`_gather_to`), not by ``gather``, and the transfer
    runs until the returned function is called (the caller starts the next tensors' gathers first).
    ``out``: where the full tensor goes (column, vocab and gated shards), instead of a new tensor.
    ``tag``: this gather's first point-to-point tag (it uses two), distinct among the gathers in flight.
    """
    receiving = dst is None or torch.distributed.get_rank(tp_group) == dst
    local = param.detach().contiguous()
    if tp_size == 1 or rule.shard is mapping.Shard.REPLICATED:
        return lambda: local if receiving else None  # every TP rank holds it whole: nothing to gather
    if dst is not None:
        return _gather_to(rule, local, tp_group, tp_size, dst, receiving, out, tag)
    if rule.shard in (mapping.Shard.COLUMN, mapping.Shard.VOCAB):
        full = out if out is not None else torch.empty((local.shape[0] * tp_size, *local.shape[1:]),
                                                       dtype=local.dtype, device=local.device)
        torch.distributed.all_gather(list(full.chunk(tp_size, dim=0)), local, group=tp_group)  # in place
        return lambda: full
    pieces = [torch.empty_like(local) for _ in range(tp_size)]
    torch.distributed.all_gather(pieces, local, group=tp_group)
    full = mapping.unshard(rule.shard, pieces)
    return lambda: full


def _gather_to(rule: mapping.BoundRule, local: torch.Tensor, tp_group, tp_size: int, dst: int,
               receiving: bool, out: torch.Tensor | None = None, tag: int = 0) -> Callable[[], torch.Tensor | None]:
    """Start moving the shards to TP rank ``dst``, point to point; returns the wait (the full tensor on ``dst``).

    Gloo's ``gather`` moves 0.14-0.55 GB/s between two local processes where ``send``/``recv`` move
    1.6 GB/s (measured on the 2-core box, 64 MB tensors), and it needs the pieces apart from the full
    tensor. Here each shard lands in its final place: row blocks of the full tensor for column and vocab
    shards, and for gated (``[gate_i; up_i]``) shards the two halves land in the gate and the up blocks,
    so no concatenation follows; row shards (split along dim 1) are received apart and concatenated.
    Waiting is left to the caller so that the next tensors' transfers are posted before this one is
    waited for: one transfer per tensor, each waited for before the next is posted, left the link idle
    between them (a 4 MB send/recv moves 1 GB/s here, a 128 MB one 3.5 GB/s).
    """
    me = torch.distributed.get_rank(tp_group)
    halves = rule.shard is mapping.Shard.GATED
    parts = list(local.chunk(2, dim=0)) if halves else [local]
    full = pieces = None
    if receiving:
        if rule.shard is mapping.Shard.ROW:
            pieces = [local if i == me else torch.empty_like(local) for i in range(tp_size)]
            dests = [[p] for p in pieces]
        else:
            full = out if out is not None else torch.empty((local.shape[0] * tp_size, *local.shape[1:]),
                                                           dtype=local.dtype, device=local.device)
            blocks = full.chunk(2 * tp_size if halves else tp_size, dim=0)
            dests = [[blocks[i], blocks[tp_size + i]] if halves else [blocks[i]] for i in range(tp_size)]
            for dest, part in zip(dests[me], parts):
                dest.copy_(part)
        ops = [torch.distributed.P2POp(torch.distributed.irecv, d, group=tp_group, group_peer=i, tag=tag + k)
               for i in range(tp_size) if i != me for k, d in enumerate(dests[i])]
    else:
        ops = [torch.distributed.P2POp(torch.distributed.isend, p, group=tp_group, group_peer=dst, tag=tag + k)
               for k, p in enumerate(parts)]
    works = torch.distributed.batch_isend_irecv(ops)

    def wait() -> torch.Tensor | None:
        for work in works:
            work.wait()
        if not receiving:
            return None
        return full if full is not None else mapping.unshard(rule.shard, pieces)

    return wait


def _hf_outputs(rule: mapping.BoundRule, cfg: ModelConfig, dtype: torch.dtype,
                aliases: Mapping[str, Sequence[str]]) -> list[tuple[str, tuple[int, ...]]]:
    shapes = rule.hf_shapes(cfg)
    out = []
    for name in rule.hf_outputs:
        out += [(n, tuple(shapes[name])) for n in (name, *aliases.get(name, ()))]
    return out


def plan_stage_buckets(rules: Sequence[mapping.BoundRule], cfg: ModelConfig, dtype: torch.dtype, bucket_bytes: int,
                       aliases: Mapping[str, Sequence[str]] = MappingProxyType({})) -> list[list[mapping.BoundRule]]:
    """Rules grouped in order into buckets of about ``bucket_bytes`` of HF output, whole layers only.

    A bucket closes only between decoder layers: vLLM reloads a fused module (qkv_proj, gate_up_proj)
    correctly only when all its parts arrive together, and its layerwise reload buffers a layer until it
    is complete. A layer larger than ``bucket_bytes`` is a bucket of its own.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    sized = [(rule.layer if rule.layer is not None else rule.megatron,
              sum(math.prod(shape) * itemsize for _, shape in _hf_outputs(rule, cfg, dtype, aliases)))
             for rule in rules]
    return [[rules[i] for i in bucket] for bucket in pack_in_order(sized, bucket_bytes)]


def _bucket_layout(bucket: Sequence[mapping.BoundRule], cfg: ModelConfig, dtype: torch.dtype,
                   aliases: Mapping[str, Sequence[str]]) -> BucketLayout:
    outputs = [item for rule in bucket for item in _hf_outputs(rule, cfg, dtype, aliases)]
    dtype_name = str(dtype).removeprefix("torch.")
    return BucketLayout(tuple(name for name, _ in outputs), tuple(tuple(shape) for _, shape in outputs),
                        (dtype_name,) * len(outputs))


def max_bucket_bytes(cfg: ModelConfig, pp_size: int, dtype: torch.dtype, bucket_bytes: int,
                     aliases: Mapping[str, Sequence[str]] = MappingProxyType({})) -> int:
    """The largest packed bucket any stage builds (a reusable send buffer's size)."""
    bound = mapping.bind_table(cfg)
    sizes = [0]
    for stage in range(pp_size):
        rules = [r for r in mapping.rules_for_stage(bound, cfg, stage, pp_size) if r.hf_outputs]
        sizes += [_bucket_layout(b, cfg, dtype, aliases).nbytes for b in plan_stage_buckets(rules, cfg, dtype,
                                                                                            bucket_bytes, aliases)]
    return max(sizes)


def stage_hf_buckets(models, cfg: ModelConfig, bucket_bytes: int, *, tp_group, pp_rank: int, pp_size: int,
                     dst: int | None = None, dtype: torch.dtype | None = None,
                     aliases: Mapping[str, Sequence[str]] = MappingProxyType({}), buffer: torch.Tensor | None = None,
                     pool: BufferPool | None = None, ep_group=None
                     ) -> Iterator[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]] | None]:
    """This pipeline stage's HF tensors, one packed bucket at a time (collective over the TP group).

    Per bucket: each tensor's TP shards are gathered on TP rank ``dst`` of ``tp_group`` (every TP rank when
    None), mapped through the conversion table and copied into one flat ``uint8`` buffer that holds the
    bucket's HF tensors back to back: ``buffer[:n]`` when one reusable ``buffer`` is given (the IPC
    buffer), a buffer of ``pool`` when given (reused once the consumer dropped the bucket: a sender
    packs bucket k+1 into one buffer while k travels from the other), a new one otherwise. The gathered
    tensor is dropped before the next. Yields ``(flat, [(hf_name, view of flat)])`` on the receiving
    ranks and ``None`` on the others (they only contributed shards). ``aliases`` names extra copies of a
    tensor (e.g. ``{"model.embed_tokens.weight": ["lm_head.weight"]}``). The gathers of the next
    ``GATHERS_IN_FLIGHT`` tensors are posted before a tensor is waited for and copied. Memory on a
    receiving rank: the bucket plus the pieces of the tensors in flight (row shards and fused q/k/v, which
    cannot be gathered in place) and one full tensor while unsharding.

    Expert parallelism (``ep_group``: the EP group of this rank, whose TP group must also be its expert-TP
    group). With a ``dst`` nothing crosses the EP group: the buckets are planned as at EP 1 (whole layers,
    the same on every EP rank), and each EP rank's TP rank ``dst`` builds its part of each, its own
    experts and on EP rank 0 every tensor that is not an expert. The parts of bucket k together are
    bucket k. Every rank yields once per planned bucket, ``None`` where it has nothing of that bucket,
    so the EP ranks' senders can take turns bucket by bucket. With ``dst=None`` every rank of the EP
    group gets every whole bucket (each expert broadcast from its owner, `_share_expert`).
    """
    tp_size = torch.distributed.get_world_size(tp_group)
    ep_size = 1 if ep_group is None else torch.distributed.get_world_size(ep_group)
    ep_rank = 0 if ep_group is None else torch.distributed.get_rank(ep_group)
    own = ep_size > 1 and dst is not None  # each EP rank its own part of every bucket
    receiving = dst is None or torch.distributed.get_rank(tp_group) == dst
    params = stage_parameters(models, cfg, pp_rank, pp_size, ep_rank, ep_size)
    rules = [r for r in mapping.rules_for_stage(mapping.bind_table(cfg), cfg, pp_rank, pp_size) if r.hf_outputs]
    if not rules:
        return
    _check_expert_params(rules, params, cfg, tp_size, ep_size, pp_rank)
    some = next(params[r.megatron] for r in rules if r.megatron in params)
    dtype = dtype or some.dtype
    device = some.device
    for bucket in plan_stage_buckets(rules, cfg, dtype, bucket_bytes, aliases):
        named = flat = views = out = wait = None  # this generator's references to the previous bucket (pool reuse)
        if own:  # this EP rank's part: its experts, and on EP rank 0 the rest
            bucket = [r for r in bucket if (r.expert is None and ep_rank == 0)
                      or (r.expert is not None and mapping.expert_rank(r, cfg, ep_size) == ep_rank)]
            if not bucket:
                yield None
                continue
        layout = _bucket_layout(bucket, cfg, dtype, aliases)
        nbytes = layout.nbytes
        if receiving:
            if buffer is not None and buffer.numel() < nbytes:
                raise ValueError(f"the send buffer holds {buffer.numel()} bytes, a bucket needs {nbytes}")
            if buffer is not None:
                flat = buffer[:nbytes]
            elif pool is not None:
                flat = pool.take(nbytes, device)
            else:
                flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            named = layout.views(flat)
        views = dict(named or ())
        in_flight: collections.deque = collections.deque()  # (rule, wait) of the gathers posted, in order
        for index, rule in enumerate(bucket + [None] * GATHERS_IN_FLIGHT):
            if rule is not None:
                owner = mapping.expert_rank(rule, cfg, ep_size) if ep_size > 1 and not own else None
                param = params.get(rule.megatron)
                like = param if param is not None else _stand_in(rule, cfg, tp_size, some.dtype)
                out = _in_bucket(rule, views, like, cfg, tp_size) if receiving else None
                if owner is not None:
                    wait = _share_expert(rule, param, like, cfg, tp_group, tp_size, out, ep_group, owner, device)
                else:
                    wait = _gather_full(rule, param, tp_group, tp_size, dst, out, tag=2 * index)
                in_flight.append((rule, wait))
            if len(in_flight) <= GATHERS_IN_FLIGHT and rule is not None:
                continue
            if not in_flight:
                break
            done, wait = in_flight.popleft()
            full = wait()
            if full is None:
                continue
            for name, tensor in done.to_hf(full, cfg).items():
                for target in (name, *aliases.get(name, ())):
                    if views[target].data_ptr() != tensor.data_ptr():  # gathered in place: already there
                        views[target].copy_(tensor)
            del full, tensor
        yield (flat, named) if receiving else None


def _check_expert_params(rules: Sequence[mapping.BoundRule], params: Mapping[str, torch.Tensor], cfg: ModelConfig,
                         tp_size: int, ep_size: int, pp_rank: int) -> None:
    """Every expert tensor is here, or on another rank of the EP group; expert shards split as TP shards."""
    for rule in rules:
        if rule.expert is None:
            continue
        param = params.get(rule.megatron)
        if param is None and ep_size == 1:
            raise ValueError(
                f"{cfg.name}: stage {pp_rank} of this rank holds only some of the experts ({rule.megatron} is "
                f"absent): the model has expert parallelism, pass its expert-parallel group (ep_group)")
        if param is not None and tuple(param.shape) != rule.shard_shape(cfg, tp_size):
            raise NotImplementedError(
                f"{cfg.name}: expert tensor {rule.megatron} has shape {list(param.shape)}, not the tensor-parallel "
                f"shard {list(rule.shard_shape(cfg, tp_size))}: streaming HF weights needs "
                f"actor.expert_tensor_parallel equal to actor.tensor_parallel (or null)")


def _stand_in(rule: mapping.BoundRule, cfg: ModelConfig, tp_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Shape and dtype of a TP shard of ``rule`` that lives on another EP rank (no memory: the meta device)."""
    return torch.empty(rule.shard_shape(cfg, tp_size), dtype=dtype, device="meta")


def _share_expert(rule: mapping.BoundRule, param: torch.Tensor | None, like: torch.Tensor, cfg: ModelConfig,
                  tp_group, tp_size: int, out: torch.Tensor | None, ep_group, owner: int,
                  device: torch.device) -> Callable[[], torch.Tensor]:
    """Start bringing one expert tensor to every rank of the EP group; returns the wait.

    The owning EP rank (``owner``) all-gathers its TP shards as `_gather_full` does, then broadcasts the
    full tensor over the EP group. The broadcast runs inside the wait, which every rank calls in bucket
    order, so the EP group's collectives keep one order on all its ranks.
    """
    if torch.distributed.get_rank(ep_group) == owner:
        gathered = _gather_full(rule, param, tp_group, tp_size, None, out)

        def share() -> torch.Tensor:
            full = gathered().contiguous()
            torch.distributed.broadcast(full, group=ep_group, group_src=owner)
            return full
        return share
    full = out if out is not None else torch.empty(rule.megatron_shape(cfg, tp_size), dtype=like.dtype, device=device)

    def shared() -> torch.Tensor:
        torch.distributed.broadcast(full, group=ep_group, group_src=owner)
        return full
    return shared


IN_PLACE_RULES = (mapping.Copy, mapping.FusedGateUp, mapping.VocabEmbedding)


def _in_bucket(rule: mapping.BoundRule, views: Mapping[str, torch.Tensor], param: torch.Tensor, cfg: ModelConfig,
               tp_size: int) -> torch.Tensor | None:
    """Where the full tensor can be gathered straight into the bucket: its HF outputs, back to back in the
    bucket, are its bytes in order (a copy; [gate; up]; an embedding without vocab padding) in its dtype.

    Then the bucket is the only memory a gathered tensor takes (row shards and fused q/k/v still
    gather apart: their HF tensors are not row blocks of the full tensor).
    """
    if (tp_size == 1 or not isinstance(rule.rule, IN_PLACE_RULES)
            or rule.shard not in (mapping.Shard.COLUMN, mapping.Shard.VOCAB, mapping.Shard.GATED)):
        return None
    outputs = [views[name] for name in rule.hf_outputs]
    if any(v.dtype != param.dtype for v in outputs):
        return None
    shape = (param.shape[0] * tp_size, *param.shape[1:])
    start = outputs[0].data_ptr()
    itemsize = param.element_size()
    if sum(v.numel() for v in outputs) != math.prod(shape):
        return None  # vocabulary padding: the HF tensor is shorter than the gathered one
    pos = start
    for view in outputs:
        if view.data_ptr() != pos:
            return None  # not back to back (an alias in between)
        pos += view.numel() * itemsize
    flat = outputs[0].view(-1)
    return flat.as_strided((math.prod(shape),), (1,)).view(shape)


def _broadcast_bucket(bucket: tuple[torch.Tensor, list] | None, src: int, group,
                      buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, list] | None:
    """Stage owner sends a packed bucket's names/shapes/dtype, then its flat bytes; others rebuild the views.

    ``None`` from the owner ends the stage. The bytes travel on the group's device: the current GPU
    under NCCL, the host under gloo.
    """
    meta = [None]
    if bucket is not None:
        meta = [BucketLayout.of(bucket[1])]
    torch.distributed.broadcast_object_list(meta, src=src, group=group)
    if meta[0] is None:
        return None
    layout = meta[0]
    nbytes = layout.nbytes
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if bucket is not None:
        flat = bucket[0] if bucket[0].device == device else bucket[0].to(device)
    elif buffer is not None:
        flat = buffer[:nbytes]
    else:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    torch.distributed.broadcast(flat, src=src, group=group)
    return bucket if bucket is not None else (flat, layout.views(flat))


def export_hf_buckets(models, model_cfg: ModelConfig, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                      tp_group=None, pp_group=None, dtype: torch.dtype | None = None,
                      aliases: Mapping[str, Sequence[str]] = MappingProxyType({}), buffer: torch.Tensor | None = None,
                      ep_group=None) -> Iterator[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]]:
    """The whole model's HF tensors as packed buckets ``(flat, [(hf_name, view)])`` on every rank.

    Collective: every rank of the TP x PP grid iterates in lockstep and gets the same sequence. Stage
    by stage, the owning stage builds each bucket (`stage_hf_buckets`, gathered on every TP rank) and
    broadcasts it to the other stages. Groups default to Megatron's parallel state. With expert
    parallelism the ranks of every EP group iterate (the data-parallel replicas that hold the other
    experts too), and all of them get every bucket.
    """
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state

    if ep_group is None and tp_group is None and model_cfg.is_moe \
            and parallel_state.get_expert_model_parallel_world_size() > 1:
        ep_group = parallel_state.get_expert_model_parallel_group()
    tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    pp_group = pp_group if pp_group is not None else parallel_state.get_pipeline_model_parallel_group()
    pp_size = torch.distributed.get_world_size(pp_group)
    pp_rank = torch.distributed.get_rank(pp_group)
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
    for stage in range(pp_size):
        if stage == pp_rank:
            for bucket in stage_hf_buckets(models, model_cfg, bucket_bytes, tp_group=tp_group, pp_rank=stage,
                                           pp_size=pp_size, dtype=dtype, aliases=aliases, buffer=buffer,
                                           ep_group=ep_group):
                yield _broadcast_bucket(bucket, pp_ranks[stage], pp_group) if pp_size > 1 else bucket
            if pp_size > 1:
                _broadcast_bucket(None, pp_ranks[stage], pp_group)  # end of stage
        else:
            while (received := _broadcast_bucket(None, pp_ranks[stage], pp_group, buffer)) is not None:
                yield received


def export_hf_weights(models, model_cfg: ModelConfig, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                      tp_group=None, pp_group=None, dtype: torch.dtype | None = None, ep_group=None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model on every rank (collective: all ranks iterate).

    The tensors are views of the current packed bucket (`export_hf_buckets`): copy one to keep it past
    the next bucket. Memory per rank: about one bucket plus the largest tensor twice.
    """
    for _, named in export_hf_buckets(models, model_cfg, bucket_bytes, tp_group=tp_group, pp_group=pp_group,
                                      dtype=dtype, ep_group=ep_group):
        yield from named
