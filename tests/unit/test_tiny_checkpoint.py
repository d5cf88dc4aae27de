"""Tiny checkpoints and the locally trained tokenizer: determinism, layout, tokenization, HF loading."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_arpo.model_config import check_hf_config, load_model_config
from megatron_arpo.tiny.checkpoint import build_tiny_checkpoint, tiny_checkpoint
from megatron_arpo.tiny.checkpoint import build_weights
from megatron_arpo.tiny.tokenizer import SPECIAL_TOKENS, TOOL_TAGS, build_tokenizer

TINY_CONFIGS = ("tiny-qwen3", "tiny-qwen3-untied", "tiny-qwq")
REPO_ROOT = Path(__file__).resolve().parents[2]


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def tensor_names(ckpt: Path) -> set[str]:
    with safe_open(ckpt / "model.safetensors", framework="pt") as fh:
        return set(fh.keys())


def load_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    with safe_open(ckpt / "model.safetensors", framework="pt") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny_checkpoint(name, root / name, seed=0) for name in TINY_CONFIGS}


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoints["tiny-qwen3"])


# ---------------------------------------------------------------------------------------------- determinism

def test_same_seed_gives_byte_identical_files(checkpoints, tmp_path):
    again = build_tiny_checkpoint("tiny-qwen3", tmp_path / "again", seed=0)
    first = file_hashes(checkpoints["tiny-qwen3"])
    assert set(first) == {"config.json", "generation_config.json", "model.safetensors",
                          "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}
    assert file_hashes(again) == first


def test_different_seed_gives_different_weights_same_tokenizer(checkpoints, tmp_path):
    other = build_tiny_checkpoint("tiny-qwen3", tmp_path / "seed1", seed=1)
    base, changed = file_hashes(checkpoints["tiny-qwen3"]), file_hashes(other)
    assert base["model.safetensors"] != changed["model.safetensors"]
    for name in base:
        if name != "model.safetensors":
            assert base[name] == changed[name], name
    t0, t1 = load_tensors(checkpoints["tiny-qwen3"]), load_tensors(other)
    for name in t0:
        assert not torch.equal(t0[name], t1[name]), name  # norms too: they are drawn, not 1.0


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_norm_weights_are_random_near_one_and_distinct(checkpoints, name):
    """A mapping that swaps two norms must change the model: no norm is all-ones, no two are equal."""
    check_norms_and_biases(load_tensors(checkpoints[name]), load_model_config(name))


@pytest.mark.parametrize("name", ("tiny-qwen3-qwen-vocab", "tiny-qwq-qwen-vocab"))
def test_qwen_vocab_configs_get_random_norms_too(name):
    """The real-vocabulary tiny models draw their weights through the same build_weights."""
    cfg = load_model_config(name)
    check_norms_and_biases(build_weights(cfg, seed=0), cfg)


def check_norms_and_biases(tensors: dict, cfg) -> None:
    norms = {n: t for n, t in tensors.items() if n.endswith("norm.weight")}
    assert len(norms) == cfg.num_hidden_layers * (4 if cfg.qk_layernorm else 2) + 1
    for tensor_name, weight in norms.items():
        assert not torch.equal(weight, torch.ones_like(weight)), tensor_name
        assert 0.05 < weight.std().item() < 0.2 and (weight - 1).abs().max().item() < 0.6, tensor_name
    by_shape: dict[tuple, list] = {}
    for weight in norms.values():
        by_shape.setdefault(tuple(weight.shape), []).append(weight)
    for group in by_shape.values():
        for i, a in enumerate(group):
            assert not any(torch.equal(a, b) for b in group[i + 1:])
    if cfg.attention_bias:
        for proj in ("q", "k", "v"):
            assert tensors[f"model.layers.0.self_attn.{proj}_proj.bias"].std().item() > 0.01


def test_tokenizer_is_identical_across_processes(tmp_path):
    # Separate interpreters with different hash seeds: catches hash-map order leaking into ids or merges.
    code = ("import sys; from megatron_arpo.tiny.tokenizer import build_tokenizer; "
            "build_tokenizer(1000, sys.argv[1])")
    for run, hash_seed in (("a", "1"), ("b", "2")):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO_ROOT))
        subprocess.run([sys.executable, "-c", code, str(tmp_path / run)], check=True, env=env, cwd=REPO_ROOT)
    assert file_hashes(tmp_path / "a") == file_hashes(tmp_path / "b")


# ---------------------------------------------------------------------------------------------- layout

def test_tied_model_has_no_lm_head_and_untied_has_one(checkpoints):
    assert "lm_head.weight" not in tensor_names(checkpoints["tiny-qwen3"])
    assert "lm_head.weight" in tensor_names(checkpoints["tiny-qwen3-untied"])
    assert "lm_head.weight" in tensor_names(checkpoints["tiny-qwq"])


def test_qwen2_has_qkv_bias_and_qwen3_has_qk_norm(checkpoints):
    qwq = load_tensors(checkpoints["tiny-qwq"])
    for proj in ("q", "k", "v"):
        bias = qwq[f"model.layers.0.self_attn.{proj}_proj.bias"]
        assert bias.abs().max() > 0  # non-zero, so the bias path is exercised
    assert not any("q_norm" in n or "k_norm" in n for n in qwq)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwq
    qwen3 = tensor_names(checkpoints["tiny-qwen3"])
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= qwen3
    assert not any(n.endswith(".bias") for n in qwen3)


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_config_json_matches_model_yaml(checkpoints, name):
    ckpt = checkpoints[name]
    hf_cfg = json.loads((ckpt / "config.json").read_text())
    check_hf_config(load_model_config(name), hf_cfg)
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (987, 989, 987)
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [989, 987]
    with safe_open(ckpt / "model.safetensors", framework="pt") as fh:
        assert fh.metadata() == {"format": "pt"}
        assert fh.get_tensor("model.embed_tokens.weight").dtype == torch.float32


def test_check_hf_config_would_catch_a_mismatch(checkpoints):
    hf_cfg = json.loads((checkpoints["tiny-qwen3"] / "config.json").read_text())
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        check_hf_config(load_model_config("tiny-qwen3-untied"), hf_cfg)


def test_refuses_to_overwrite_unless_asked(checkpoints, tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_tiny_checkpoint("tiny-qwen3", target)
    assert (target / "keep.txt").exists()
    build_tiny_checkpoint("tiny-qwen3", target, overwrite=True)
    assert file_hashes(target) == file_hashes(checkpoints["tiny-qwen3"])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary siblings left behind


def test_builds_into_an_existing_empty_directory(checkpoints, tmp_path):
    (tmp_path / "empty").mkdir()
    build_tiny_checkpoint(load_model_config("tiny-qwen3"), tmp_path / "empty")
    assert file_hashes(tmp_path / "empty") == file_hashes(checkpoints["tiny-qwen3"])


def test_cache_builds_once_per_name_and_seed(checkpoints, tmp_path):
    first = tiny_checkpoint("tiny-qwen3", seed=0, root=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_checkpoint("tiny-qwen3", seed=0, root=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert file_hashes(first) == file_hashes(checkpoints["tiny-qwen3"])
    assert tiny_checkpoint("tiny-qwen3", seed=1, root=tmp_path) != first


# ---------------------------------------------------------------------------------------------- tokenizer

def test_vocabulary_size_equals_model_vocab_size(tokenizer):
    assert len(tokenizer) == load_model_config("tiny-qwen3").vocab_size == 1000
    # Every id a model can emit decodes.
    assert all(isinstance(tokenizer.decode([i]), str) for i in range(len(tokenizer)))


def test_too_small_vocab_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="vocab_size >= 269"):
        build_tokenizer(200, tmp_path)


@pytest.mark.parametrize("tag", TOOL_TAGS + SPECIAL_TOKENS)
def test_tags_are_single_tokens_also_when_glued(tokenizer, tag):
    (tag_id,) = tokenizer.encode(tag, add_special_tokens=False)
    ids = tokenizer.encode(f"x{tag}y", add_special_tokens=False)
    assert tag_id in ids and len(ids) == 3
    assert tag_id >= 987  # added tokens sit after the BPE vocabulary


def test_digits_are_split_individually(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("print(12*7) = 84", add_special_tokens=False))
    assert [t for t in tokens if any(c.isdigit() for c in t)] == ["1", "2", "7", "8", "4"]


def test_skip_special_tokens_keeps_tool_tags(tokenizer):
    text = ("<think>compute it</think><python>print(12*7)</python> <result>\n84\n</result>"
            "<think>done</think><answer>\\boxed{84}</answer>")
    ids = tokenizer.encode(f"<|im_start|>assistant\n{text}<|im_end|><|endoftext|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"assistant\n{text}"
    assert tokenizer.decode(ids) == f"<|im_start|>assistant\n{text}<|im_end|><|endoftext|>"
    # The ARPO tool result is tokenized on its own and must round-trip exactly.
    result = " <result>\n84\n</result>"
    assert tokenizer.decode(tokenizer.encode(result, add_special_tokens=False)) == result


def test_special_token_ids(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|endoftext|>", "<|im_end|>", "<|endoftext|>")
    assert set(tokenizer.all_special_tokens) == set(SPECIAL_TOKENS)
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)  # no BOS prepended


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 12*7?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nUse tools.<|im_end|>\n<|im_start|>user\nWhat is 12*7?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == rendered.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"] == tokenizer.encode(rendered, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------- transformers

@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_loads_in_transformers_with_finite_logits(checkpoints, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoints[name]
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched tensors
    state = model.state_dict()
    for tensor_name, tensor in load_tensors(ckpt).items():
        assert torch.equal(state[tensor_name], tensor), tensor_name
    cfg = load_model_config(name)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(ckpt)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12*7?"}], tokenize=False,
                                     add_generation_prompt=True)
    input_ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids).logits  # [1, seq, vocab]
    assert logits.shape == (1, input_ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_importing_the_tiny_package_is_light():
    code = ("import sys, megatron_arpo.tiny; "
            "heavy = [m for m in ('torch', 'tokenizers', 'safetensors', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT,
                   env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def test_tokenizer_none_writes_weights_and_configs_only(tmp_path):
    """Real-vocabulary ids beyond a narrowed vocabulary are dropped (transformers' padding_idx must fit)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    cfg = dataclasses.replace(load_model_config("qwen3-0.6b"), name="narrow", hidden_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                              vocab_size=256)
    out = build_tiny_checkpoint(cfg, tmp_path / "ckpt", tokenizer="none")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None and config["pad_token_id"] is None
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.vocab_size == 256
