"""Declarative HF <-> Megatron weight mapping tables, one per HF ``model_type``.

A table is an immutable tuple of rules. Each rule names one Megatron parameter (canonical local-spec
name, ``{layer}`` standing for the global layer index) and the HF tensor(s) it is built from, and knows
three things:

- how to build *one tensor-parallel shard* of the Megatron parameter from the HF tensors, reading only
  the rows/columns that shard needs (``read_shard``);
- how to turn the *full* (TP-unsharded) Megatron tensor back into HF tensors — the reverse direction
  comes from the same rule, never from a second table. Every reverse transform here is a permutation of
  row blocks along dim 0 (``hf_row_blocks``: which rows of the Megatron tensor make which rows of each HF
  tensor); ``to_hf`` applies it to a tensor, and ``megatron-to-hf`` applies it to the bytes on disk
  (kernel-side copies, no tensor in memory; :mod:`conversion.megatron_to_hf`);
- the HF and Megatron shapes it expects, so coverage and shapes are checked before anything is moved.

The typed transforms:

- ``Copy``: one tensor, optionally split column-parallel (dim 0) or row-parallel (dim 1).
- ``FusedQKV``: Megatron's ``linear_qkv`` is interleaved per query group,
  ``[q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]`` with an explicit ``head_dim``
  (Qwen3's head_dim is not hidden/heads), and split across TP by groups. Weight and bias (qwen2).
- ``FusedGateUp``: ``linear_fc1`` stacks gate and up; each TP shard is ``[gate shard; up shard]``, so
  the full (TP=1) tensor is ``[gate; up]`` and a TP shard is *not* a contiguous slice of it.
- ``VocabEmbedding``: embedding/output rows padded to ``padded_vocab_size(tp)`` (zeros) on import and
  trimmed on export, split vocab-parallel along rows. With ``tie_word_embeddings`` the output layer
  reads ``model.embed_tokens.weight`` and exports nothing (HF tied checkpoints have no lm_head).

Sharding lives in :func:`shard_full` / :func:`unshard` (column dim 0, row dim 1, qkv per group = dim 0
after interleave, fc1 gate/up per shard, vocab dim 0). Pure torch: no Megatron import here, and torch
itself only inside the functions that build tensors, so ``megatron-to-hf``'s byte-copy path (which needs
the tables, not tensors) runs without importing torch.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol

from megatron_arpo.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

LAYER = "{layer}"


class Shard(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"  # split dim 0 (also qkv: dim 0 after the per-group interleave)
    ROW = "row"  # split dim 1
    VOCAB = "vocab"  # split dim 0 of the padded vocab
    GATED = "gated"  # linear_fc1: each shard is [gate shard; up shard]


class Reader(Protocol):
    """Reads an HF tensor, or the rows/columns ``[start, stop)`` along ``dim`` of it."""

    def __call__(self, name: str, dim: int | None = None, start: int | None = None,
                 stop: int | None = None) -> torch.Tensor: ...


def dims(cfg: ModelConfig) -> dict[str, int]:
    """Named dimensions used by the shape specs of the rules."""
    return {
        "hidden": cfg.hidden_size,
        "ffn": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "head_dim": cfg.head_dim,
        "q_dim": cfg.num_attention_heads * cfg.head_dim,
        "kv_dim": cfg.num_key_value_heads * cfg.head_dim,
        "qkv_dim": (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim,
    }


def _resolve(shape: tuple[str, ...], cfg: ModelConfig) -> tuple[int, ...]:
    d = dims(cfg)
    return tuple(d[key] for key in shape)


# (first row in the Megatron tensor, number of rows, first row in the HF tensor), rows along dim 0.
RowBlock = tuple[int, int, int]


def take_rows(full: torch.Tensor, blocks: list[RowBlock]) -> torch.Tensor:
    """The HF tensor that ``blocks`` cut out of ``full`` (no copy when it is one leading block)."""
    import torch

    if len(blocks) == 1 and blocks[0][2] == 0:
        start, rows, _ = blocks[0]
        return full if (start, rows) == (0, full.shape[0]) else full.narrow(0, start, rows).contiguous()
    return torch.cat([full.narrow(0, start, rows) for start, rows, _ in sorted(blocks, key=lambda b: b[2])])


def _split_range(size: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    if size % tp_size:
        raise ValueError(f"{what}: dimension {size} is not divisible by tensor-parallel size {tp_size}")
    step = size // tp_size
    return tp_rank * step, (tp_rank + 1) * step


# ----------------------------------------------------------------------------------------------------
# Rules


@dataclass(frozen=True)
class Copy:
    """One HF tensor is one Megatron parameter, optionally split along dim 0 or 1."""

    megatron: str
    hf: str
    shape: tuple[str, ...]
    shard: Shard = Shard.REPLICATED

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.hf,)

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {self.hf: _resolve(self.shape, cfg)}

    def megatron_shape(self, cfg: ModelConfig, tp_size: int) -> tuple[int, ...]:
        return _resolve(self.shape, cfg)

    def read_shard(self, read: Reader, cfg: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
        if self.shard is Shard.REPLICATED or tp_size == 1:
            return read(self.hf)
        dim = 0 if self.shard is Shard.COLUMN else 1
        start, stop = _split_range(_resolve(self.shape, cfg)[dim], tp_rank, tp_size, self.megatron)
        return read(self.hf, dim, start, stop)

    def hf_row_blocks(self, cfg: ModelConfig) -> dict[str, list[RowBlock]]:
        rows = _resolve(self.shape, cfg)[0]
        return {self.hf: [(0, rows, 0)]}

    def to_hf(self, full: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        return {name: take_rows(full, b) for name, b in self.hf_row_blocks(cfg).items()}


@dataclass(frozen=True)
class FusedQKV:
    """q/k/v projections (weight or bias) -> Megatron ``linear_qkv``, interleaved per query group."""

    megatron: str
    q: str
    k: str
    v: str
    bias: bool = False
    shard: Shard = Shard.COLUMN

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        d = dims(cfg)
        tail = () if self.bias else (d["hidden"],)
        return {self.q: (d["q_dim"], *tail), self.k: (d["kv_dim"], *tail), self.v: (d["kv_dim"], *tail)}

    def megatron_shape(self, cfg: ModelConfig, tp_size: int) -> tuple[int, ...]:
        d = dims(cfg)
        return (d["qkv_dim"],) if self.bias else (d["qkv_dim"], d["hidden"])

    def read_shard(self, read: Reader, cfg: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
        import torch

        groups, head_dim = cfg.num_query_groups, cfg.head_dim
        q_per_group = cfg.num_attention_heads // groups
        g0, g1 = _split_range(groups, tp_rank, tp_size, f"{self.megatron} (query groups)")
        local = g1 - g0
        q = read(self.q, 0, g0 * q_per_group * head_dim, g1 * q_per_group * head_dim)
        k = read(self.k, 0, g0 * head_dim, g1 * head_dim)
        v = read(self.v, 0, g0 * head_dim, g1 * head_dim)
        tail = q.shape[1:]
        fused = torch.cat([q.reshape(local, q_per_group * head_dim, *tail),
                           k.reshape(local, head_dim, *tail),
                           v.reshape(local, head_dim, *tail)], dim=1)
        return fused.reshape(local * (q_per_group + 2) * head_dim, *tail)  # [groups/tp*(qpg+2)*hd, hidden]

    def hf_row_blocks(self, cfg: ModelConfig) -> dict[str, list[RowBlock]]:
        # Group g of linear_qkv is [q heads of g; k_g; v_g]: (q_per_group + 2) * head_dim rows.
        groups, head_dim = cfg.num_query_groups, cfg.head_dim
        q_rows = cfg.num_attention_heads // groups * head_dim
        group_rows = q_rows + 2 * head_dim
        return {self.q: [(g * group_rows, q_rows, g * q_rows) for g in range(groups)],
                self.k: [(g * group_rows + q_rows, head_dim, g * head_dim) for g in range(groups)],
                self.v: [(g * group_rows + q_rows + head_dim, head_dim, g * head_dim) for g in range(groups)]}

    def to_hf(self, full: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        return {name: take_rows(full, b) for name, b in self.hf_row_blocks(cfg).items()}


@dataclass(frozen=True)
class FusedGateUp:
    """gate_proj/up_proj -> Megatron ``linear_fc1``; each TP shard is ``[gate shard; up shard]``."""

    megatron: str
    gate: str
    up: str
    shard: Shard = Shard.GATED

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shape = (cfg.intermediate_size, cfg.hidden_size)
        return {self.gate: shape, self.up: shape}

    def megatron_shape(self, cfg: ModelConfig, tp_size: int) -> tuple[int, ...]:
        return (2 * cfg.intermediate_size, cfg.hidden_size)

    def read_shard(self, read: Reader, cfg: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
        import torch

        start, stop = _split_range(cfg.intermediate_size, tp_rank, tp_size, self.megatron)
        return torch.cat([read(self.gate, 0, start, stop), read(self.up, 0, start, stop)], dim=0)

    def hf_row_blocks(self, cfg: ModelConfig) -> dict[str, list[RowBlock]]:
        ffn = cfg.intermediate_size
        return {self.gate: [(0, ffn, 0)], self.up: [(ffn, ffn, 0)]}

    def to_hf(self, full: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        return {name: take_rows(full, b) for name, b in self.hf_row_blocks(cfg).items()}


@dataclass(frozen=True)
class VocabEmbedding:
    """Embedding or output layer: rows padded to ``padded_vocab_size(tp)``, vocab-parallel on rows.

    ``tied_hf`` names the HF tensor the output layer shares when ``tie_word_embeddings`` is set; the
    rule then reads that tensor (already consumed by the embedding) and exports nothing.
    """

    megatron: str
    hf: str
    tied_hf: str | None = None
    shard: Shard = Shard.VOCAB

    def is_tied(self, cfg: ModelConfig) -> bool:
        return self.tied_hf is not None and cfg.tie_word_embeddings

    def source(self, cfg: ModelConfig) -> str:
        return self.tied_hf if self.is_tied(cfg) else self.hf

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.hf,)

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {self.source(cfg): (cfg.vocab_size, cfg.hidden_size)}

    def megatron_shape(self, cfg: ModelConfig, tp_size: int) -> tuple[int, ...]:
        return (cfg.padded_vocab_size(tp_size), cfg.hidden_size)

    def read_shard(self, read: Reader, cfg: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
        import torch

        padded = cfg.padded_vocab_size(tp_size)
        start, stop = _split_range(padded, tp_rank, tp_size, self.megatron)
        real_stop = min(stop, cfg.vocab_size)
        rows = read(self.source(cfg), 0, start, real_stop) if start < real_stop else None
        if rows is not None and real_stop == stop:
            return rows
        dtype = rows.dtype if rows is not None else torch.float32
        out = torch.zeros(stop - start, cfg.hidden_size, dtype=dtype)
        if rows is not None:
            out[: rows.shape[0]] = rows
        return out

    def hf_row_blocks(self, cfg: ModelConfig) -> dict[str, list[RowBlock]]:
        return {} if self.is_tied(cfg) else {self.hf: [(0, cfg.vocab_size, 0)]}  # padding rows dropped

    def to_hf(self, full: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        blocks = self.hf_row_blocks(cfg)
        if blocks and full.shape[0] < cfg.vocab_size:
            raise ValueError(f"{self.megatron}: {full.shape[0]} rows, fewer than vocab_size {cfg.vocab_size}")
        return {name: take_rows(full, b) for name, b in blocks.items()}


Rule = Copy | FusedQKV | FusedGateUp | VocabEmbedding


# ----------------------------------------------------------------------------------------------------
# Tables

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

_EMBEDDING = (VocabEmbedding("embedding.word_embeddings.weight", "model.embed_tokens.weight"),)
_ATTN_IN = (
    Copy(_L + "input_layernorm.weight", _H + "input_layernorm.weight", ("hidden",)),
    FusedQKV(_L + "self_attention.linear_qkv.weight", _H + "self_attn.q_proj.weight",
             _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
)
_QKV_BIAS = (
    FusedQKV(_L + "self_attention.linear_qkv.bias", _H + "self_attn.q_proj.bias",
             _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias", bias=True),
)
_QK_NORM = (
    Copy(_L + "self_attention.q_layernorm.weight", _H + "self_attn.q_norm.weight", ("head_dim",)),
    Copy(_L + "self_attention.k_layernorm.weight", _H + "self_attn.k_norm.weight", ("head_dim",)),
)
_ATTN_OUT_MLP = (
    Copy(_L + "self_attention.linear_proj.weight", _H + "self_attn.o_proj.weight", ("hidden", "q_dim"),
         Shard.ROW),
    Copy(_L + "pre_mlp_layernorm.weight", _H + "post_attention_layernorm.weight", ("hidden",)),
    FusedGateUp(_L + "mlp.linear_fc1.weight", _H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
    Copy(_L + "mlp.linear_fc2.weight", _H + "mlp.down_proj.weight", ("hidden", "ffn"), Shard.ROW),
)
_FINAL = (
    Copy("decoder.final_layernorm.weight", "model.norm.weight", ("hidden",)),
    VocabEmbedding("output_layer.weight", "lm_head.weight", tied_hf="model.embed_tokens.weight"),
)

MAPPING_TABLES: Mapping[str, tuple[Rule, ...]] = MappingProxyType({
    "qwen3": _EMBEDDING + _ATTN_IN + _QK_NORM + _ATTN_OUT_MLP + _FINAL,
    "qwen2": _EMBEDDING + _ATTN_IN + _QKV_BIAS + _ATTN_OUT_MLP + _FINAL,
})

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear; Megatron's
# dist-checkpoint keys use these names for both specs.
TE_ALIASES: Mapping[str, str] = MappingProxyType({
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
})
_FROM_TE = {te: local for local, te in TE_ALIASES.items()}


def get_table(model_type: str) -> tuple[Rule, ...]:
    try:
        return MAPPING_TABLES[model_type]
    except KeyError:
        raise ValueError(
            f"no weight mapping for model_type {model_type!r}; supported model types: {sorted(MAPPING_TABLES)}"
        ) from None


@dataclass(frozen=True)
class BoundRule:
    """A rule with ``{layer}`` filled in: the unit every converter path iterates over."""

    rule: Rule
    layer: int | None  # global layer index, None for embedding / final norm / output
    megatron: str
    hf_sources: tuple[str, ...]  # HF tensors read on import (tied output reads the embedding)
    hf_outputs: tuple[str, ...]  # HF tensors produced on export

    @property
    def shard(self) -> Shard:
        return self.rule.shard

    def fill(self, name: str) -> str:
        return name.replace(LAYER, str(self.layer)) if self.layer is not None else name

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


def bind_table(cfg: ModelConfig) -> list[BoundRule]:
    """Expand the table of ``cfg.model_type`` over the layers, in Megatron order (embedding first)."""
    bound = []
    for rule in get_table(cfg.model_type):
        layers: Iterable[int | None] = range(cfg.num_hidden_layers) if LAYER in rule.megatron else (None,)
        for layer in layers:
            def fill(name: str) -> str:
                return name.replace(LAYER, str(layer)) if layer is not None else name
            if isinstance(rule, VocabEmbedding):
                sources = (fill(rule.source(cfg)),)
                outputs = () if rule.is_tied(cfg) else (fill(rule.hf),)
            else:
                sources = outputs = tuple(fill(s) for s in rule.sources)
            bound.append(BoundRule(rule, layer, fill(rule.megatron), sources, outputs))
    return bound


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


def canonical_megatron_name(name: str, layer_offset: int = 0) -> str:
    """Canonical (local-spec, global-layer) name of a live parameter name.

    Strips DDP/Float16 wrappers (``module.``), maps TE fused-norm names to the local-spec names and
    shifts the stage-local layer number by ``layer_offset`` (Megatron numbers layers per PP stage).
    """
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


def local_name(rule: BoundRule, cfg: ModelConfig, pp_rank: int, pp_size: int) -> str:
    if rule.layer is None:
        return rule.megatron
    offset = stage_layers(cfg, pp_rank, pp_size).start
    return rule.megatron.replace(f"decoder.layers.{rule.layer}.", f"decoder.layers.{rule.layer - offset}.", 1)


def hf_to_megatron_states(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_size: int,
                          pp_size: int) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """``{(pp_rank, tp_rank): {megatron_name: shard}}`` for every rank (tied output kept on PP>1)."""
    bound = bind_table(cfg)
    check_hf_coverage(bound, hf.keys(), "HF state dict")
    check_hf_shapes(bound, cfg, {k: tuple(v.shape) for k, v in hf.items()}, "HF state dict")
    read = tensor_reader(hf)
    states: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for pp_rank in range(pp_size):
        for rule in rules_for_stage(bound, cfg, pp_rank, pp_size):
            if is_shared_output(rule, cfg, pp_size):
                continue
            for tp_rank in range(tp_size):
                states.setdefault((pp_rank, tp_rank), {})[local_name(rule, cfg, pp_rank, pp_size)] = (
                    rule.read_shard(read, cfg, tp_rank, tp_size).clone())
    return states


def megatron_states_to_hf(states: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], cfg: ModelConfig,
                          tp_size: int, pp_size: int) -> dict[str, torch.Tensor]:
    bound = bind_table(cfg)
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp_size):
        for rule in rules_for_stage(bound, cfg, pp_rank, pp_size):
            if not rule.hf_outputs:
                continue
            name = local_name(rule, cfg, pp_rank, pp_size)
            shards = [states[(pp_rank, tp_rank)][name] for tp_rank in range(tp_size)]
            out.update(rule.to_hf(unshard(rule.shard, shards), cfg))
    return out


def is_shared_output(rule: BoundRule, cfg: ModelConfig, pp_size: int) -> bool:
    """With tied embeddings and one pipeline stage Megatron has no separate ``output_layer.weight``."""
    return (isinstance(rule.rule, VocabEmbedding) and rule.rule.is_tied(cfg) and pp_size == 1
            and rule.megatron == "output_layer.weight")
