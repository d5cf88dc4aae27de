"""The scenarios of ``tools/gpu_smoke.py``: the actor on one device, each a function ``(ctx, result)``.

Every scenario drives the project's own code (``MegatronActorWorker``, the HF load/export, checkpoints,
the offloader, ``ActorSync._send_ipc``, the planner, ``hf-to-megatron``) on the device ``ctx.device``
names: ``cuda`` (a real GPU: NCCL, bf16), ``cpu`` (the dry run: the same calls on gloo with the CPU compat
layer, at reduced width) or ``fake`` (the dry run on fake CUDA, ``megatron_arpo.fake_cuda.harness``: the
GPU branches at the GPU's shapes, no arithmetic, no allocator). A check that cannot be measured on the
device at hand is recorded with ``ok=None`` and the reason; a scenario whose checks are all unmeasurable
is reported as skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from launchers import planner
from megatron_arpo.config import build_config
from megatron_arpo.device.local_ranks import find_free_port
from megatron_arpo.hf.checkpoint_io import HFCheckpointReader
from megatron_arpo.model_config import ModelConfig, load_model_config
from megatron_arpo.tiny.checkpoint import build_tiny_checkpoint

# Judged against transformers' own bf16 error (fp32 transformers is the reference): the actor's mean and
# max log-prob error may exceed it by these factors (kernels differ: unfused local-spec attention vs SDPA).
MEAN_ERROR_FACTOR, MAX_ERROR_FACTOR = 1.25, 1.5
ERROR_FLOOR = 1e-4  # below this both errors are rounding noise
MEMORY_TOLERANCE = 0.10  # planner vs max_memory_reserved
# Dense bf16 peak of the cards the smoke run is lent, for the MFU (NVIDIA's datasheets, SXM parts).
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
UPDATE_LR = 2e-4  # about 1% of a weight of the init scale (0.02): above bf16 rounding (0.4%)


class Skip(Exception):
    """The scenario cannot run on this device; the message says why."""


@dataclasses.dataclass
class Context:
    device: str  # "cuda" | "cpu" | "fake"
    dry_run: bool
    work: Path
    repo: Path

    @property
    def real_gpu(self) -> bool:
        return self.device == "cuda"


class Result:
    """What a scenario found: named checks (True / False / None = not measurable here) and numbers."""

    def __init__(self):
        self.checks: list[dict] = []
        self.numbers: dict[str, Any] = {}
        self.notes: list[str] = []

    def check(self, name: str, ok: bool | None, detail: str = "") -> None:
        self.checks.append({"name": name, "ok": None if ok is None else bool(ok), "detail": detail})

    def number(self, key: str, value: Any) -> None:
        self.numbers[key] = round(value, 6) if isinstance(value, float) else value

    def note(self, text: str) -> None:
        self.notes.append(text)


# ------------------------------------------------------------------------------------------- models
def smoke_model(base: str, ctx: Context, *, layers: int, suffix: str = "") -> ModelConfig:
    """``base`` with ``layers`` layers at real width on a GPU (and fake CUDA); reduced width on the CPU."""
    cfg = load_model_config(base)
    changes: dict[str, Any] = {"name": f"{base}-{layers}l{suffix}", "num_hidden_layers": layers}
    if ctx.device == "cpu":  # same family traits (GQA, q/k norm or QKV bias, tying), CPU-sized
        changes.update(name=f"{base}-{layers}l-narrow{suffix}", hidden_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1024)
    return dataclasses.replace(cfg, **changes)


def write_model_yaml(cfg: ModelConfig, ctx: Context) -> Path:
    import yaml

    path = ctx.work / "model_configs" / f"{cfg.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)  # scenarios of a dry run may write the same config at once
    return path


def hf_checkpoint(cfg: ModelConfig, ctx: Context) -> Path:
    """Random weights (random norms included) in an HF directory, built once per work directory."""
    path = ctx.work / "checkpoints" / cfg.name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{cfg.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent scenarios of a dry run: one builds, the others wait
        if not (path / "model.safetensors").exists():
            build_tiny_checkpoint(cfg, path, seed=0, overwrite=True, tokenizer="none")
    return path


def experiment(model_yaml: Path, *, seq_len: int, micro_batch_tokens: int, lr: float = 1e-4,
               params_dtype: str = "bf16", offload: bool = False):
    response = max(seq_len // 2, 1)
    return build_config({
        "model": {"config": str(model_yaml)}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": seq_len - response},
        "rollout": {"response_length": response, "n": 2, "initial_rollouts": 2, "temperature": 1.0,
                    "entropy_window": min(8, response), "tensor_parallel": 1},
        "trainer": {"train_batch_size": 2},
        "actor": {"tensor_parallel": 1, "pipeline_parallel": 1, "params_dtype": params_dtype, "use_te": "false",
                  "micro_batch_tokens": micro_batch_tokens, "mini_batch_size": 1, "offload": offload,
                  "checkpoint": {"fully_parallel_save": False},
                  "optimizer": {"lr": lr, "weight_decay": 0.0}},
    })


def start_worker(exp, cfg: ModelConfig, role: str = "policy", packing_mode: str = "packed"):
    from megatron_arpo.actor.worker import MegatronActorWorker

    return MegatronActorWorker(exp, 0, 1, master_port=find_free_port(), role=role, model_cfg=cfg,
                               packing_mode=packing_mode)


def stop_worker(worker) -> None:
    worker.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def token_batch(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def ppo_batch(seqs: list[list[int]], old_logprobs: list[torch.Tensor], prompt: int = 4) -> dict:
    """Every other sequence with advantage +1, the rest -1; the first ``prompt`` tokens untrained."""
    return {"input_ids": seqs, "loss_mask": [[0] * prompt + [1] * (len(s) - prompt) for s in seqs],
            "advantages": [1.0 if i % 2 == 0 else -1.0 for i in range(len(seqs))],
            "old_logprobs": [t.clone() for t in old_logprobs], "group_ids": [0] * len(seqs),
            "num_mini_batches": 1}


def logprobs(worker, seqs) -> list[torch.Tensor]:
    return [t.float() for t in worker.compute_log_probs({"input_ids": seqs})["logprobs"]]


def all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x[1:] - y[1:]).abs().max()) for x, y in zip(a, b))


def mean_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    diffs = torch.cat([(x[1:] - y[1:]).abs() for x, y in zip(a, b)])
    return float(diffs.mean())


def hf_logprobs(hf_dir: Path, seqs: list[list[int]], dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """transformers' token-aligned log-probs (value t = log p(token t | tokens < t), value 0 = 0), one
    sequence per forward (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
    if next(model.parameters()).dtype != dtype:  # transformers before 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=dtype)
    model = model.to(device).eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq], device=device)
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # [s, vocab]
            values = torch.zeros(len(seq))
            values[1:] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0].cpu()
            out.append(values)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def judge_against_hf(result: Result, tag: str, actor: list, ref32: list, ref16: list) -> None:
    """The actor's error vs fp32 transformers, no worse than transformers' own bf16 error (with slack)."""
    actor_mean, actor_max = mean_abs(actor, ref32), max_abs(actor, ref32)
    hf_mean, hf_max = mean_abs(ref16, ref32), max_abs(ref16, ref32)
    for key, value in (("actor_mean_err", actor_mean), ("actor_max_err", actor_max),
                       ("hf_bf16_mean_err", hf_mean), ("hf_bf16_max_err", hf_max)):
        result.number(f"{tag}.{key}", value)
    result.number(f"{tag}.mean_err_ratio", actor_mean / max(hf_mean, ERROR_FLOOR))
    result.check(f"{tag}: mean log-prob error <= {MEAN_ERROR_FACTOR} x transformers bf16",
                 actor_mean <= MEAN_ERROR_FACTOR * hf_mean + ERROR_FLOOR, f"{actor_mean:.3g} vs {hf_mean:.3g}")
    result.check(f"{tag}: max log-prob error <= {MAX_ERROR_FACTOR} x transformers bf16",
                 actor_max <= MAX_ERROR_FACTOR * hf_max + ERROR_FLOOR, f"{actor_max:.3g} vs {hf_max:.3g}")


def device_memory() -> dict[str, int] | None:
    """The caching allocator's figures; None where there is no real allocator (CPU, fake CUDA)."""
    if not torch.cuda.is_available() or getattr(torch.version, "cuda", None) is None:
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "device_used": total - free}


def require_fake_cuda() -> None:
    """Skip (with the reason) where the fake CUDA harness cannot be built; it loads it into this process."""
    from megatron_arpo.fake_cuda.harness import FakeCudaUnavailable, load_guard

    try:
        load_guard()
    except FakeCudaUnavailable as exc:
        raise Skip(f"fake CUDA harness unavailable: {exc}") from exc


@contextlib.contextmanager
def device_session(ctx: Context):
    """Fake CUDA for ``ctx.device == "fake"`` (this process becomes rank 0 of a one-GPU NCCL world; a CPU tensor
    handed to an NCCL collective fails the scenario); nothing otherwise."""
    if ctx.device != "fake":
        yield None
        return
    from megatron_arpo.fake_cuda.harness import fake_cuda

    require_fake_cuda()
    with fake_cuda(1, 0) as session:
        yield session


# ---------------------------------------------------------------------------------------- scenarios
def numerics(ctx: Context, result: Result) -> None:
    """Qwen3- and QwQ-shaped actors in bf16 against transformers fp32; the HF export bit-exact."""
    lengths = [512, 384, 256, 96] if ctx.real_gpu else [40, 24, 17, 9]
    for base in ("qwen3-32b", "qwq-32b"):
        cfg = smoke_model(base, ctx, layers=2)
        hf_dir = hf_checkpoint(cfg, ctx)
        seqs = token_batch(cfg.vocab_size, lengths, seed=1)
        exp = experiment(write_model_yaml(cfg, ctx), seq_len=max(lengths), micro_batch_tokens=sum(lengths))
        worker = start_worker(exp, cfg, role="reference")
        worker.init_model(hf_dir=str(hf_dir))
        actor = logprobs(worker, seqs)
        export = ctx.work / "export" / cfg.name
        worker.write_hf_checkpoint(export)
        stop_worker(worker)
        device = "cuda" if ctx.real_gpu else "cpu"
        ref32 = hf_logprobs(hf_dir, seqs, torch.float32, device)
        ref16 = hf_logprobs(hf_dir, seqs, torch.bfloat16, device)
        judge_against_hf(result, base, actor, ref32, ref16)
        original, exported = HFCheckpointReader(hf_dir), HFCheckpointReader(export)
        names = sorted(original.names())
        differing = [n for n in names if not torch.equal(original.read(n), exported.read(n))] \
            if sorted(exported.names()) == names else ["<names differ>"]
        result.number(f"{base}.params", sum(original.read(n).numel() for n in names))
        result.check(f"{base}: HF export bit-exact ({len(names)} tensors)", not differing, ", ".join(differing[:5]))


def packed(ctx: Context, result: Result) -> None:
    """Several sequences per row (block-diagonal mask) against one per row, both judged against HF fp32."""
    from megatron_arpo.actor import packing

    cfg = smoke_model("qwen3-0.6b", ctx, layers=4)
    hf_dir = hf_checkpoint(cfg, ctx)
    lengths = [400, 260, 140, 120, 90, 60, 33] if ctx.real_gpu else [48, 30, 18, 14, 11, 7]
    seqs = token_batch(cfg.vocab_size, lengths, seed=2)
    exp = experiment(write_model_yaml(cfg, ctx), seq_len=max(lengths), micro_batch_tokens=2 * max(lengths))
    worker = start_worker(exp, cfg, role="reference")
    worker.init_model(hf_dir=str(hf_dir))
    plans = packing.plan_micro_batches(lengths, 2 * max(lengths), mode="packed")
    shared = sum(1 for p in plans for r in p.rows if len(r.seq_indices) > 1)
    result.number("rows_holding_several_sequences", shared)
    result.check("the packed plan puts several sequences in one row", shared > 0)
    got_packed = logprobs(worker, seqs)
    worker.packing_mode = "padded"
    got_padded = logprobs(worker, seqs)
    stop_worker(worker)
    result.number("packed_vs_padded_max_diff", max_abs(got_packed, got_padded))
    ref32 = hf_logprobs(hf_dir, seqs, torch.float32, "cuda" if ctx.real_gpu else "cpu")
    packed_mean, padded_mean = mean_abs(got_packed, ref32), mean_abs(got_padded, ref32)
    packed_max, padded_max = max_abs(got_packed, ref32), max_abs(got_padded, ref32)
    result.number("packed_mean_err", packed_mean)
    result.number("padded_mean_err", padded_mean)
    result.check("packed mean error <= 1.25 x padded", packed_mean <= 1.25 * padded_mean + ERROR_FLOOR,
                 f"{packed_mean:.3g} vs {padded_mean:.3g}")
    result.check("packed max error <= 1.5 x padded", packed_max <= 1.5 * padded_max + ERROR_FLOOR,
                 f"{packed_max:.3g} vs {padded_max:.3g}")
    result.note("THD packing (cu_seqlens) needs Transformer Engine, which cannot travel to the device; the "
                "local spec's packed rows ran instead")


def _mid_worker(ctx: Context, *, lr: float = 1e-4, role: str = "policy", offload: bool = False, load_dir=None):
    cfg = smoke_model("qwen3-0.6b", ctx, layers=4)
    hf_dir = hf_checkpoint(cfg, ctx)
    seq_len = 256 if ctx.real_gpu else 32
    exp = experiment(write_model_yaml(cfg, ctx), seq_len=seq_len, micro_batch_tokens=4 * seq_len, lr=lr,
                     offload=offload)
    worker = start_worker(exp, cfg, role=role)
    worker.init_model(hf_dir=None if load_dir else str(hf_dir), load_dir=load_dir, total_steps=100)
    seqs = token_batch(cfg.vocab_size, [seq_len - 3 * i for i in range(8)], seed=3)
    return worker, seqs, cfg, hf_dir


def _masked_mean_change(before, after, batch, sign: float) -> float:
    picked = [i for i, a in enumerate(batch["advantages"]) if a * sign > 0]
    deltas = [float(((after[i] - before[i]) * torch.tensor(batch["loss_mask"][i], dtype=torch.float32)).sum()
                    / max(sum(batch["loss_mask"][i]), 1)) for i in picked]
    return sum(deltas) / len(deltas)


def update(ctx: Context, result: Result) -> None:
    """One PPO step raises the log-probs of positive-advantage sequences and lowers the others'."""
    worker, seqs, _, _ = _mid_worker(ctx, lr=UPDATE_LR)
    before = logprobs(worker, seqs)
    batch = ppo_batch(seqs, before)
    metrics = worker.update(batch)
    after = logprobs(worker, seqs)
    stop_worker(worker)
    up, down = _masked_mean_change(before, after, batch, +1), _masked_mean_change(before, after, batch, -1)
    for key in ("loss", "grad_norm", "tokens_per_s"):
        result.number(key, float(metrics[key]))
    result.number("mean_logprob_change_positive", up)
    result.number("mean_logprob_change_negative", down)
    result.check("grad norm finite and > 0", math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0,
                 str(metrics["grad_norm"]))
    result.check("loss finite", math.isfinite(metrics["loss"]), str(metrics["loss"]))
    result.check("positive-advantage log-probs rose", up > 0, f"{up:.4g}")
    result.check("negative-advantage log-probs fell", down < 0, f"{down:.4g}")


_DETERMINISTIC_METRICS = ("loss", "pg_loss", "grad_norm", "clip_frac", "approx_kl", "lr")


def resume(ctx: Context, result: Result) -> None:
    """Save after one update; a fresh worker loaded from it gives the same log-probs and the same next update."""
    ckpt = ctx.work / "resume-ckpt"
    worker, seqs, _, _ = _mid_worker(ctx)
    first = ppo_batch(seqs, logprobs(worker, seqs))
    worker.update(first)
    path = worker.save(str(ckpt), extra_state={"smoke": True}, step=1)
    saved = logprobs(worker, seqs)
    second = ppo_batch(seqs, saved)
    m_ref = worker.update(second)
    after_ref = logprobs(worker, seqs)
    stop_worker(worker)
    worker, _, _, _ = _mid_worker(ctx, load_dir=path)
    loaded = logprobs(worker, seqs)
    m_new = worker.update(second)
    after_new = logprobs(worker, seqs)
    stop_worker(worker)
    result.number("checkpoint_bytes", sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()))
    result.check("log-probs after load bit-identical", all_equal(saved, loaded),
                 f"max diff {max_abs(saved, loaded):.3g}")
    differing = [k for k in _DETERMINISTIC_METRICS if m_ref.get(k) != m_new.get(k)]
    result.check("next update's metrics identical", not differing,
                 "; ".join(f"{k}: {m_ref.get(k)} vs {m_new.get(k)}" for k in differing))
    result.check("log-probs after the next update bit-identical", all_equal(after_ref, after_new),
                 f"max diff {max_abs(after_ref, after_new):.3g}")


def conversion(ctx: Context, result: Result) -> None:
    """``python -m conversion hf-to-megatron`` (torch-free writer) loads and gives the HF load's log-probs."""
    worker, seqs, cfg, hf_dir = _mid_worker(ctx, role="reference")
    direct = logprobs(worker, seqs)
    stop_worker(worker)
    out = ctx.work / "converted"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "conversion", "hf-to-megatron", "--hf", str(hf_dir), "--out",
                           str(out), "--overwrite"], capture_output=True, text=True, cwd=ctx.repo, timeout=300)
    result.number("convert_s", time.perf_counter() - start)
    result.check("hf-to-megatron exits 0", proc.returncode == 0, proc.stderr.strip()[-500:])
    if proc.returncode != 0:
        return
    worker, _, _, _ = _mid_worker(ctx, role="reference", load_dir=str(out))
    converted = logprobs(worker, seqs)
    stop_worker(worker)
    result.check("log-probs of the converted checkpoint bit-identical to the HF load", all_equal(direct, converted),
                 f"max diff {max_abs(direct, converted):.3g}")


def _optimizer_state(worker) -> dict[str, torch.Tensor]:
    out = {}
    for c, opt in enumerate(getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])):
        for i, state in enumerate(opt.optimizer.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"{c}.{i}.{key}"] = value.detach().to("cpu", copy=True)
    return out


def offload(ctx: Context, result: Result) -> None:
    """Offload frees what it reports; onload restores every optimizer byte; log-probs unchanged throughout."""
    worker, seqs, _, _ = _mid_worker(ctx, offload=True)
    batch = ppo_batch(seqs, logprobs(worker, seqs))
    worker.update(batch)
    before = logprobs(worker, seqs)
    state = _optimizer_state(worker)
    resident = worker.offloaded_bytes()
    mem_before = device_memory()
    moved = worker.offload_state()
    mem_after = device_memory()
    claimed = int(moved["offload_optimizer_bytes"] + moved["offload_grad_bytes"])
    result.number("claimed_bytes", claimed)
    result.number("offload_s", moved["offload_s"])
    result.check("claimed bytes = what was resident", claimed == sum(resident.values()),
                 f"{claimed} vs {resident}")
    result.check("nothing resident after offload", not any(worker.offloaded_bytes().values()),
                 str(worker.offloaded_bytes()))
    if mem_before is None:
        result.check("device memory freed = claimed", None, f"no allocator on {ctx.device}")
    else:
        freed = mem_before["allocated"] - mem_after["allocated"]
        result.number("freed_bytes", freed)
        result.check("device memory freed = claimed (within 1%)", abs(freed - claimed) <= 0.01 * claimed + 2**21,
                     f"freed {freed}, claimed {claimed}")
    offloaded = logprobs(worker, seqs)
    back = worker.onload_state()
    result.number("onload_s", back["onload_s"])
    restored = _optimizer_state(worker)
    differing = [k for k in state if k not in restored or not torch.equal(state[k], restored[k])]
    result.check(f"optimizer state bit-identical after onload ({len(state)} tensors)", not differing,
                 ", ".join(differing[:5]))
    result.check("log-probs unchanged while offloaded and after", all_equal(before, offloaded)
                 and all_equal(before, logprobs(worker, seqs)))
    metrics = worker.update(batch)
    result.check("an update after onload runs (grad norm finite)", math.isfinite(metrics["grad_norm"]))
    stop_worker(worker)


def ipc(ctx: Context, result: Result) -> None:
    """``ActorSync._send_ipc`` into a second process that consumes the handles as vLLM's packed IPC engine."""
    from gpu_smoke_ipc import run_ipc_syncs

    worker, _, cfg, _ = _mid_worker(ctx, role="reference")
    try:
        run_ipc_syncs(worker, ctx, result, num_syncs=5, bucket_bytes=(64 if ctx.real_gpu else 1) * 2**20)
    finally:
        stop_worker(worker)


# --------------------------------------------------------------------------------- memory, throughput
MEMORY_BASE = "qwen3-4b"
MEMORY_FRACTIONS = (0.25, 0.5, 0.85)  # of the card's memory, as the planner predicts it; the last near the card
MEMORY_SEQ, MEMORY_TOKENS = 1024, 4096


def _plan_input(cfg: ModelConfig, tokens: int, seq: int) -> planner.PlanInput:
    return planner.PlanInput(model=cfg, nodes=1, gpus_per_node=1, tp=1, pp=1, dp=1, micro_batch_tokens=tokens,
                             seq_len=seq, layer_spec="local", recompute="none", entropy=False)


def predicted_bytes(cfg: ModelConfig, tokens: int, seq: int) -> dict[str, float]:
    _, worst = planner.actor_memory(_plan_input(cfg, tokens, seq), 1)
    return worst


def layers_for(total_bytes: int, fraction: float) -> int:
    """The most layers of ``MEMORY_BASE``'s width whose predicted peak stays within ``fraction`` of the card."""
    base = load_model_config(MEMORY_BASE)
    best = 1
    for layers in range(1, base.num_hidden_layers + 1):
        cfg = dataclasses.replace(base, num_hidden_layers=layers)
        if predicted_bytes(cfg, MEMORY_TOKENS, MEMORY_SEQ)["total"] <= fraction * total_bytes:
            best = layers
    return best


def _random_init_worker(ctx: Context, cfg: ModelConfig, seq: int, tokens: int):
    exp = experiment(write_model_yaml(cfg, ctx), seq_len=seq, micro_batch_tokens=tokens)
    worker = start_worker(exp, cfg)
    worker.init_model(total_steps=10)  # random init: no checkpoint at these sizes
    return worker


def _memory_cfg(layers: int) -> ModelConfig:
    return dataclasses.replace(load_model_config(MEMORY_BASE), name=f"{MEMORY_BASE}-{layers}l", num_hidden_layers=layers)


@contextlib.contextmanager
def _steady_state(ctx: Context, cfg: ModelConfig):
    """A random-init worker after one update over one full micro-batch, its allocator peaks reset: the next
    update is the steady state the planner predicts (Adam's moments, 8 B per parameter, which the first step
    creates, are held through every later forward and backward). Yields ``(worker, batch)``."""
    from megatron_arpo.fake_cuda.memory_probe import probe_batch

    with device_session(ctx):
        worker = _random_init_worker(ctx, cfg, MEMORY_SEQ, MEMORY_TOKENS)
        batch = probe_batch(MEMORY_SEQ, MEMORY_TOKENS, 1, cfg.vocab_size)
        worker.update(batch)
        if device_memory() is not None:
            torch.cuda.reset_peak_memory_stats()
        yield worker, batch
        worker.shutdown()


def memory_shape(ctx: Context, layers: int) -> dict:
    """One shape in a fresh process: the allocator's peaks in the steady-state update."""
    cfg = _memory_cfg(layers)
    with _steady_state(ctx, cfg) as (worker, batch):
        worker.update(batch)
        peaks = None
        if device_memory() is not None:
            peaks = {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}
    return {"layers": layers, "params": planner.rank_param_counts(cfg).total,
            "predicted": predicted_bytes(cfg, MEMORY_TOKENS, MEMORY_SEQ), "measured": peaks}


def memory_census(ctx: Context, layers: int) -> dict:
    """The same shape's steady-state update under torch's MemTracker, as the fake-CUDA probe runs it: the
    bytes of each planner line at the forward/backward peak and at the optimizer step's, the activations one
    micro-batch keeps, and the allocator's peak before the step. A diagnostic for the planner's calibration."""
    from megatron_arpo.fake_cuda.memory_probe import breakdown, tracked_update
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    with _steady_state(ctx, _memory_cfg(layers)) as (worker, batch):
        allocator: dict = {}

        def before_step(*_) -> None:  # a step pre-hook returns None (or new args)
            allocator.setdefault("before_step", torch.cuda.max_memory_allocated() if device_memory() else None)

        hook = register_optimizer_step_pre_hook(before_step)
        try:
            tracked = tracked_update(worker, batch, next(worker.model.parameters()).device)
        finally:
            hook.remove()
    grads, main = tracked["grads"], tracked["main"]
    return {"forward_backward": breakdown(tracked["train_peak"], grads, main),
            "optimizer_step": breakdown(tracked["peak"], grads, main), "kept": tracked["kept"],
            "allocator_before_step": allocator.get("before_step")}


def memory(ctx: Context, result: Result) -> None:
    """The planner's per-rank prediction against the allocator's peaks, for three shapes."""
    total = torch.cuda.get_device_properties(0).total_memory if ctx.device == "cuda" else None
    if total is None:  # fake CUDA: the harness's card (an 80 GiB H100), in the child processes
        from megatron_arpo.fake_cuda.harness import DEVICE_MEMORY_BYTES as total

        require_fake_cuda()
    result.number("card_bytes", total)
    shapes = sorted({layers_for(total, f) for f in MEMORY_FRACTIONS})
    for layers in shapes:
        tag = f"{layers}l"
        try:
            shape = run_child("memory_shape", ctx, {"layers": layers}, timeout=240)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # e.g. out of memory: the other shapes still run
            result.check(f"{tag}: built and trained", False, str(exc)[-800:])
            continue
        predicted = shape["predicted"]["total"]
        result.number(f"{tag}.predicted_gib", predicted / 2**30)
        result.number(f"{tag}.params", shape["params"])
        if shape["measured"] is None:
            result.check(f"{tag}: planner within {MEMORY_TOLERANCE:.0%} of max_memory_reserved", None,
                         f"no allocator on {ctx.device}; the shape built and trained")
            continue
        reserved, allocated = shape["measured"]["max_reserved"], shape["measured"]["max_allocated"]
        result.number(f"{tag}.max_reserved_gib", reserved / 2**30)
        result.number(f"{tag}.max_allocated_gib", allocated / 2**30)
        result.number(f"{tag}.ratio_reserved", predicted / reserved)
        result.number(f"{tag}.ratio_allocated", predicted / allocated)
        result.check(f"{tag}: planner within {MEMORY_TOLERANCE:.0%} of max_memory_reserved",
                     abs(predicted / reserved - 1) <= MEMORY_TOLERANCE, f"ratio {predicted / reserved:.3f}")
    # Where the prediction and the device part: each planner line at two shapes (their difference is per layer).
    for layers in shapes[:2]:
        try:
            census = run_child("memory_census", ctx, {"layers": layers}, timeout=240)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            result.note(f"{layers}l census failed: {str(exc)[-300:]}")
            continue
        predicted = predicted_bytes(_memory_cfg(layers), MEMORY_TOKENS, MEMORY_SEQ)
        for line in ("params", "grads", "optimizer", "activations", "temporaries"):
            result.number(f"{layers}l.planner.{line}_gib", predicted[line] / 2**30)
        for phase in ("forward_backward", "optimizer_step"):
            for line, value in census[phase].items():
                result.number(f"{layers}l.census.{phase}.{line}_gib", value / 2**30)
        result.number(f"{layers}l.census.kept_per_micro_batch_gib", census["kept"] / 2**30)
        if census["allocator_before_step"] is not None:
            result.number(f"{layers}l.census.max_allocated_before_step_gib", census["allocator_before_step"] / 2**30)


THROUGHPUT_BASE, THROUGHPUT_LAYERS = "qwen3-4b", 16
THROUGHPUT_SEQ, THROUGHPUT_TOKENS, THROUGHPUT_SEQS = 1024, 4096, 16


def forward_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Matmul FLOPs of one token's forward: the linear layers, the LM head, causal attention scores."""
    shapes = planner.layer_tensor_shapes(cfg)
    linear = sum(math.prod(s) for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2)
    q_dim = cfg.num_attention_heads * cfg.head_dim
    attention = 2 * 2 * (seq / 2) * q_dim  # QK^T and AV, half the keys on average (causal)
    return 2.0 * cfg.num_hidden_layers * linear + cfg.num_hidden_layers * attention + 2.0 * cfg.hidden_size * cfg.vocab_size


def _peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name and "PCIe" not in name), None)


def _timed(fn: Callable[[], Any]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def throughput(ctx: Context, result: Result) -> None:
    """Update and log-prob tokens/s of a mid-size actor (random init), and the model FLOPs utilisation."""
    from megatron_arpo.fake_cuda.memory_probe import probe_batch

    cfg = dataclasses.replace(load_model_config(THROUGHPUT_BASE), name=f"{THROUGHPUT_BASE}-{THROUGHPUT_LAYERS}l",
                              num_hidden_layers=THROUGHPUT_LAYERS)
    # Fake CUDA: the same calls once over one micro-batch (no arithmetic to time; every op costs host time).
    num_seqs, repeats = (THROUGHPUT_SEQS, 2) if ctx.real_gpu else (THROUGHPUT_TOKENS // THROUGHPUT_SEQ, 1)
    with device_session(ctx):
        worker = _random_init_worker(ctx, cfg, THROUGHPUT_SEQ, THROUGHPUT_TOKENS)
        batch = probe_batch(THROUGHPUT_SEQ, THROUGHPUT_TOKENS, num_seqs * THROUGHPUT_SEQ // THROUGHPUT_TOKENS,
                            cfg.vocab_size)
        tokens = sum(len(s) for s in batch["input_ids"])
        if ctx.real_gpu:  # warm-up: allocator, cuBLAS handles, Adam state
            worker.update(batch)
            worker.compute_log_probs({"input_ids": batch["input_ids"]})
        update_s = min(_timed(lambda: worker.update(batch)) for _ in range(repeats))
        logprob_s = min(_timed(lambda: worker.compute_log_probs({"input_ids": batch["input_ids"]}))
                        for _ in range(repeats))
        name = torch.cuda.get_device_name(0)
        worker.shutdown()
    flops = forward_flops_per_token(cfg, THROUGHPUT_SEQ)
    result.number("params", planner.rank_param_counts(cfg).total)
    result.number("tokens_per_update", tokens)
    result.number("device", name)
    if not ctx.real_gpu:
        result.check("update and log-prob throughput measured", None,
                     f"{ctx.device}: timings are not a GPU's; the code path ran at the GPU's shapes")
        return
    update_tps, logprob_tps = tokens / update_s, tokens / logprob_s
    result.number("update_tokens_per_s", update_tps)
    result.number("logprob_tokens_per_s", logprob_tps)
    peak = _peak_flops(name)
    if peak is None:
        result.note(f"no bf16 peak known for {name!r}: MFU not computed")
    else:
        result.number("update_mfu", 3 * flops * update_tps / peak)
        result.number("logprob_mfu", flops * logprob_tps / peak)
    result.check("update and log-prob throughput measured", update_tps > 0 and logprob_tps > 0)


# ------------------------------------------------------------------------------- injected (the tests)
def _fail(ctx: Context, result: Result) -> None:
    result.check("an injected failing check", False, "this scenario exists to test the report")


def _raise(ctx: Context, result: Result) -> None:
    raise RuntimeError("an injected error (this scenario exists to test the report)")


def _hang(ctx: Context, result: Result) -> None:
    time.sleep(3600)


def _crash(ctx: Context, result: Result) -> None:
    os.abort()


SCENARIOS: dict[str, Callable[[Context, Result], None]] = {
    "numerics": numerics, "packed": packed, "update": update, "resume": resume, "conversion": conversion,
    "offload": offload, "ipc": ipc, "memory": memory, "throughput": throughput,
}
INJECTED = {"_fail": _fail, "_raise": _raise, "_hang": _hang, "_crash": _crash}
CHILDREN = {"memory_shape": memory_shape, "memory_census": memory_census}


# ----------------------------------------------------------------------------------- child processes
def run_child(name: str, ctx: Context, args: dict, timeout: float) -> Any:
    """``CHILDREN[name](ctx, **args)`` in a fresh process (clean allocator peaks, one fake session each)."""
    spec = ctx.work / f"child-{name}-{time.monotonic_ns()}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(json.dumps({"name": name, "ctx": _ctx_dict(ctx), "args": args}))
    proc = subprocess.run([sys.executable, str(Path(__file__)), str(spec), str(out)], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"child {name}({args}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _ctx_dict(ctx: Context) -> dict:
    return {"device": ctx.device, "dry_run": ctx.dry_run, "work": str(ctx.work), "repo": str(ctx.repo)}


def context_from(data: dict) -> Context:
    return Context(device=data["device"], dry_run=data["dry_run"], work=Path(data["work"]), repo=Path(data["repo"]))


if __name__ == "__main__":  # a child process of run_child
    spec = json.loads(Path(sys.argv[1]).read_text())
    value = CHILDREN[spec["name"]](context_from(spec["ctx"]), **spec["args"])
    Path(sys.argv[2]).write_text(json.dumps(value))
