"""Binding the model families' weight-mapping tables to a model, and the converters' shared machinery.

The tables themselves live with their families (``megatron_arpo/models/<model_type>.py``, ``FAMILY.table``,
found through :mod:`megatron_arpo.models.registry`), written with the rule types of
:mod:`megatron_arpo.models.rules` (``Copy``, ``FusedQKV``, ``FusedGateUp``, ``VocabEmbedding``; re-exported
here). Every reverse transform is a permutation of row blocks along dim 0 (``hf_row_blocks``), which
``megatron-to-hf`` applies to the bytes on disk (:mod:`conversion.megatron_to_hf`). This module expands a
table over a model's layers (:func:`bind_table`), assigns rules to pipeline stages, checks coverage and
shapes both ways, maps live (TE / DDP-wrapped, stage-local) parameter names to the canonical ones, and
shards / unshards full tensors for tensor parallelism: column dim 0, row dim 1, qkv per group = dim 0
after interleave, fc1 gate/up per shard, vocab dim 0. Pure torch: no Megatron import, and torch itself only
inside the functions that build tensors, so ``megatron-to-hf``'s byte-copy path runs without importing torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from megatron_arpo.model_config import ModelConfig, check_hf_config, read_hf_config
from megatron_arpo.parallel_layout import model_layout_errors
from megatron_arpo.models.registry import get_family
from megatron_arpo.models.rules import (  # noqa: F401  (re-exported: the converters' vocabulary)
    EXPERT,
    LAYER,
    Copy,
    FusedGateUp,
    FusedQKV,
    Reader,
    RowBlock,
    Rule,
    Shard,
    VocabEmbedding,
    dims,
    take_rows,
)

if TYPE_CHECKING:
    import torch

    from megatron_arpo.hf.checkpoint_io import HFCheckpointReader

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear; Megatron's
# dist-checkpoint keys use these names for both specs.
TE_ALIASES: Mapping[str, str] = MappingProxyType({
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
})
_FROM_TE = {te: local for local, te in TE_ALIASES.items()}


def get_table(model_type: str) -> tuple[Rule, ...]:
    """The weight-mapping table of ``model_type`` (its family's ``FAMILY.table``)."""
    return get_family(model_type).table


@dataclass(frozen=True)
class BoundRule:
    """A rule with ``{layer}`` (and ``{expert}``) filled in: the unit every converter path iterates over."""

    rule: Rule
    layer: int | None  # global layer index, None for embedding / final norm / output
    megatron: str
    hf_sources: tuple[str, ...]  # HF tensors read on import (tied output reads the embedding)
    hf_outputs: tuple[str, ...]  # HF tensors produced on export
    expert: int | None = None  # global expert index of a routed expert's rule

    @property
    def shard(self) -> Shard:
        return self.rule.shard

    def fill(self, name: str) -> str:
        return fill_name(name, self.layer, self.expert)

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {self.fill(k): v for k, v in self.rule.hf_shapes(cfg).items()}

    def megatron_shape(self, cfg: ModelConfig, tp_size: int) -> tuple[int, ...]:
        return self.rule.megatron_shape(cfg, tp_size)

    def shard_shape(self, cfg: ModelConfig, tp_size: int) -> tuple[int, ...]:
        shape = list(self.megatron_shape(cfg, tp_size))
        if self.shard in (Shard.COLUMN, Shard.VOCAB, Shard.GATED):
            shape[0] //= tp_size
        elif self.shard is Shard.ROW:
            shape[1] //= tp_size
        return tuple(shape)

    def read_shard(self, read: Reader, cfg: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
        def filled(name, *args):
            return read(self.fill(name), *args)
        return self.rule.read_shard(filled, cfg, tp_rank, tp_size)

    def to_hf(self, full: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        return {self.fill(k): v for k, v in self.rule.to_hf(full, cfg).items()}

    def hf_row_blocks(self, cfg: ModelConfig) -> dict[str, list[RowBlock]]:
        return {self.fill(k): v for k, v in self.rule.hf_row_blocks(cfg).items()}


def fill_name(name: str, layer: int | None, expert: int | None = None) -> str:
    if layer is not None:
        name = name.replace(LAYER, str(layer))
    return name.replace(EXPERT, str(expert)) if expert is not None else name


def bind_table(cfg: ModelConfig) -> list[BoundRule]:
    """Expand the table of ``cfg.model_type`` over the layers (and the experts of an expert rule), in
    Megatron order (embedding first)."""
    bound = []
    for rule in get_table(cfg.model_type):
        layers: Iterable[int | None] = range(cfg.num_hidden_layers) if LAYER in rule.megatron else (None,)
        experts: Iterable[int | None] = range(cfg.num_experts or 0) if EXPERT in rule.megatron else (None,)
        for layer in layers:
            for expert in experts:
                if isinstance(rule, VocabEmbedding):
                    sources = (fill_name(rule.source(cfg), layer),)
                    outputs = () if rule.is_tied(cfg) else (fill_name(rule.hf, layer),)
                else:
                    sources = outputs = tuple(fill_name(s, layer, expert) for s in rule.sources)
                bound.append(BoundRule(rule, layer, fill_name(rule.megatron, layer, expert), sources, outputs,
                                       expert))
    return bound


def check_layout(cfg: ModelConfig, tp: int, pp: int, command: str) -> None:
    """Refuse a ``--tp``/``--pp`` the model cannot take, naming the values it can (no Megatron import)."""
    errors = model_layout_errors(cfg, tp, pp, section=command)
    if errors:
        raise ValueError("; ".join(errors) + " (set with --tp / --pp)")


def stage_layers(cfg: ModelConfig, pp_rank: int, pp_size: int) -> range:
    if cfg.num_hidden_layers % pp_size:
        raise ValueError(
            f"{cfg.name}: num_hidden_layers {cfg.num_hidden_layers} is not divisible by pipeline-parallel "
            f"size {pp_size}; choose a pipeline size that divides it"
        )
    per_stage = cfg.num_hidden_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def rules_for_stage(bound: list[BoundRule], cfg: ModelConfig, pp_rank: int, pp_size: int) -> list[BoundRule]:
    """The rules whose Megatron parameter lives on pipeline stage ``pp_rank``."""
    layers = stage_layers(cfg, pp_rank, pp_size)
    out = []
    for rule in bound:
        if rule.layer is not None:
            keep = rule.layer in layers
        elif rule.megatron.startswith("embedding."):
            keep = pp_rank == 0
        else:
            keep = pp_rank == pp_size - 1
        if keep:
            out.append(rule)
    return out


# ----------------------------------------------------------------------------------------------------
# Names: live model parameter names <-> canonical rule names

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


_LOCAL_EXPERT_RE = re.compile(r"\.local_experts\.(\d+)\.")


def canonical_megatron_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Canonical (local-spec, global-layer, global-expert) name of a live parameter name.

    Strips DDP/Float16 wrappers (``module.``), maps TE fused-norm names to the local-spec names and
    shifts the stage-local layer number by ``layer_offset`` (Megatron numbers layers per PP stage) and an
    EP-rank-local expert index by ``expert_offset`` (``ep_rank * num_experts / ep``).
    """
    if expert_offset:
        name = _LOCAL_EXPERT_RE.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name, count=1)
    while name.startswith("module."):
        name = name[len("module."):]
    match = _LAYER_RE.match(name)
    if not match:
        return name
    local, rest = match.groups()
    rest = _FROM_TE.get(rest, rest)
    return f"decoder.layers.{int(local) + layer_offset}.{rest}"


def _names(names: Iterable[str], limit: int = 20) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_hf_coverage(bound: list[BoundRule], hf_names: Iterable[str], where: str) -> None:
    """Every HF tensor consumed and every needed HF tensor present; raise naming the offenders."""
    hf_names = set(hf_names)
    needed = {name for rule in bound for name in rule.hf_sources}
    missing = needed - hf_names
    extra = hf_names - needed
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s) the mapping needs: {_names(missing)}")
    if extra:
        problems.append(f"{len(extra)} tensor(s) no mapping rule consumes: {_names(extra)}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems)
                         + ". Check that the checkpoint matches the model config (layers, tying, model_type).")


def check_hf_shapes(bound: list[BoundRule], cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]],
                    where: str) -> None:
    bad = []
    for rule in bound:
        for name, expected in rule.hf_shapes(cfg).items():
            got = tuple(shapes[name])
            if got != expected:
                bad.append(f"{name}: expected shape {list(expected)}, got {list(got)}")
    if bad:
        raise ValueError(f"{where}: {len(bad)} tensor(s) have the wrong shape for model config "
                         f"{cfg.name!r}:\n  " + "\n  ".join(bad[:20]))


def check_megatron_coverage(rules: list[BoundRule], param_names: Iterable[str], where: str,
                            optional: Callable[[BoundRule], bool] = lambda r: False) -> None:
    """Every live parameter has a rule and every rule of the stage has a parameter."""
    param_names = set(param_names)
    produced = {rule.megatron for rule in rules}
    unmapped = param_names - produced
    absent = {rule.megatron for rule in rules if rule.megatron not in param_names and not optional(rule)}
    problems = []
    if unmapped:
        problems.append(f"{len(unmapped)} Megatron parameter(s) no rule produces: {_names(unmapped)}")
    if absent:
        problems.append(f"{len(absent)} mapped parameter(s) missing from the model: {_names(absent)}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------
# TP sharding of full Megatron tensors


def shard_full(kind: Shard, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The ``tp_rank`` shard of a full (TP-unsharded, canonical) Megatron tensor."""
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    if kind is Shard.REPLICATED or tp_size == 1:
        return full
    if kind in (Shard.COLUMN, Shard.VOCAB):
        return torch.chunk(full, tp_size, dim=0)[tp_rank]
    if kind is Shard.ROW:
        return torch.chunk(full, tp_size, dim=1)[tp_rank]
    gate, up = torch.chunk(full, 2, dim=0)
    return torch.cat([torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]])


def unshard(kind: Shard, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard_full` given all TP shards in rank order."""
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    if kind is Shard.REPLICATED or len(shards) == 1:
        return shards[0]
    if kind in (Shard.COLUMN, Shard.VOCAB):
        return torch.cat(shards, dim=0)
    if kind is Shard.ROW:
        return torch.cat(shards, dim=1)
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def tensor_reader(tensors: Mapping[str, torch.Tensor]) -> Reader:
    """A :class:`Reader` over in-memory tensors (tests, the in-process round trip)."""
    def read(name, dim=None, start=None, stop=None):
        t = tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)
    return read


# ----------------------------------------------------------------------------------------------------
# In-memory conversion of a whole model (tests, small models): per-(pp, tp) rank state dicts with
# stage-local layer numbers, exactly as a live Megatron model names its parameters (local spec).


def experts_per_rank(cfg: ModelConfig, ep_size: int) -> int:
    if not cfg.num_experts or cfg.num_experts % ep_size:
        raise ValueError(f"{cfg.name}: num_experts {cfg.num_experts} is not divisible by expert-parallel size "
                         f"{ep_size}; choose an expert-parallel size that divides it")
    return cfg.num_experts // ep_size


def expert_rank(rule: BoundRule, cfg: ModelConfig, ep_size: int) -> int | None:
    """The expert-parallel rank that holds ``rule``'s expert (None: not an expert rule, every rank)."""
    return None if rule.expert is None else rule.expert // experts_per_rank(cfg, ep_size)


def local_name(rule: BoundRule, cfg: ModelConfig, pp_rank: int, pp_size: int, ep_size: int = 1) -> str:
    """The name a live model gives ``rule``'s parameter: stage-local layer, and EP-rank-local expert index."""
    if rule.layer is None:
        return rule.megatron
    offset = stage_layers(cfg, pp_rank, pp_size).start
    name = rule.megatron.replace(f"decoder.layers.{rule.layer}.", f"decoder.layers.{rule.layer - offset}.", 1)
    if rule.expert is not None:
        local = rule.expert % experts_per_rank(cfg, ep_size)
        name = name.replace(f".local_experts.{rule.expert}.", f".local_experts.{local}.", 1)
    return name


RankKey = tuple[int, ...]  # (pp_rank, tp_rank), or (pp_rank, tp_rank, ep_rank) with expert parallelism


def hf_to_megatron_states(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_size: int,
                          pp_size: int, ep_size: int = 1) -> dict[RankKey, dict[str, torch.Tensor]]:
    """``{(pp_rank, tp_rank): {megatron_name: shard}}`` for every rank (tied output kept on PP>1).

    With ``ep_size > 1`` the keys are ``(pp_rank, tp_rank, ep_rank)``: each EP rank holds its
    ``num_experts / ep_size`` experts (expert tensor parallelism equal to ``tp_size``, Megatron's default)
    and a copy of everything else.
    """
    bound = bind_table(cfg)
    check_hf_coverage(bound, hf.keys(), "HF state dict")
    check_hf_shapes(bound, cfg, {k: tuple(v.shape) for k, v in hf.items()}, "HF state dict")
    read = tensor_reader(hf)
    states: dict[RankKey, dict[str, torch.Tensor]] = {}
    for pp_rank in range(pp_size):
        for rule in rules_for_stage(bound, cfg, pp_rank, pp_size):
            if is_shared_output(rule, cfg, pp_size):
                continue
            owner = expert_rank(rule, cfg, ep_size)
            for tp_rank in range(tp_size):
                shard = rule.read_shard(read, cfg, tp_rank, tp_size)
                for ep_rank in range(ep_size):
                    if owner is None or owner == ep_rank:
                        key = (pp_rank, tp_rank) if ep_size == 1 else (pp_rank, tp_rank, ep_rank)
                        states.setdefault(key, {})[local_name(rule, cfg, pp_rank, pp_size, ep_size)] = shard.clone()
    return states


def megatron_states_to_hf(states: Mapping[RankKey, Mapping[str, torch.Tensor]], cfg: ModelConfig,
                          tp_size: int, pp_size: int, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron_states` (non-expert tensors are read from EP rank 0)."""
    bound = bind_table(cfg)
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp_size):
        for rule in rules_for_stage(bound, cfg, pp_rank, pp_size):
            if not rule.hf_outputs:
                continue
            name = local_name(rule, cfg, pp_rank, pp_size, ep_size)
            ep_rank = expert_rank(rule, cfg, ep_size) or 0
            keys = [(pp_rank, tp_rank) if ep_size == 1 else (pp_rank, tp_rank, ep_rank) for tp_rank in range(tp_size)]
            out.update(rule.to_hf(unshard(rule.shard, [states[key][name] for key in keys]), cfg))
    return out


def is_shared_output(rule: BoundRule, cfg: ModelConfig, pp_size: int) -> bool:
    """With tied embeddings and one pipeline stage Megatron has no separate ``output_layer.weight``."""
    return (isinstance(rule.rule, VocabEmbedding) and rule.rule.is_tied(cfg) and pp_size == 1
            and rule.megatron == "output_layer.weight")


def validate_hf_checkpoint(reader: HFCheckpointReader, cfg: ModelConfig, check_config: bool = True) -> list:
    """Config, coverage and shape checks on an HF checkpoint; returns the bound table."""
    if check_config:
        check_hf_config(cfg, read_hf_config(reader.dir), hf_where=str(reader.dir / "config.json"))
    bound = bind_table(cfg)
    check_hf_coverage(bound, reader.names(), str(reader.dir))
    check_hf_shapes(bound, cfg, reader.shapes(), str(reader.dir))
    check_hf_dtypes(reader)
    return bound


def check_hf_dtypes(reader: HFCheckpointReader) -> None:
    """All tensors must share one floating dtype; name the ones that do not."""
    by_dtype: dict[str, list[str]] = {}
    for name in reader.names():
        by_dtype.setdefault(reader.dtype(name), []).append(name)
    majority = max(by_dtype, key=lambda d: len(by_dtype[d]))
    problems = []
    if majority not in ("F32", "BF16", "F16"):
        problems.append(f"tensors are {majority}; expected a floating dtype (F32, BF16 or F16)")
    for dtype, names in sorted(by_dtype.items()):
        if dtype != majority:
            problems.append(f"{len(names)} tensor(s) are {dtype} while {len(by_dtype[majority])} are {majority}: "
                            f"{names[:10]}")
    if problems:
        raise ValueError(f"{reader.dir}: dtype mismatch: " + "; ".join(problems)
                         + ". Re-save the checkpoint in one dtype.")
