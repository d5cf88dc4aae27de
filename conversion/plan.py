"""``python -m conversion plan``: dry run of a TP x PP layout on the meta device, one process, no memory.

For every global rank of a ``tp * pp`` world, :func:`conversion.meta.fake_rank` sets up Megatron's parallel
state over torch's fake process group and :func:`conversion.meta.build_meta_gpt_model` builds that
rank's real GPTModel on the meta device. The mapping table is then checked against it: every parameter
of the rank is produced by exactly one rule, every rule of the stage has its parameter (the tied output
layer of a single-stage model excepted), and each parameter's shape equals the shard shape the rule
produces. Prints per-rank parameter counts and bytes (in the model config's dtype).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from conversion.meta import build_meta_gpt_model, fake_rank
from megatron_arpo.hf import mapping
from megatron_arpo.hf.checkpoint_io import torch_dtype
from megatron_arpo.model_config import ModelConfig

logger = logging.getLogger(__name__)


def plan_rank(cfg: ModelConfig, tp: int, pp: int, rank: int) -> dict:
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state as ps

    with fake_rank(rank, tp, pp):
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        model = build_meta_gpt_model(cfg, tp, pp)
        offset = mapping.stage_layers(cfg, pp_rank, pp).start
        params = {mapping.canonical_megatron_name(n, offset): p for n, p in model.named_parameters()}
    rules = mapping.rules_for_stage(mapping.bind_table(cfg), cfg, pp_rank, pp)
    problems = []
    try:
        mapping.check_megatron_coverage(
            rules, params, f"rank {rank}",
            optional=lambda r: mapping.is_shared_output(r, cfg, pp))
    except ValueError as exc:
        problems.append(str(exc))
    for rule in rules:
        param = params.get(rule.megatron)
        if param is not None and tuple(param.shape) != rule.shard_shape(cfg, tp):
            problems.append(f"rank {rank}: {rule.megatron} is {list(param.shape)} in Megatron, the mapping "
                            f"makes {list(rule.shard_shape(cfg, tp))}")
    numel = sum(p.numel() for p in params.values())
    layers = mapping.stage_layers(cfg, pp_rank, pp)
    return {"rank": rank, "tp_rank": tp_rank, "pp_rank": pp_rank, "layers": f"{layers.start}-{layers.stop - 1}",
            "num_params": numel, "num_tensors": len(params), "problems": problems}


def run_plan(cfg: ModelConfig, tp: int, pp: int, emit: Callable[[str], None]) -> bool:
    """Check every rank's shapes; the report lines go to ``emit`` (the CLI passes ``print``)."""
    mapping.check_layout(cfg, tp, pp, "plan")
    element = torch.empty((), dtype=torch_dtype(cfg.torch_dtype)).element_size()
    rows = [plan_rank(cfg, tp, pp, rank) for rank in range(tp * pp)]
    emit(f"{cfg.name}: TP={tp} PP={pp}, {cfg.num_hidden_layers} layers, padded vocab "
          f"{cfg.padded_vocab_size(tp)}, {cfg.torch_dtype}")
    emit(f"{'rank':>4} {'tp':>3} {'pp':>3} {'layers':>7} {'tensors':>8} {'params':>14} {'GiB':>8}  check")
    ok = True
    for row in rows:
        status = "ok" if not row["problems"] else "FAIL"
        ok &= not row["problems"]
        emit(f"{row['rank']:>4} {row['tp_rank']:>3} {row['pp_rank']:>3} {row['layers']:>7} {row['num_tensors']:>8} "
              f"{row['num_params']:>14,} {row['num_params'] * element / 2**30:>8.2f}  {status}")
        for problem in row["problems"]:
            emit(f"     {problem}")
    total = sum(r["num_params"] for r in rows)
    emit(f"total over ranks: {total:,} parameters, {total * element / 2**30:.2f} GiB; "
          + ("mapping covers every parameter of every rank with matching shapes" if ok else "PLAN FAILED"))
    return ok
