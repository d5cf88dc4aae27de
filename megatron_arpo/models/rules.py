"""Weight-mapping rule types (HF <-> Megatron), and the decoder-layer rules the families compose their tables from.

A family's mapping table (``megatron_arpo/models/<family>.py``, ``FAMILY.table``) is an immutable tuple of
these rules. Each rule names one Megatron parameter (canonical local-spec name, ``{layer}`` standing for the
global layer index and, in mixture-of-experts tables, ``{expert}`` for the global expert index) and the HF
tensor(s) it is built from, and knows three things:

- how to build *one tensor-parallel shard* of the Megatron parameter from the HF tensors, reading only
  the rows/columns that shard needs (``read_shard``);
- how to turn the *full* (TP-unsharded) Megatron tensor back into HF tensors — the reverse direction
  comes from the same rule, never from a second table. Every reverse transform here is a permutation of
  row blocks along dim 0 (``hf_row_blocks``: which rows of the Megatron tensor make which rows of each HF
  tensor); ``to_hf`` applies it to a tensor, and ``megatron-to-hf`` applies it to the bytes on disk;
- the HF and Megatron shapes it expects (``hf_shapes``, ``megatron_shape``): the only place tensor shapes
  are written down. Coverage checks, the tiny test checkpoints and the converters all derive shapes here.

The typed transforms:

- ``Copy``: one tensor, optionally split column-parallel (dim 0) or row-parallel (dim 1).
- ``FusedQKV``: Megatron's ``linear_qkv`` is interleaved per query group,
  ``[q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]`` with an explicit ``head_dim``
  (Qwen3's head_dim is not hidden/heads), and split across TP by groups. Weight and bias (qwen2).
- ``FusedGateUp``: ``linear_fc1`` stacks gate and up; each TP shard is ``[gate shard; up shard]``, so
  the full (TP=1) tensor is ``[gate; up]`` and a TP shard is *not* a contiguous slice of it. The same
  rule maps each routed expert's gate/up (``ffn="moe_ffn"``: the expert's own width).
- ``VocabEmbedding``: embedding/output rows padded to ``padded_vocab_size(tp)`` (zeros) on import and
  trimmed on export, split vocab-parallel along rows. With ``tie_word_embeddings`` the output layer
  reads ``model.embed_tokens.weight`` and exports nothing (HF tied checkpoints have no lm_head).

Pure Python: no Megatron import, and torch only inside the functions that build tensors (the byte-copy
``megatron-to-hf`` path needs the tables, not tensors). Binding a table to a model's layers and the
converters' machinery live in :mod:`megatron_arpo.hf.mapping`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from megatron_arpo.models.config import ModelConfig

LAYER = "{layer}"
EXPERT = "{expert}"


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
        "moe_ffn": cfg.moe_intermediate_size or 0,
        "experts": cfg.num_experts or 0,
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
    # deferred: pulls in torch (heavy; this module imports without it)
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
        # deferred: pulls in torch (heavy; this module imports without it)
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
    """gate_proj/up_proj -> Megatron ``linear_fc1``; each TP shard is ``[gate shard; up shard]``.

    ``ffn`` names the width (a key of :func:`dims`): ``ffn`` for a dense MLP, ``moe_ffn`` for an expert.
    """

    megatron: str
    gate: str
    up: str
    shard: Shard = Shard.GATED
    ffn: str = "ffn"

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shape = (dims(cfg)[self.ffn], cfg.hidden_size)
        return {self.gate: shape, self.up: shape}

    def megatron_shape(self, cfg: ModelConfig, tp_size: int) -> tuple[int, ...]:
        return (2 * dims(cfg)[self.ffn], cfg.hidden_size)

    def read_shard(self, read: Reader, cfg: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch

        start, stop = _split_range(dims(cfg)[self.ffn], tp_rank, tp_size, self.megatron)
        return torch.cat([read(self.gate, 0, start, stop), read(self.up, 0, start, stop)], dim=0)

    def hf_row_blocks(self, cfg: ModelConfig) -> dict[str, list[RowBlock]]:
        ffn = dims(cfg)[self.ffn]
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
        # deferred: pulls in torch (heavy; this module imports without it)
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
# The decoder-layer rules shared by the Llama-style families (RMSNorm pre-norm, GQA attention, SwiGLU MLP).
# A family's table is a concatenation of these blocks, in Megatron's parameter order.

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

EMBEDDING = (VocabEmbedding("embedding.word_embeddings.weight", "model.embed_tokens.weight"),)
ATTENTION_IN = (
    Copy(_L + "input_layernorm.weight", _H + "input_layernorm.weight", ("hidden",)),
    FusedQKV(_L + "self_attention.linear_qkv.weight", _H + "self_attn.q_proj.weight",
             _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
)
QKV_BIAS = (
    FusedQKV(_L + "self_attention.linear_qkv.bias", _H + "self_attn.q_proj.bias",
             _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias", bias=True),
)
QK_NORM = (
    Copy(_L + "self_attention.q_layernorm.weight", _H + "self_attn.q_norm.weight", ("head_dim",)),
    Copy(_L + "self_attention.k_layernorm.weight", _H + "self_attn.k_norm.weight", ("head_dim",)),
)
ATTENTION_OUT = (
    Copy(_L + "self_attention.linear_proj.weight", _H + "self_attn.o_proj.weight", ("hidden", "q_dim"),
         Shard.ROW),
    Copy(_L + "pre_mlp_layernorm.weight", _H + "post_attention_layernorm.weight", ("hidden",)),
)
ATTENTION_OUT_MLP = ATTENTION_OUT + (
    FusedGateUp(_L + "mlp.linear_fc1.weight", _H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
    Copy(_L + "mlp.linear_fc2.weight", _H + "mlp.down_proj.weight", ("hidden", "ffn"), Shard.ROW),
)
# A mixture-of-experts MLP without shared experts (Qwen3-MoE): the router (HF ``mlp.gate``, replicated
# over TP) and each routed expert's SwiGLU MLP. Megatron's SequentialMLP names an expert by its index on
# its expert-parallel rank (``local_experts.<i>``); the table's ``{expert}`` is the global index
# (mapping.local_name converts, as it does for pipeline-local layer numbers).
_E = _L + "mlp.experts.local_experts.{expert}."
_HE = _H + "mlp.experts.{expert}."
ROUTED_EXPERTS = (
    Copy(_L + "mlp.router.weight", _H + "mlp.gate.weight", ("experts", "hidden")),
    FusedGateUp(_E + "linear_fc1.weight", _HE + "gate_proj.weight", _HE + "up_proj.weight", ffn="moe_ffn"),
    Copy(_E + "linear_fc2.weight", _HE + "down_proj.weight", ("hidden", "moe_ffn"), Shard.ROW),
)
FINAL = (
    Copy("decoder.final_layernorm.weight", "model.norm.weight", ("hidden",)),
    VocabEmbedding("output_layer.weight", "lm_head.weight", tied_hf="model.embed_tokens.weight"),
)
