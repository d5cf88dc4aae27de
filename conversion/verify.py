"""``python -m conversion verify``: round trip bit-exactness and HF vs Megatron logits parity, as a table.

1. Round trip: HF -> Megatron distributed checkpoint -> HF in a temporary directory; every tensor is
   compared with the original (name set, shape, dtype, values bit for bit).
2. For each layout (default TP=1, TP=2 and PP=2), ``tp * pp`` gloo processes build the Megatron model in
   fp32, load the HF weights through the live path and compare logits with transformers on the same
   tokens (max abs difference < 1e-4) and every exported tensor with the original
   (:func:`conversion.parity.parity_worker`). The export is compared in the checkpoint's own dtype:
   a bf16 checkpoint is upcast into the fp32 model and exported back to bf16, an exact round trip, so
   any difference is a mapping fault, not rounding.

Meant for models that fit in memory a few times over (each rank also holds the HF model in fp32).
"""

from __future__ import annotations

import logging
from typing import Callable
import tempfile
from pathlib import Path

import torch

from conversion.parity import parity_worker

from megatron_arpo.device.local_ranks import run_distributed

from megatron_arpo.hf.checkpoint_io import HFCheckpointReader

from megatron_arpo.model_config import load_model_config, model_config_from_hf, read_hf_config

logger = logging.getLogger(__name__)

LOGIT_TOLERANCE = 1e-4
DEFAULT_LAYOUTS = ((1, 1), (2, 1), (1, 2))


def compare_hf_dirs(original: str | Path, converted: str | Path) -> list[str]:
    """Per-tensor differences between two HF checkpoints (empty list when bit-exact)."""
    a, b = HFCheckpointReader(original), HFCheckpointReader(converted)
    problems = [f"{n}: missing after round trip" for n in sorted(set(a.names()) - set(b.names()))]
    problems += [f"{n}: not in the original" for n in sorted(set(b.names()) - set(a.names()))]
    for name in sorted(set(a.names()) & set(b.names())):
        x, y = a.read(name), b.read(name)
        if x.shape != y.shape:
            problems.append(f"{name}: shape {list(x.shape)} -> {list(y.shape)}")
        elif x.dtype != y.dtype:
            problems.append(f"{name}: dtype {x.dtype} -> {y.dtype}")
        elif not torch.equal(x, y):
            problems.append(f"{name}: values differ (max abs {(x.float() - y.float()).abs().max().item():.3g})")
    return problems


def run_verify(hf_dir: str, emit: Callable[[str], None], model_config: str | None = None, layouts=None,
               timeout: float = 600) -> bool:
    """Round trip + parity checks; the report table goes to ``emit`` (the CLI passes ``print``)."""
    # deferred: pulls in numpy (heavy; this module imports without it)
    from conversion.dist_ckpt import convert_hf_to_megatron, convert_megatron_to_hf

    cfg = load_model_config(model_config) if model_config else model_config_from_hf(read_hf_config(hf_dir))
    layouts = list(layouts or DEFAULT_LAYOUTS)
    rows: list[tuple[str, str, str]] = []
    ok = True
    num_tensors = len(HFCheckpointReader(hf_dir).names())
    with tempfile.TemporaryDirectory(prefix="conversion-verify-") as tmp:
        tp0, pp0 = max(layouts)
        convert_hf_to_megatron(hf_dir, Path(tmp) / "megatron", tp=tp0, pp=pp0, model_cfg=cfg)
        convert_megatron_to_hf(Path(tmp) / "megatron", Path(tmp) / "hf", model_cfg=cfg)
        problems = compare_hf_dirs(hf_dir, Path(tmp) / "hf")
    ok &= not problems
    rows.append(("round trip HF->Megatron->HF", f"{num_tensors - len(problems)}/{num_tensors} tensors bit-exact",
                 "PASS" if not problems else "FAIL"))
    for problem in problems[:20]:
        emit(f"  mismatch: {problem}")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    for tp, pp in layouts:
        results = run_distributed(parity_worker, tp * pp, hf_dir, model_config, tp, pp, tokens, timeout=timeout)
        diff = max(r["max_abs_diff"] for r in results if r["max_abs_diff"] is not None)
        mismatches = sorted({m for r in results for m in r["mismatches"]})
        passed = diff < LOGIT_TOLERANCE
        ok &= passed and not mismatches
        rows.append((f"logits HF vs Megatron TP={tp} PP={pp}", f"max abs diff {diff:.2e} (< {LOGIT_TOLERANCE:g})",
                     "PASS" if passed else "FAIL"))
        rows.append((f"export TP={tp} PP={pp}", f"{results[0]['num_exported'] - len(mismatches)}/{num_tensors} "
                     f"tensors bit-exact in {results[0]['dtype']}", "PASS" if not mismatches else "FAIL"))
        for problem in mismatches[:20]:
            emit(f"  mismatch: {problem}")
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    emit(f"{'check':<{width}}  {'result':<{vwidth}}  status")
    for check, value, status in rows:
        emit(f"{check:<{width}}  {value:<{vwidth}}  {status}")
    emit("verify: " + ("all checks passed" if ok else "FAILED"))
    return ok
