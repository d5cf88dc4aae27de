"""The real Qwen2/Qwen3 byte-level BPE tokenizer, rebuilt from the ranks the ``dashscope`` wheel ships.

No model hub is reachable from this project's machines, but PyPI is, and Alibaba's ``dashscope`` wheel
carries ``dashscope/resources/qwen.tiktoken``: the 151,643 regular tokens that Qwen2, Qwen2.5, QwQ and
Qwen3 share (``"Hello world"`` -> ``[9707, 1879]``). This module

1. fetches that file reproducibly: ``pip download dashscope==DASHSCOPE_VERSION --no-deps`` into the
   wheel cache (``$MEGATRON_ARPO_CACHE/wheels``, default ``<repo>/.cache/wheels``; ``make venv`` does it
   ahead of the tests, see the Makefile), extracts the one member and checks its SHA-256. The wheel is
   never installed: only the ranks are needed, and dashscope's dependencies (an API client) are not;
2. converts the ranks with ``transformers.convert_slow_tokenizer.TikTokenConverter`` using Qwen's
   pre-tokenizer pattern (single digits), with Qwen's NFC normalizer;
3. adds the 26 added tokens of Qwen3's (and QwQ-32B's) ``tokenizer_config.json`` at their published ids,
   151643 ``<|endoftext|>`` ... 151668 ``</think>``, with the published ``special`` flags (the 14 control
   tokens up to ``<|video_pad|>`` are special; ``<tool_call>`` ... ``</think>`` are not, so ``<think>``
   survives ``decode(skip_special_tokens=True)``);
4. writes ``tokenizer.json``, ``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` (tokenizer class
   ``Qwen2Tokenizer``, eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, as published) and the
   generation config values of the release.

The tool tags ``<search>``, ``<python>``, ``<result>``, ``<answer>`` are NOT tokens here, as in every
published Qwen tokenizer: ``</python>`` is ``</``, ``python``, ``>`` and merges with its neighbours
(``}</`` is one token). That is what the rollout's stop-string protocol is tested against.

Chat templates: our own Jinja, written to render what the published templates render for plain
system / user / assistant / tool conversations (ChatML). ``qwen3``: the hybrid-thinking template — the
generation prompt is ``<|im_start|>assistant\\n``, or ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``
with ``enable_thinking=False``. ``qwq``: QwQ-32B's — the generation prompt opens the thinking block,
``<|im_start|>assistant\\n<think>\\n``. The published templates' function-calling branches (``tools=``,
``tool_calls``) and their reasoning-stripping of earlier assistant turns are left out: the rollout
renders one system + user prompt, which both render identically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from megatron_arpo.tiny.tokenizer import PRETOKENIZE_REGEX, dump_json, write_bytes_atomic

logger = logging.getLogger(__name__)

DASHSCOPE_VERSION = "2.0.2"
RANKS_MEMBER = "dashscope/resources/qwen.tiktoken"
RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
NUM_REGULAR_TOKENS = 151643
REPO_ROOT = Path(__file__).resolve().parents[2]

# (id, content, special) exactly as in Qwen3's tokenizer_config.json added_tokens_decoder.
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (NUM_REGULAR_TOKENS + i, content, special) for i, (content, special) in enumerate((
        ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
        ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
        ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
        ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
        ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
        ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
        ("<think>", False), ("</think>", False),
    )))
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645
THINK_ID, END_THINK_ID = 151667, 151668

_CHATML_TURNS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
QWEN3_CHAT_TEMPLATE = _CHATML_TURNS + (
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
QWQ_CHAT_TEMPLATE = _CHATML_TURNS + (
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class QwenFlavour:
    """What differs between the Qwen3 and the QwQ-32B tokenizer directories."""

    chat_template: str
    model_max_length: int
    generation_config: Mapping[str, Any]   # the release's generation_config.json (sampling defaults included)


FLAVOURS: Mapping[str, QwenFlavour] = {
    "qwen3": QwenFlavour(QWEN3_CHAT_TEMPLATE, 131072, {
        "bos_token_id": ENDOFTEXT_ID, "do_sample": True, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID, "temperature": 0.6, "top_k": 20, "top_p": 0.95}),
    "qwq": QwenFlavour(QWQ_CHAT_TEMPLATE, 131072, {
        "bos_token_id": ENDOFTEXT_ID, "do_sample": True, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID, "repetition_penalty": 1.0, "temperature": 0.6, "top_k": 40,
        "top_p": 0.95}),
}


def get_flavour(name: str) -> QwenFlavour:
    try:
        return FLAVOURS[name]
    except KeyError:
        raise ValueError(f"unknown Qwen tokenizer flavour {name!r}; supported: {', '.join(FLAVOURS)}") from None


def cache_root() -> Path:
    env = os.environ.get("MEGATRON_ARPO_CACHE")
    return Path(env) if env else REPO_ROOT / ".cache"


def wheel_path(root: Path | None = None) -> Path:
    return (root or cache_root()) / "wheels" / f"dashscope-{DASHSCOPE_VERSION}-py3-none-any.whl"


def fetch_wheel(root: Path | None = None) -> Path:
    """The pinned dashscope wheel in the cache, downloaded with pip (no dependencies) when missing."""
    wheel = wheel_path(root)
    if wheel.exists():
        return wheel
    wheel.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"dashscope=={DASHSCOPE_VERSION}", "--no-deps",
           "--only-binary=:all:", "--disable-pip-version-check", "--quiet", "-d", str(wheel.parent)]
    logger.info("fetching the Qwen BPE ranks: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.exists():
        raise RuntimeError(
            f"could not download dashscope=={DASHSCOPE_VERSION} (it ships the Qwen BPE ranks): "
            f"{(proc.stderr or proc.stdout).strip()[-800:]}\nRun `make venv` with access to the package index, or "
            f"put {wheel.name} into {wheel.parent}")
    return wheel


def qwen_ranks_file(root: Path | None = None) -> Path:
    """``qwen.tiktoken`` extracted from the pinned wheel and checked against RANKS_SHA256 (cached)."""
    out = (root or cache_root()) / "qwen" / f"qwen-{RANKS_SHA256[:16]}.tiktoken"
    if out.exists():
        return out
    with zipfile.ZipFile(fetch_wheel(root)) as wheel:
        try:
            data = wheel.read(RANKS_MEMBER)
        except KeyError:
            raise RuntimeError(f"{wheel.filename} has no {RANKS_MEMBER}; the pinned DASHSCOPE_VERSION "
                               f"{DASHSCOPE_VERSION} is wrong") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANKS_SHA256:
        raise RuntimeError(f"{RANKS_MEMBER} in dashscope {DASHSCOPE_VERSION} has SHA-256 {digest}, expected "
                           f"{RANKS_SHA256}; delete {wheel_path(root)} and fetch it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, data)
    return out


def build_backend_tokenizer(ranks_file: str | os.PathLike):
    """The ``tokenizers.Tokenizer``: converted ranks, NFC, Qwen's split pattern, the 26 added tokens."""
    # deferred: pulls in tokenizers (heavy; this module imports without it)
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer = TikTokenConverter(vocab_file=str(ranks_file), pattern=PRETOKENIZE_REGEX).converted()
    # Qwen2's tokenizer.json: BPE merges applied as usual (the converter turns on tiktoken's ignore_merges).
    tokenizer.model.ignore_merges = False
    tokenizer.normalizer = normalizers.NFC()
    if tokenizer.get_vocab_size(with_added_tokens=False) != NUM_REGULAR_TOKENS:
        raise RuntimeError(f"{ranks_file}: {tokenizer.get_vocab_size(with_added_tokens=False)} regular tokens, "
                           f"expected {NUM_REGULAR_TOKENS}")
    for token_id, content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        added = tokenizer.add_special_tokens([token]) if special else tokenizer.add_tokens([token])
        if added != 1 or tokenizer.token_to_id(content) != token_id:
            raise RuntimeError(f"added token {content!r} got id {tokenizer.token_to_id(content)}, not {token_id}")
    return tokenizer


def tokenizer_config_dict(flavour: QwenFlavour) -> dict:
    added = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": s} for i, c, s in ADDED_TOKENS}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for i, c, s in ADDED_TOKENS if s and i != ENDOFTEXT_ID],
        "bos_token": None,
        "chat_template": flavour.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": flavour.model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_qwen_tokenizer(out_dir: str | os.PathLike, flavour: str = "qwen3") -> dict[str, Any]:
    """Write the tokenizer files of ``flavour`` (qwen3 | qwq) to ``out_dir``.

    Returns the special ids for config.json (``bos_token_id``, ``eos_token_id``, ``pad_token_id``), under
    ``generation_config`` the release's generation_config.json and under ``config_fields`` other config.json
    keys of the release.
    """
    spec = get_flavour(flavour)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_backend_tokenizer(qwen_ranks_file())
    serialized = tokenizer.to_str(pretty=True)
    write_bytes_atomic(out / "tokenizer.json", (serialized + "\n").encode("utf-8"))
    model = json.loads(serialized)["model"]  # {"vocab": {token: id}, "merges": [[left, right], ...], ...}
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    write_bytes_atomic(out / "vocab.json", (json.dumps(vocab, ensure_ascii=False) + "\n").encode("utf-8"))
    merges = ["#version: 0.2"] + [" ".join(pair) for pair in model["merges"]]
    write_bytes_atomic(out / "merges.txt", ("\n".join(merges) + "\n").encode("utf-8"))
    write_bytes_atomic(out / "tokenizer_config.json", dump_json(tokenizer_config_dict(spec)))
    logger.info("wrote the Qwen tokenizer (%s, %d tokens) to %s", flavour, tokenizer.get_vocab_size(), out)
    # config.json of the releases also records the transformers version they were saved with (4.51.0 for
    # Qwen3; transformers 5 warns about the tokenizer's regex when a local config.json has none).
    return {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID,
            "generation_config": dict(spec.generation_config), "config_fields": {"transformers_version": "4.51.0"}}


def fingerprint_sources() -> list[Path]:
    """Files whose content determines the bytes this module writes (for the tiny-checkpoint cache key)."""
    return [Path(__file__)]


if __name__ == "__main__":  # `python -m megatron_arpo.tiny.qwen_tokenizer`: prefetch (make venv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(qwen_ranks_file())
