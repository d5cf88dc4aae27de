"""Deterministic tiny Hugging Face checkpoints (any registered model family) for tests and the demo.

No hub downloads are possible here, so every test and the demo builds its model locally:
``build_tiny_checkpoint("tiny-qwen3", out_dir, seed=0)`` writes a directory that
``transformers.AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained`` and vLLM load:

- ``config.json`` from :func:`megatron_arpo.model_config.hf_config_dict` (so the config and the converters
  agree), with the tokenizer's bos/eos/pad ids;
- ``generation_config.json`` with bos/pad ``<|endoftext|>`` and eos ``[<|im_end|>, <|endoftext|>]`` as in
  Qwen3's release (no sampling defaults: vLLM would adopt them as its default sampling parameters);
- ``model.safetensors``: weights drawn from one ``torch.Generator`` seeded with ``seed``, in the fixed order
  of :func:`weight_specs` (names and shapes from the family's mapping table) — linear/embedding weights
  ~ N(0, 0.02), Qwen2's q/k/v biases ~ N(0, 0.02) (not zero, so the bias path is exercised). RMSNorm and q/k-norm weights are 1 + 0.1 * N(0, 1), drawn from a
  second generator (seed + :data:`NORM_SEED_OFFSET`): not all 1.0, so a mapping that swaps two norms
  (q_norm <-> k_norm, input <-> post-attention) changes the logits and fails the parity tests, yet near
  1.0 so the model behaves as an initialised one; the other weights are the same values as with unit
  norms. Every config gets them, the real-Qwen-vocabulary ones (``tiny-*-qwen-vocab``) included. Tied
  models have no ``lm_head.weight`` tensor, as in HF's tied releases;
- the tokenizer files from :mod:`megatron_arpo.tiny.tokenizer` (vocabulary size = ``vocab_size``), or with
  ``tokenizer="qwen3"|"qwq"`` the real Qwen tokenizer, chat template and generation_config of that release
  (:mod:`megatron_arpo.tiny.qwen_tokenizer`; see ``TOKENIZER_KINDS``).

The same seed gives byte-identical files: JSON is written with sorted keys and no versions or timestamps,
safetensors orders its header deterministically and carries only ``{"format": "pt"}`` as metadata. The
directory appears atomically (built in a temporary sibling, then renamed).

:func:`tiny_checkpoint` caches builds under ``$MEGATRON_ARPO_CACHE/tiny`` (default ``<repo>/.cache/tiny``),
keyed by config name, seed and a hash of everything that determines the bytes (the model config, the
source of this module, of the tokenizer module, of ``model_config.py`` and of the family modules in
``megatron_arpo/models/``, and the torch/tokenizers/
safetensors versions). Stale entries are never deleted automatically; ``rm -rf .cache/tiny`` is safe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megatron_arpo import model_config as model_config_module
from megatron_arpo.fsutil import fsync_path
from megatron_arpo.model_config import ModelConfig, hf_config_dict, load_model_config
from megatron_arpo.models.registry import get_family
from megatron_arpo.tiny import qwen_tokenizer, tokenizer as tokenizer_module
from megatron_arpo.tiny.qwen_tokenizer import ADDED_TOKENS, build_qwen_tokenizer
from megatron_arpo.tiny.tokenizer import build_tokenizer, dump_json, write_bytes_atomic

logger = logging.getLogger(__name__)

INIT_STD = 0.02
NORM_STD = 0.1
NORM_SEED_OFFSET = 1_000_003
REPO_ROOT = Path(__file__).resolve().parents[2]

def weight_specs(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Every HF tensor of the model as ``(name, shape, init)``, in generation order.

    Names and shapes come from the family's mapping table (``FAMILY.hf_tensor_shapes``); the order is the
    table's, layer by layer, with a module's bias right after its weight. Init: ``bias`` for biases,
    ``norm`` for the other 1-D tensors (RMSNorm and q/k-norm weights), ``normal`` for the rest.
    """
    shapes = get_family(cfg.model_type).hf_tensor_shapes(cfg)
    modules: dict[str, list[str]] = {}
    for name in shapes:
        modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
    for names in modules.values():
        for name in names:
            shape = shapes[name]
            init = "bias" if name.endswith(".bias") else "norm" if len(shape) == 1 else "normal"
            yield name, shape, init


def build_weights(cfg: ModelConfig, seed: int) -> dict:
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.torch_dtype)
    if dtype is None:
        raise ValueError(f"model config {cfg.name!r}: torch_dtype {cfg.torch_dtype!r} is not supported for tiny "
                         f"checkpoints; use one of float32, bfloat16, float16")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    norm_generator = torch.Generator(device="cpu").manual_seed(seed + NORM_SEED_OFFSET)
    tensors = {}
    for name, shape, init in weight_specs(cfg):
        if init == "norm":
            value = 1.0 + NORM_STD * torch.randn(shape, generator=norm_generator, dtype=torch.float32)
        else:  # normal weights and biases: drawn in fp32, then cast, so the values do not depend on dtype
            value = torch.randn(shape, generator=generator, dtype=torch.float32) * INIT_STD
        tensors[name] = value.to(dtype).contiguous()
    return tensors


def _resolve(model_config: ModelConfig | str | os.PathLike) -> ModelConfig:
    return model_config if isinstance(model_config, ModelConfig) else load_model_config(model_config)





# Tokenizers a tiny checkpoint can carry. "local": the small trained tokenizer (vocabulary = vocab_size,
# tool tags as added tokens; fast). "qwen3" / "qwq": the real Qwen BPE (151,643 regular tokens + 26 added,
# megatron_arpo.tiny.qwen_tokenizer) with that release's chat template and generation_config; the
# model config must then have the release's padded vocab_size (151,936 Qwen3, 152,064 QwQ-32B). "none": no
# tokenizer files (weights and configs only: numerics checks at real vocabulary sizes, tools/gpu_smoke.py).
TOKENIZER_KINDS = ("local", "qwen3", "qwq", "none")


def _write_tokenizer(kind: str, cfg: ModelConfig, out: Path) -> dict:
    if kind == "local":
        return build_tokenizer(cfg.vocab_size, out)
    if kind == "none":  # the model config's ids where the vocabulary holds them; no pad (HF's padding_idx)
        ids = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id")}
        ids = {k: v if v is not None and v < cfg.vocab_size else None for k, v in ids.items()}
        return {**ids, "pad_token_id": None, "generation_config": dict(ids)}
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer {kind!r} is not one of {', '.join(TOKENIZER_KINDS)}")

    if cfg.vocab_size <= ADDED_TOKENS[-1][0]:
        raise ValueError(f"model config {cfg.name!r}: vocab_size {cfg.vocab_size} cannot hold the Qwen tokenizer "
                         f"(ids up to {ADDED_TOKENS[-1][0]}); use a config with vocab_size 151936 or 152064")
    return build_qwen_tokenizer(out, kind)


def _write_checkpoint_files(cfg: ModelConfig, out: Path, seed: int, tokenizer: str = "local") -> None:
    # deferred: pulls in safetensors (heavy; this module imports without it)
    from safetensors.torch import save as save_safetensors

    token_ids = _write_tokenizer(tokenizer, cfg, out)
    hf_cfg = hf_config_dict(dataclasses.replace(cfg, bos_token_id=token_ids["bos_token_id"],
                                                eos_token_id=token_ids["eos_token_id"]))
    hf_cfg["pad_token_id"] = token_ids["pad_token_id"]
    hf_cfg.update(token_ids.get("config_fields", {}))
    write_bytes_atomic(out / "config.json", dump_json(hf_cfg))
    generation = token_ids.get("generation_config") or {
        "bos_token_id": token_ids["bos_token_id"], "pad_token_id": token_ids["pad_token_id"],
        "eos_token_id": [token_ids["eos_token_id"], token_ids["pad_token_id"]]}
    write_bytes_atomic(out / "generation_config.json", dump_json(generation))
    weights = build_weights(cfg, seed)
    write_bytes_atomic(out / "model.safetensors", save_safetensors(weights, metadata={"format": "pt"}))


def build_tiny_checkpoint(model_config: ModelConfig | str | os.PathLike, out_dir: str | os.PathLike,
                          seed: int = 0, overwrite: bool = False, tokenizer: str = "local") -> Path:
    """Write a tiny HF checkpoint (weights, configs, tokenizer) for ``model_config`` to ``out_dir``.

    ``model_config`` is a :class:`ModelConfig` or a name/path for ``load_model_config`` ("tiny-qwen3").
    An existing non-empty ``out_dir`` is an error unless ``overwrite=True``. ``tokenizer``: one of
    TOKENIZER_KINDS. Returns ``out_dir`` as a Path.
    """
    cfg = _resolve(model_config)
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; pass a directory path for the checkpoint")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists and is not empty; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        _write_checkpoint_files(cfg, tmp, seed, tokenizer)
        fsync_path(tmp)
        if out.is_dir() and any(out.iterdir()):  # overwrite=True (checked above)
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "ckpt")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out)  # also replaces an empty directory
            except OSError as exc:
                raise FileExistsError(f"{out} appeared while building (another process?); not replacing it") \
                    from exc
        fsync_path(out.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny checkpoint %s (seed %d) at %s", cfg.name, seed, out)
    return out


def default_cache_root() -> Path:
    env = os.environ.get("MEGATRON_ARPO_CACHE")
    return Path(env) / "tiny" if env else REPO_ROOT / ".cache" / "tiny"


def checkpoint_fingerprint(cfg: ModelConfig, seed: int, tokenizer: str = "local") -> str:
    """Hash of everything that determines the bytes of ``build_tiny_checkpoint(cfg, seed=seed)``."""
    # deferred: pulls in safetensors (heavy; this module imports without it)
    import safetensors
    import tokenizers
    import torch

    digest = hashlib.sha256()
    digest.update(json.dumps({"config": cfg.to_dict(), "seed": seed, "torch": torch.__version__,
                              "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__},
                             sort_keys=True, default=str).encode())
    family_files = sorted((Path(model_config_module.__file__).parent / "models").glob("*.py"))
    for module_file in (__file__, tokenizer_module.__file__, model_config_module.__file__, *family_files):
        digest.update(Path(module_file).read_bytes())
    if tokenizer != "local":
        # deferred: pulls in transformers (heavy; this module imports without it)
        import transformers

        digest.update(f"tokenizer={tokenizer};transformers={transformers.__version__}".encode())
        for source in qwen_tokenizer.fingerprint_sources():
            digest.update(source.read_bytes())
    return digest.hexdigest()


def tiny_checkpoint(name: ModelConfig | str | os.PathLike, seed: int = 0,
                    root: str | os.PathLike | None = None, tokenizer: str = "local") -> Path:
    """A cached ``build_tiny_checkpoint`` result: built once per (config name, seed, tokenizer, code version).

    Safe under concurrent callers: the directory appears atomically, and a loser of a build race uses the
    winner's (identical) build.
    """
    cfg = _resolve(name)
    cache_root = Path(root) if root is not None else default_cache_root()
    kind = "" if tokenizer == "local" else f"-{tokenizer}"
    path = cache_root / f"{cfg.name}{kind}-seed{seed}-{checkpoint_fingerprint(cfg, seed, tokenizer)[:16]}"
    if path.is_dir() and any(path.iterdir()):
        return path
    try:
        return build_tiny_checkpoint(cfg, path, seed=seed, tokenizer=tokenizer)
    except FileExistsError:
        if path.is_dir() and any(path.iterdir()):
            return path
        raise
